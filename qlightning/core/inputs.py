"""Find the submodules to quantize and capture the inputs they really receive.

A submodule's example input is rarely the LightningModule's input (a backbone sees features, an
encoder block sees hidden states and masks), so we run the LightningModule once and record what
each target submodule is called with: from ``example_input_array``, else from one training
batch. Random states are restored afterwards so capturing never changes a seeded run.
"""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import inspect
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

import numpy as np
import torch
from torch import nn

from qlightning.errors import ConfigError


@dataclass
class Inputs:
    """Example positional and keyword inputs of one submodule, captured from a real forward.

    Attributes:
        args: positional inputs, in order.
        kwargs: keyword inputs by name.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


def as_inputs(value: Any) -> Inputs:
    """``Inputs`` from what a user passes: a tensor, a tuple of args, a dict of keyword inputs, or ``Inputs``.

    Args:
        value: a tensor, a tuple or list of positional inputs, a dict of keyword inputs, or ``Inputs``.
    """
    if isinstance(value, Inputs):
        return value
    if isinstance(value, torch.Tensor):
        return Inputs((value,))
    if isinstance(value, Mapping):
        return Inputs((), dict(value))
    return Inputs(tuple(value))


def source_of(module: nn.Module) -> nn.Module:
    """The engine's converted module behind a lowered runtime wrapper (the module itself otherwise).

    Args:
        module: a submodule as it runs now (a lowering wrapper or the engine's module).
    """
    return module.__dict__.get("_qlightning_source", module)


def attach_source(wrapper: nn.Module, source: nn.Module) -> nn.Module:
    """Remember ``source`` behind ``wrapper`` (not as a child: the wrapper's state_dict holds only what it runs).

    Args:
        wrapper: the lowered runtime's module.
        source: the engine's converted module it was built from.
    """
    wrapper.__dict__["_qlightning_source"] = source
    return wrapper


def positional_args(module: nn.Module, inputs: Inputs) -> tuple[Any, ...]:
    """Keyword inputs bound to their positions in ``module.forward`` (tracers and exported programs take positions).

    Bound against the engine's module behind a lowering wrapper (whose ``forward(*args, **kwargs)``
    would swallow the keywords into one dict).

    Args:
        module: the module (or lowering wrapper) the inputs are for.
        inputs: positional and keyword inputs of one call.
    """
    if not inputs.kwargs:
        return tuple(inputs.args)
    target = source_of(module)
    signature = inspect.signature(target.forward)
    bound = signature.bind_partial(*inputs.args, **inputs.kwargs)
    variadic = [p.name for p in signature.parameters.values() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if any(name in bound.arguments for name in variadic):
        raise TypeError(
            f"cannot bind keyword inputs {sorted(inputs.kwargs)} to positions: {type(target).__name__}.forward"
            f"{signature} takes them as *args/**kwargs"
        )
    return tuple(bound.arguments.values())


def tile(value: Any, batch: int) -> Any:
    """Repeat every tensor of a (nested) value along dim 0 to exactly ``batch`` rows.

    Args:
        value: a tensor or a (nested) tuple, list or dict of them.
        batch: the rows every tensor gets.
    """
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        reps = -(-batch // value.shape[0])
        return value.repeat(reps, *([1] * (value.dim() - 1)))[:batch]
    if isinstance(value, (tuple, list)):
        return type(value)(tile(v, batch) for v in value)
    if isinstance(value, dict):
        return {k: tile(v, batch) for k, v in value.items()}
    return value


def tile_inputs(inputs: Inputs, batch: int) -> Inputs:
    """``inputs`` with every tensor tiled to ``batch`` rows.

    Args:
        inputs: positional and keyword inputs of one call.
        batch: the rows every tensor gets.
    """
    return Inputs(tile(tuple(inputs.args), batch), tile(dict(inputs.kwargs), batch))


def rebatch(batches: Sequence[Inputs], rows: int, limit: Optional[int] = None) -> list[Inputs]:
    """The rows of ``batches`` regrouped into calls of exactly ``rows`` rows (a compiled runtime sees one shape).

    Rows are taken in order and the last partial group is dropped; when all of them make less than one
    group they are tiled to ``rows``. Only batches shaped like the first are used (same structure, same
    non-tensor values, same shapes past the batch dim: a padded text batch of another length is left out).

    Args:
        batches: inputs of several calls (e.g. held validation batches).
        rows: the rows of every call returned.
        limit: at most this many calls (``None``: all).
    """
    if not batches:
        return []
    flat = [torch.utils._pytree.tree_flatten((tuple(b.args), dict(b.kwargs))) for b in batches]
    leaves0, spec0 = flat[0]
    first = next((i for i, v in enumerate(leaves0) if isinstance(v, torch.Tensor) and v.dim() > 0), None)
    if first is None:
        return [Inputs(tuple(batches[0].args), dict(batches[0].kwargs))]

    def batched(v: Any) -> bool:
        return isinstance(v, torch.Tensor) and v.dim() > 0

    def like_first(leaves: list[Any], spec: Any) -> bool:
        if spec != spec0:
            return False
        rows_here = leaves[first].shape[0] if batched(leaves[first]) else None
        for a, b in zip(leaves, leaves0):
            if batched(a) != batched(b):
                return False
            if batched(a):
                if a.shape[1:] != b.shape[1:] or a.dtype != b.dtype or a.shape[0] != rows_here:
                    return False
            elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
                if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)):
                    return False
            elif a is not b and a != b:
                return False
        return True

    usable = [leaves for leaves, spec in flat if like_first(leaves, spec)]
    if not usable:  # tensors whose first dims disagree: no rows to regroup
        return [tile_inputs(batches[0], rows)]
    joined = [torch.cat([leaves[i] for leaves in usable]) if batched(v) else v for i, v in enumerate(leaves0)]
    total = joined[first].shape[0]
    if total < rows:
        joined = [tile(v, rows) for v in joined]
        total = rows
    calls = total // rows if limit is None else min(total // rows, limit)
    out = []
    for k in range(calls):
        leaves = [v[k * rows:(k + 1) * rows] if batched(v) else v for v in joined]
        args, kwargs = torch.utils._pytree.tree_unflatten(leaves, spec0)
        out.append(Inputs(tuple(args), dict(kwargs)))
    return out


def slice_rows(inputs: Inputs, rows: int) -> Inputs:
    """``inputs`` with every tensor cut to its first ``rows`` rows.

    Args:
        inputs: positional and keyword inputs of one call.
        rows: how many rows to keep.
    """

    def cut(v: Any) -> Any:
        return v[:rows] if isinstance(v, torch.Tensor) and v.dim() > 0 else v

    return Inputs(tuple(cut(a) for a in inputs.args), {k: cut(v) for k, v in inputs.kwargs.items()})


def flat_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of a (nested) output, in pytree order; quantized tensors are dequantized.

    Args:
        value: a module's output (a tensor, or a nested structure of them).
    """
    leaves = torch.utils._pytree.tree_leaves(value)
    return [t.dequantize() if t.is_quantized else t for t in leaves if isinstance(t, torch.Tensor)]


def first_tensor(value: Any) -> torch.Tensor:
    """The first tensor of a (nested) output.

    Args:
        value: a module's output (a tensor, or a nested structure of them).
    """
    tensors = flat_tensors(value)
    if not tensors:
        raise TypeError(f"the module returned no tensor ({type(value).__name__})")
    return tensors[0]


class _AllCaptured(Exception):
    """Raised from a hook to stop the forward pass once every target has been seen."""


def _is_pattern(name: str) -> bool:
    return any(ch in name for ch in "*?[")


def resolve_targets(root: nn.Module, names: Sequence[str], key: str = "modules") -> list[str]:
    """Expand names and glob patterns (``encoder.layer.*.output``) to submodule names of ``root``.

    A pattern's matches that sit inside another match are dropped (the outer one is quantized).
    Raises one :class:`ConfigError` listing every name that matched nothing, with the closest
    real names and the top-level children as choices.

    Args:
        root: the model.
        names: submodule names or glob patterns.
        key: the argument (or config key) the names came from, for messages.
    """
    available = [n for n, _ in root.named_modules() if n]
    resolved: list[str] = []
    errors: list[str] = []
    for name in names:
        if not isinstance(name, str) or not name:
            errors.append(f"{key}: {name!r} is not a submodule name")
            continue
        matches = fnmatch.filter(available, name) if _is_pattern(name) else [name] if name in available else []
        if not matches:
            close = difflib.get_close_matches(name, available, n=5, cutoff=0.5)
            top = [n for n in available if "." not in n]
            hint = f"; closest: {close}" if close else ""
            errors.append(f"{key}: no submodule {name!r} in {type(root).__name__}{hint}; top-level submodules: {top}")
            continue
        resolved.extend(m for m in matches if m not in resolved)
    outer = [n for n in resolved if not any(n.startswith(other + ".") for other in resolved if other != n)]
    if errors:
        raise ConfigError(errors)
    return outer


class RandomStates:
    """Save and restore python, numpy and torch random states around a side-trip."""

    def __enter__(self) -> "RandomStates":
        self.py, self.np, self.torch = random.getstate(), np.random.get_state(), torch.get_rng_state()
        return self

    def __exit__(self, *exc: Any) -> None:
        random.setstate(self.py)
        np.random.set_state(self.np)
        torch.set_rng_state(self.torch)


def detach(value: Any) -> Any:
    """Every tensor of a (nested) value detached and copied, so later in-place changes do not reach it.

    Args:
        value: a tensor, or a (nested) tuple, list or dict of them; other values are returned as they are.
    """
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(detach(v) for v in value)
    if isinstance(value, dict):
        return {k: detach(v) for k, v in value.items()}
    return value


def detach_shallow(value: Any) -> Any:
    """Every tensor of a (nested) value detached from autograd, not copied.

    Args:
        value: a tensor, or a (nested) tuple, list or dict of them; other values are returned as they are.
    """
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (list, tuple)):
        return type(value)(detach_shallow(v) for v in value)
    if isinstance(value, dict):
        return {k: detach_shallow(v) for k, v in value.items()}
    return value


