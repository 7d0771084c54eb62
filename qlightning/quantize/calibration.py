"""Calibration and post-training quantization of plain modules: engine-neutral, Lightning-free.

:func:`calibrate_and_convert` is static PTQ of a copy of a module on given inputs; :func:`ptq_baseline`
adds equalization and is the int8 baseline a QAT run shows beside its own; :func:`run_to_targets`
runs a step only as far as the quantized submodules; :func:`float_module_from` rebuilds the float
module a QAT-prepared one came from.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from qlightning.core.inputs import Inputs, as_inputs, evaluating, input_hooks
from qlightning.engines import QuantEngine, QuantSpec, get_engine
from qlightning.engines.fx.qconfigs import ptq_qconfig_mapping
from qlightning.errors import QLightningError


class _TargetsDone(Exception):
    """Raised from a forward hook once every target submodule has run on the current batch."""


def run_to_targets(
    pl_module: nn.Module,
    targets: Sequence[str],
    run: Callable[[], Any],
    on_input: Optional[Callable[[str, Inputs], None]] = None,
    inputs_only: bool = False,
) -> list[str]:
    """Call ``run()`` (a step of ``pl_module``) under ``no_grad`` in eval mode and stop as soon as
    every target submodule has finished its forward; returns the targets that ran.

    The rest of the step (loss, metrics, ``self.log``) never runs, so calibration does not touch
    metric states or the logger. ``on_input(name, inputs)`` sees each target's inputs.
    A target called several times in one step is observed on its first call only.

    Args:
        pl_module: the model the step runs.
        targets: names of its submodules to run up to.
        run: one step of ``pl_module`` (e.g. ``lambda: pl_module.training_step(batch, 0)``).
        on_input: called with each target's name and inputs (as given, not copied) on its first call.
        inputs_only: stop once every target's inputs were seen, before the last one's forward runs
            (collecting inputs needs no target forward; calibrating observers does).
    """
    done: list[str] = []
    seen: list[str] = []

    def pre(name: str, inputs: Inputs) -> None:
        if name in seen:
            return
        seen.append(name)
        if on_input is not None:
            on_input(name, inputs)
        if inputs_only and len(seen) == len(targets):
            done.extend(seen)
            raise _TargetsDone

    def post(name: str) -> None:
        if name not in done:
            done.append(name)
        if len(done) == len(targets):
            raise _TargetsDone

    try:
        with input_hooks({name: pl_module.get_submodule(name) for name in targets}, pre, post), evaluating(pl_module):
            run()
    except _TargetsDone:
        pass
    return done


def spec_for_ptq(spec: QuantSpec, qconfig_mapping: Any, equalization_config: Any) -> QuantSpec:
    """The PTQ twin of ``spec``: observers instead of fake-quants, the same dtypes and ranges.

    Args:
        spec: the (QAT or PTQ) spec of the run.
        qconfig_mapping: the PTQ mapping to use; ``None``: ``spec``'s own, turned into its PTQ counterpart when it is a QAT mapping.
        equalization_config: FX input-weight equalization for the PTQ prepare, or ``None``.
    """
    mapping = qconfig_mapping
    if mapping is None and spec.qconfig_mapping is not None:
        mapping = spec.qconfig_mapping
        if spec.is_qat:  # a QAT mapping (fake-quants): its PTQ counterpart, same dtypes and ranges
            mapping = ptq_qconfig_mapping(mapping)
    options = dict(spec.options)
    options.pop("equalization_config", None)
    if equalization_config is not None:
        options["equalization_config"] = equalization_config
    return dataclasses.replace(spec, is_qat=False, qconfig_mapping=mapping, options=options)


def to_device(value: Any, device: torch.device) -> Any:
    """Every tensor of a (nested) value, or of an ``Inputs``, moved to ``device``.

    Args:
        value: a tensor, ``Inputs``, or a (nested) tuple, list or dict of them.
        device: where to move them.
    """
    if isinstance(value, Inputs):
        return Inputs(to_device(value.args, device), to_device(value.kwargs, device))
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def calibrate(module: nn.Module, inputs: Iterable[Any]) -> int:
    """Run ``module`` on every input (eval, no_grad) so its observers see them; returns the count.

    Args:
        module: a module prepared with observers.
        inputs: its inputs, one call each (anything :func:`~qlightning.core.inputs.as_inputs` takes).
    """
    n = 0
    with torch.no_grad():
        module.eval()
        for item in inputs:
            inp = as_inputs(item)
            module(*inp.args, **inp.kwargs)
            n += 1
    return n


def calibrate_and_convert(
    float_module: nn.Module,
    inputs: Sequence[Any],
    spec: QuantSpec,
    engine: Union[str, QuantEngine] = "fx",
    equalization_config: Any = None,
) -> nn.Module:
    """Static PTQ of a deep copy of ``float_module``: prepare with ``spec`` (as PTQ), calibrate on
    ``inputs`` (first one = example inputs), convert. ``float_module`` is not modified.

    Args:
        float_module: the float module (copied, never changed).
        inputs: the calibration inputs; the first is the example input of prepare.
        spec: how to quantize (taken as PTQ).
        engine: the engine's name or an instance.
        equalization_config: FX input-weight equalization, or ``None``.
    """
    engine = get_engine(engine) if isinstance(engine, str) else engine
    inputs = [as_inputs(i) for i in inputs]
    if not inputs:
        raise QLightningError("PTQ needs at least one calibration input")
    spec = spec_for_ptq(spec, None, equalization_config)
    module = copy.deepcopy(float_module).eval()
    prepared = engine.prepare(module, inputs[0], spec)
    calibrate(prepared, inputs)
    return engine.convert(prepared, spec)


def float_module_from(float_module: nn.Module, prepared: nn.Module, state: Optional[Mapping[str, torch.Tensor]] = None) -> nn.Module:
    """A CPU float copy of the module a QAT-prepared one was made from, with the prepared one's values.

    ``prepare_qat_fx`` keeps the float module's Parameter objects (and, on CPU, its BatchNorm
    buffers), so a reference to the float module kept at preparation is enough to rebuild a float
    module: each parameter is matched to the prepared module's parameter by identity, each
    BatchNorm's statistics to the prepared BatchNorm sharing its ``weight`` (a ``.to(device)``
    replaces buffers, never Parameter objects). Values come from ``prepared`` itself, or from
    ``state``, a state dict of ``prepared`` saved earlier (e.g. the QAT callback's
    ``float_snapshot[name]`` taken when fake-quant started). Anything unmatched keeps the float
    module's own value.

    Args:
        float_module: the float module kept when ``prepared`` was made from it.
        prepared: the QAT-prepared module.
        state: a state dict of ``prepared`` saved earlier, used instead of its current values.
    """
    param_names: dict[int, str] = {}
    for name, param in prepared.named_parameters(remove_duplicate=False):
        param_names.setdefault(id(param), name)
    bn_by_weight = {
        id(m.weight): (name, m) for name, m in prepared.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.weight is not None
    }

    def value(name: str, live: torch.Tensor) -> torch.Tensor:
        return (state[name] if state is not None else live).detach()

    snapshot = copy.deepcopy(float_module)
    with torch.no_grad():
        for (_, original), (_, copied) in zip(float_module.named_parameters(), snapshot.named_parameters()):
            name = param_names.get(id(original))
            if name is not None:
                copied.copy_(value(name, prepared.get_parameter(name)).to(copied.device))
        for (_, original), (_, copied) in zip(float_module.named_modules(), snapshot.named_modules()):
            if isinstance(original, nn.modules.batchnorm._BatchNorm) and original.weight is not None:
                match = bn_by_weight.get(id(original.weight))
                if match is None or not original.track_running_stats:
                    continue
                prefix, live = match
                for buf in ("running_mean", "running_var", "num_batches_tracked"):
                    getattr(copied, buf).copy_(value(f"{prefix}.{buf}", getattr(live, buf)).to(getattr(copied, buf).device))
    return snapshot.cpu().eval()
