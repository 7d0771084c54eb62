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
import random
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np
import torch
from torch import nn

from qlightning.engines.base import Inputs
from qlightning.errors import ConfigError


class _AllCaptured(Exception):
    """Raised from a hook to stop the forward pass once every target has been seen."""


def _is_pattern(name: str) -> bool:
    return any(ch in name for ch in "*?[")


def resolve_targets(root: nn.Module, names: Sequence[str], key: str = "modules") -> list[str]:
    """Expand names and glob patterns (``encoder.layer.*.output``) to submodule names of ``root``.

    A pattern's matches that sit inside another match are dropped (the outer one is quantized).
    Raises one :class:`ConfigError` listing every name that matched nothing, with the closest
    real names and the top-level children as choices.
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


class _RandomStates:
    """Save and restore python, numpy and torch random states around a side-trip."""

    def __enter__(self) -> "_RandomStates":
        self.py, self.np, self.torch = random.getstate(), np.random.get_state(), torch.get_rng_state()
        return self

    def __exit__(self, *exc: Any) -> None:
        random.setstate(self.py)
        np.random.set_state(self.np)
        torch.set_rng_state(self.torch)


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_detach(v) for v in value)
    if isinstance(value, dict):
        return {k: _detach(v) for k, v in value.items()}
    return value


def capture_inputs(root: nn.Module, targets: Iterable[str], run: Callable[[], Any]) -> dict[str, Inputs]:
    """Call ``run()`` (a forward of ``root``) and record the first (args, kwargs) of each target.

    The forward is cut short as soon as all targets were seen. Modules run in eval mode under
    ``no_grad`` and the random states are restored, so nothing about the model or the run changes.
    """
    targets = list(targets)
    captured: dict[str, Inputs] = {}
    handles = []

    def make_hook(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if name not in captured:
                captured[name] = Inputs(_detach(tuple(args)), _detach(dict(kwargs)))
            if len(captured) == len(targets):
                raise _AllCaptured

        return hook

    for name in targets:
        handles.append(root.get_submodule(name).register_forward_pre_hook(make_hook(name), with_kwargs=True))
    try:
        with _RandomStates(), evaluating(root):
            run()
    except _AllCaptured:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return captured


@contextlib.contextmanager
def evaluating(root: nn.Module) -> Iterator[None]:
    """``root`` in eval mode without autograd; every submodule's own ``training`` flag put back afterwards."""
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
        with _RandomStates():
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