@contextlib.contextmanager
def input_hooks(
    modules: Mapping[str, nn.Module],
    on_input: Optional[Callable[[str, Inputs], None]] = None,
    on_output: Optional[Callable[[str], None]] = None,
) -> Iterator[None]:
    """While the block runs, ``on_input(name, inputs)`` before every forward of each module and
    ``on_output(name)`` after it; the hooks are removed when the block ends (or raises).

    The one forward-hook input capturer: :func:`capture_inputs`, calibration, the report and the
    parity gate each decide what to keep (first call or every call, copied or not) and when to stop
    (an exception raised from a callback ends the forward early and leaves the block).

    Args:
        modules: ``{name: module}`` to watch.
        on_input: gets the name and the call's positional and keyword inputs as given (not copied).
        on_output: gets the name once the module's forward returned.
    """
    handles = []
    try:
        for name, module in modules.items():
            if on_input is not None:
                def pre(m: nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
                    on_input(name, Inputs(tuple(args), dict(kwargs)))  # type: ignore[misc]

                handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            if on_output is not None:
                def post(m: nn.Module, args: tuple, kwargs: dict, output: Any, name: str = name) -> None:
                    on_output(name)  # type: ignore[misc]

                handles.append(module.register_forward_hook(post, with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def capture_inputs(root: nn.Module, targets: Iterable[str], run: Callable[[], Any]) -> dict[str, Inputs]:
    """Call ``run()`` (a forward of ``root``) and record the first (args, kwargs) of each target.

    The forward is cut short as soon as all targets were seen. Modules run in eval mode under
    ``no_grad`` and the random states are restored, so nothing about the model or the run changes.

    Args:
        root: the model ``run`` calls.
        targets: names of submodules of ``root``.
        run: one forward of ``root`` (a call, a step).
    """
    targets = list(targets)
    captured: dict[str, Inputs] = {}

    def seen(name: str, inputs: Inputs) -> None:
        if name not in captured:
            captured[name] = Inputs(detach(inputs.args), detach(inputs.kwargs))
        if len(captured) == len(targets):
            raise _AllCaptured

    try:
        with input_hooks({name: root.get_submodule(name) for name in targets}, seen), RandomStates(), evaluating(root):
            run()
    except _AllCaptured:
        pass
    return captured


@contextlib.contextmanager
def evaluating(root: nn.Module) -> Iterator[None]:
    """``root`` in eval mode without autograd; every submodule's own ``training`` flag put back afterwards.

    Args:
        root: the model to run in eval mode meanwhile.
    """
    modes = {m: m.training for m in root.modules()}
    try:
        with torch.no_grad():
            root.eval()
            yield
    finally:
        for m, mode in modes.items():
            m.training = mode


def example_inputs_for(
    pl_module: Any,
    targets: Sequence[str],
    batch_source: Optional[Callable[[], Any]] = None,
    configured: Optional[dict[str, Inputs]] = None,
) -> dict[str, Inputs]:
    """Inputs for each target: configured ones first, then ``example_input_array``, then one batch.

    Raises :class:`ConfigError` naming the targets for which no route produced inputs.

    Args:
        pl_module: the LightningModule (its ``example_input_array`` and ``training_step`` are used).
        targets: the submodule names that need inputs.
        batch_source: returns one training batch (or ``None``), called only when needed.
        configured: inputs given by the user, by target.
    """
    found: dict[str, Inputs] = dict(configured or {})
    missing = [t for t in targets if t not in found]
    example = getattr(pl_module, "example_input_array", None)
    if missing and example is not None:

        def run_example() -> Any:
            if isinstance(example, dict):
                return pl_module(**example)
            if isinstance(example, (tuple, list)):
                return pl_module(*example)
            return pl_module(example)

        found.update(capture_inputs(pl_module, missing, run_example))
        missing = [t for t in targets if t not in found]
    if missing and batch_source is not None:
        with RandomStates():
            batch = batch_source()
        if batch is not None:
            found.update(capture_inputs(pl_module, missing, lambda: pl_module.training_step(batch, 0)))
            missing = [t for t in targets if t not in found]
    if missing:
        raise ConfigError(
            f"example inputs: could not find inputs for {missing}. Set `example_input_array` on the "
            "LightningModule, give the Trainer a train dataloader whose training_step calls these modules, "
            "or pass example_inputs={name: (tensor, ...)} (config: quant.example_inputs)"
        )
    return {t: found[t] for t in targets}
