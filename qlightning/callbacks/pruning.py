"""QAT and Lightning's ModelPruning on the same model: pruning follows the modules QAT prepares.

``ModelPruning.setup`` collects its ``(module, parameter)`` pairs from the float model, before
``configure_model``, where QAT replaces the quantized submodules by prepared ones: left alone it would
prune modules that are no longer in the model. Its private state is read and written through
:mod:`qlightning.callbacks.lightning_compat` only.
"""

from __future__ import annotations

from typing import Any, Sequence

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelPruning
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from qlightning.callbacks import lightning_compat as compat
from qlightning.core.inputs import resolve_targets
from qlightning.core.session import has_submodule
from qlightning.engines import QuantEngine
from qlightning.errors import ConfigError


def name_pruned_parameters(trainer: "pl.Trainer", pl_module: "pl.LightningModule", module_names: Sequence[str]) -> list[tuple[Any, ...]]:
    """Before prepare: the ``ModelPruning`` parameters inside the quantized modules, by name.

    ``ModelPruning.setup`` collects its ``(module, name)`` pairs before ``configure_model``, from
    the float modules that prepare then replaces: left alone it would prune modules that are no
    longer in the model (silently: the trained and converted model is not sparse).

    Args:
        trainer: the Trainer, whose ``ModelPruning`` callbacks are asked.
        pl_module: the float model, before prepare.
        module_names: the names or patterns of the submodules QAT prepares.

    Returns:
        ``(callback, [(pair index, module name, parameter)], pairs are ModelPruning's default)`` per
        ModelPruning callback that prunes inside the quantized submodules.
    """
    callbacks = [c for c in trainer.callbacks if isinstance(c, ModelPruning)]
    if not callbacks:
        return []
    targets = resolve_targets(pl_module, module_names, key="modules")
    names = {id(m): n for n, m in pl_module.named_modules()}

    def inside(name: str) -> bool:
        return any(name == t or name.startswith(t + ".") for t in targets)

    found = []
    for callback in callbacks:
        pairs = compat.pruning_pairs(callback)
        default = compat.default_pruning_pairs(callback, pl_module)
        is_default = [(id(m), p) for m, p in default] == [(id(m), p) for m, p in pairs]
        moved = [(i, names[id(m)], p) for i, (m, p) in enumerate(pairs) if id(m) in names and inside(names[id(m)])]
        if moved:
            found.append((callback, moved, is_default))
    return found


def repoint_pruning(pl_module: "pl.LightningModule", found: list[tuple[Any, ...]], engine: QuantEngine, targets: Sequence[str]) -> None:
    """After prepare: point ``ModelPruning`` at the prepared modules of the same names.

    A fused conv keeps the conv's name, so its weight is pruned (and the mask goes through
    fake-quant and into the int8 weight); a BatchNorm folded into its conv has no module of its
    own any more: dropped from ``ModelPruning``'s default selection, an error when listed explicitly.

    Args:
        pl_module: the model, after prepare.
        found: what :func:`name_pruned_parameters` returned before prepare.
        engine: the engine that prepared it (whether it keeps the float modules' names).
        targets: the quantized submodules, for messages.

    Raises:
        ConfigError: pruning inside modules the engine renames, or explicitly listed parameters that
            prepare folded away.
    """
    errors: list[str] = []
    for callback, moved, is_default in found:
        if not engine.keeps_module_names:
            errors.append(
                f"ModelPruning: prunes {[f'{n}.{p}' for _, n, p in moved][:4]}... inside the quantized modules "
                f"{list(targets)}; only the fx engine keeps their names when preparing (this run: {engine.name!r})"
            )
            continue
        pairs = compat.pruning_pairs(callback)
        dropped: dict[int, str] = {}
        for i, name, param in moved:
            module = pl_module.get_submodule(name) if has_submodule(pl_module, name) else None
            if module is not None and isinstance(module._parameters.get(param), nn.Parameter):
                pairs[i] = (module, param)
            else:
                dropped[i] = f"{name}.{param}"
        if dropped and not is_default:
            errors.append(
                f"ModelPruning(parameters_to_prune=...): {sorted(dropped.values())} are not parameters of the "
                f"model QAT prepares (a BatchNorm folded into its conv, or a module fused away); prune the "
                f"conv/linear weights only"
            )
            continue
        if dropped:
            rank_zero_info(f"[qlightning] ModelPruning: not pruning {sorted(dropped.values())} (folded by QAT fusion)")
        compat.set_pruning_pairs(callback, [pair for i, pair in enumerate(pairs) if i not in dropped])
    if errors:
        raise ConfigError(errors)
