"""Make torch.ao's ``prepare_fx`` / ``prepare_qat_fx`` cheaper, and its result picklable, for one call.

Profile of ``prepare_qat_fx`` on a chain of 200 conv-bn-relu blocks (``python -m benchmarks scaling
--profile``): of ~5,300 observer / fake-quant constructions only ~1,200 end up in the model. The rest
are built to be inspected and thrown away:

* ``qconfig._add_module_to_qconfig_obs_ctr`` (called per module and qconfig) constructs each observer
  once just to learn whether its constructor takes ``factory_kwargs``, then wraps the constructor
  with a *local* function (which cannot be pickled) that iterates every parameter and buffer of the
  module for every observer it builds.
* ``fx.utils._qconfig_satisfies_dtype_config_constraints`` (per node and argument) constructs the
  activation or weight observer to read its dtype, quant range and eps; ``utils.get_qconfig_dtypes``
  and ``qconfig._is_reuse_input_qconfig`` construct both to read their dtypes and kinds.

:func:`faster_prepare` replaces both, for the duration of one prepare call, with versions that give the
same answers: the constructor check is remembered per constructor, the device lookup is a picklable
object that stops at the first parameter or buffer, and the constraint check is remembered per
(underlying constructor, activation/weight, backend constraint). torch.ao's other quadratic term
(``dict(model.named_modules())`` rebuilt per instrumented node in ``insert_observers_for_model``) is
left alone. torch.ao's tracer also records each node's Python stack (nothing here reads it), and the frame
filter doing so imports torch.export and aot_autograd the first time: 0.23-1.1 s of a process's first prepare;
within the block it records none. ``engine_options={"fast_prepare": False}`` turns this off.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Callable, Iterator, Optional

from torch import nn


class ModuleDevice:
    """``factory_kwargs`` for the observers of ``module``: its device (torch.ao's closure, picklable).

    torch.ao collects the set of devices of all parameters and buffers and takes an arbitrary one;
    a module whose tensors live on one device (the only case where that choice is well defined)
    gets the same answer from its first tensor.

    Args:
        module: the module whose first parameter (or buffer) gives the device; calling the object
            returns ``{"device": ...}``, or ``None`` when the module has no tensors.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self) -> Optional[dict[str, Any]]:
        first = next(itertools.chain(self.module.parameters(), self.module.buffers()), None)
        return None if first is None else {"device": first.device}


def _module_qconfig_factory() -> Callable[[Any, Optional[nn.Module]], Any]:
    from torch.ao.quantization.qconfig import QConfig

    accepts: dict[int, tuple[bool, Any]] = {}  # id(constructor) -> (takes factory_kwargs, constructor kept alive)

    def takes_factory_kwargs(constructor: Any) -> bool:
        known = accepts.get(id(constructor))
        if known is None:
            try:
                constructor.with_args(factory_kwargs=None)()
                known = (True, constructor)
            except (AttributeError, TypeError):  # not a partial / no factory_kwargs: as torch.ao
                known = (False, constructor)
            accepts[id(constructor)] = known
        return known[0]

    def on_module_device(constructor: Any, module: nn.Module) -> Any:
        # a child inherits its parent's wrapped constructor: re-wrap the one underneath, as torch.ao's
        # with_callable_args would replace the parent's factory_kwargs with the child's
        base = getattr(constructor, "_qlightning_base", constructor)
        if not takes_factory_kwargs(base):
            return constructor
        wrapped = base.with_callable_args(factory_kwargs=ModuleDevice(module))
        wrapped._qlightning_base = base  # what the constraint check below is keyed on
        return wrapped

    def add_module_to_qconfig_obs_ctr(qconfig: Any, module: Optional[nn.Module]) -> Any:
        if module is None or qconfig is None or qconfig._fields != ("activation", "weight"):
            return qconfig
        return QConfig(on_module_device(qconfig.activation, module), on_module_device(qconfig.weight, module))

    return add_module_to_qconfig_obs_ctr


def _constraint_check(original: Callable[..., bool]) -> Callable[..., bool]:
    seen: dict[tuple[int, bool, int], tuple[bool, Any]] = {}

    def check(qconfig: Any, dtype_with_constraints: Any, is_activation: bool = True) -> bool:
        if qconfig is None:
            return original(qconfig, dtype_with_constraints, is_activation)
        constructor = qconfig.activation if is_activation else qconfig.weight
        base = getattr(constructor, "_qlightning_base", constructor)
        key = (id(base), bool(is_activation), id(dtype_with_constraints))
        if key not in seen:
            seen[key] = (original(qconfig, dtype_with_constraints, is_activation), (base, dtype_with_constraints))
        return seen[key][0]

    return check


def _per_constructors(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``original(qconfig)`` remembered per (activation, weight) constructor pair: for answers that only
    depend on what the constructors build (dtypes, observer kinds), not on the module's device."""
    seen: dict[tuple[int, int], tuple[Any, Any]] = {}

    def remembered(qconfig: Any) -> Any:
        if qconfig is None:
            return original(qconfig)
        pair = tuple(getattr(c, "_qlightning_base", c) for c in (qconfig.activation, qconfig.weight))
        key = (id(pair[0]), id(pair[1]))
        if key not in seen:
            seen[key] = (original(qconfig), pair)
        return seen[key][0]

    return remembered


@contextlib.contextmanager
def faster_prepare(enabled: bool = True) -> Iterator[None]:
    """Within this block, torch.ao's FX prepare skips the throw-away observer constructions (module doc).

    Args:
        enabled: patch torch.ao for the block; ``False`` leaves it unchanged (``fast_prepare=False``).
    """
    if not enabled:
        yield
        return
    import importlib

    eager = importlib.import_module("torch.ao.quantization.quantize")
    # the module, not the function of the same name that torch.ao.quantization.fx exports
    fx_prepare = importlib.import_module("torch.ao.quantization.fx.prepare")
    qconfig_mapping_utils = importlib.import_module("torch.ao.quantization.fx.qconfig_mapping_utils")

    utils = importlib.import_module("torch.ao.quantization.utils")
    fx_config = importlib.import_module("torch.fx.config")
    add = _module_qconfig_factory()
    dtypes = _per_constructors(utils.get_qconfig_dtypes)
    patches = [
        (utils, "get_qconfig_dtypes", dtypes),
        (fx_prepare, "get_qconfig_dtypes", dtypes),
        (qconfig_mapping_utils, "get_qconfig_dtypes", dtypes),
        (fx_prepare, "_is_reuse_input_qconfig", _per_constructors(fx_prepare._is_reuse_input_qconfig)),
        (qconfig_mapping_utils, "_add_module_to_qconfig_obs_ctr", add),
        (eager, "_add_module_to_qconfig_obs_ctr", add),
        (fx_prepare, "_qconfig_satisfies_dtype_config_constraints",
         _constraint_check(fx_prepare._qconfig_satisfies_dtype_config_constraints)),
        # torch.ao's tracer records each node's Python stack, whose filter imports torch.export and
        # aot_autograd on first use: 0.23-0.35 s of the digits CNN's first prepare, 0.7-1.1 s of resnet50's
        (fx_config, "do_not_emit_stack_traces", True),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, replacement in patches:
            setattr(owner, name, replacement)
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
