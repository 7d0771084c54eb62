"""Batches for calibration from a Trainer's own loaders, and the inputs the quantized submodules see on them."""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

import lightning.pytorch as pl
from lightning.pytorch.utilities import CombinedLoader

from qlightning.callbacks import lightning_compat as compat
from qlightning.core.inputs import Inputs, RandomStates, detach_shallow
from qlightning.errors import QLightningError
from qlightning.quantize.calibration import run_to_targets

_STEP = {"train": "training_step", "val": "validation_step"}


def collect_inputs(
    pl_module: "pl.LightningModule",
    targets: Sequence[str],
    batches: Iterable[Any],
    source: str = "train",
    trainer: Optional["pl.Trainer"] = None,
) -> dict[str, list[Inputs]]:
    """Inputs each target submodule receives on ``batches``, running ``training_step`` (source
    ``"train"``) or ``validation_step`` (``"val"``) up to the targets. Kept in memory: use a few batches.

    Args:
        pl_module: the LightningModule whose step runs.
        targets: names of the submodules whose inputs to keep.
        batches: the batches, as the loader yields them.
        source: ``"train"`` (``training_step``) or ``"val"`` (``validation_step``).
        trainer: the Trainer, to move batches as Lightning does (``None``: moved to the module's device only).
    """
    collected: dict[str, list[Inputs]] = {name: [] for name in targets}
    step = getattr(pl_module, _STEP[source])

    def keep(name: str, inputs: Inputs) -> None:
        collected[name].append(Inputs(detach_shallow(inputs.args), detach_shallow(inputs.kwargs)))

    with RandomStates():
        for i, batch in enumerate(batches):
            batch = compat.to_module_device(batch, pl_module, trainer)
            run_to_targets(pl_module, targets, lambda: step(batch, i), on_input=keep, inputs_only=True)
    return collected


def calibration_batches(trainer: "pl.Trainer", source: str, num_batches: Optional[int]) -> Iterator[Any]:
    """Up to ``num_batches`` batches (all when ``None``) of a fresh train or val loader of ``trainer``.

    Args:
        trainer: the Trainer whose loaders to read.
        source: ``"train"`` or ``"val"``.
        num_batches: how many (``None``: the whole loader).
    """
    data_source = compat.loop_data_source(trainer, source)
    if not data_source.is_defined() or data_source.instance is None:
        raise QLightningError(
            f"PostTrainingQuantization: calibrate_on={source!r} but the Trainer has no "
            f"{'train' if source == 'train' else 'validation'} dataloader; pass a datamodule or "
            f"{'train_dataloaders' if source == 'train' else 'val_dataloaders'}, or choose calibrate_on="
            f"{'val' if source == 'train' else 'train'!r}"
        )
    loaders = data_source.dataloader()
    if isinstance(loaders, (list, tuple)):
        loaders = loaders[0]
    elif isinstance(loaders, Mapping):
        loaders = CombinedLoader(dict(loaders), mode="max_size_cycle")
        iter(loaders)  # a CombinedLoader needs iter() before len(); yields (batch, idx, dl_idx)
        return (b[0] for b in itertools.islice(loaders, num_batches))
    return itertools.islice(iter(loaders), num_batches)
