"""Nothing lost: QAT checkpoints rebuilt without a Trainer, loaded by ``load_from_checkpoint``, and
training resumed mid-epoch exactly.

* :func:`restore` rebuilds the fake-quant or int8 model from a QAT checkpoint;
* :class:`QATCheckpointMixin` makes ``LightningModule.load_from_checkpoint(path)`` accept one;
* :class:`ResumableDataLoader` resumes a training epoch at the batch a checkpoint stopped before;
* :class:`ModelCheckpointWithFinalLast` also writes ``last.ckpt`` when training ends, so with
  ``every_n_train_steps`` it holds the final weights, not those of the last multiple of N;
* :class:`AtomicCheckpointIO` renames every checkpoint into place, so a killed run never leaves
  half a file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch.utils.data import DataLoader, IterableDataset

from qlightning.callbacks import lightning_compat as compat
from qlightning.callbacks.qat import QuantizationAwareTraining
from qlightning.errors import QLightningError


def qat_state(checkpoint: dict) -> dict:
    """The QuantizationAwareTraining state saved in a Lightning checkpoint.

    Args:
        checkpoint: a loaded Lightning checkpoint.
    """
    for key, value in checkpoint.get("callbacks", {}).items():
        if key.startswith("QuantizationAwareTraining"):
            return value
    raise QLightningError("this checkpoint holds no QuantizationAwareTraining state (was it saved by a QAT run?)")


def _prepare_from_state(
    model: pl.LightningModule, state: dict, callback: Optional[QuantizationAwareTraining]
) -> QuantizationAwareTraining:
    """Prepare ``model`` like the run that saved ``state`` did (observers off), ready for a strict load."""
    if callback is None:
        callback = QuantizationAwareTraining(modules=state["modules"], backend=state["backend"], engine=state["engine"])
    callback.prepare(model)
    callback.load_state_dict(state)
    for name in callback.targets:
        callback.engine.set_observers(model.get_submodule(name), False)
    return callback


def restore(
    model: pl.LightningModule,
    checkpoint_path: Union[str, Path],
    convert: bool = True,
    callback: Optional[QuantizationAwareTraining] = None,
) -> pl.LightningModule:
    """Load a QAT checkpoint into a freshly built ``model`` (strict keys) and return it.

    The checkpoint is read with ``weights_only=True``. The quantized submodules, backend and engine
    come from the checkpoint; pass the ``callback`` you trained with when it had a custom qconfig
    mapping or custom configs (those are code, not data, and are not stored). ``convert=False``
    returns the fake-quant model (observers off), ready to fine-tune or inspect.

    Args:
        model: a freshly built float LightningModule of the class that was trained.
        checkpoint_path: the ``.ckpt`` file.
        convert: convert to int8 (else the fake-quant model).
        callback: the QuantizationAwareTraining the run trained with (``None``: built from the checkpoint).

    Example::

        model = restore(DigitsClassifier(), "outputs/.../checkpoints/last.ckpt")
        model.net  # int8, lowered for the backend the run trained for
    """
    checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
    callback = _prepare_from_state(model, qat_state(checkpoint), callback)
    model.load_state_dict(checkpoint["state_dict"], strict=True)
    model.eval()
    if convert:
        callback.convert(model)
    return model


class QATCheckpointMixin:
    """Lets ``YourModule.load_from_checkpoint(path)`` load a QAT checkpoint (fake-quant model).

    A QAT checkpoint holds the *prepared* submodules' keys (fused conv-bn weights, observer and
    fake-quant buffers), so the strict ``load_state_dict`` of a freshly built float module fails.
    Lightning calls ``LightningModule.on_load_checkpoint`` just before that load; this mixin prepares
    the quantized submodules there, from the checkpoint's callback state (names, backend, engine),
    so the load is strict and exact. Put it first among the bases::

        class Classifier(QATCheckpointMixin, DigitsClassifier):
            pass

        model = Classifier.load_from_checkpoint("outputs/.../checkpoints/last.ckpt").eval()
        model.net                             # fake-quant GraphModule, observers off
        model.qat_callback.convert(model)     # int8, lowered for the checkpoint's backend

    It does nothing for a checkpoint without QAT state, for a model that already has the
    checkpoint's keys, and when a ``QuantizationAwareTraining`` callback attached to the trainer
    prepares the model itself (``fit``/``test(..., ckpt_path=...)``). Override
    :meth:`configure_qat_callback` when the run used a custom qconfig mapping or custom configs
    (code, not data, so not in the checkpoint).
    """

    qat_callback: Optional[QuantizationAwareTraining] = None

    def configure_qat_callback(self, state: dict) -> Optional[QuantizationAwareTraining]:
        """The callback that prepares this model for ``state``; ``None``: built from ``state``.

        Args:
            state: the checkpoint's QAT state.
        """
        return None

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Prepare this model for a QAT checkpoint before Lightning loads its weights (unless a QAT callback will).

        Args:
            checkpoint: the checkpoint being loaded.
        """
        super().on_load_checkpoint(checkpoint)  # type: ignore[misc]
        try:
            state = qat_state(checkpoint)
        except QLightningError:
            return
        trainer = compat.attached_trainer(self)
        if trainer is not None and any(isinstance(c, QuantizationAwareTraining) for c in trainer.callbacks):
            return  # that callback prepares the model (fit: before the restore; test/validate: right after this)
        if set(checkpoint.get("state_dict", {})) <= set(self.state_dict()):  # type: ignore[attr-defined]
            return  # already prepared (or nothing to prepare)
        callback = self.configure_qat_callback(state)
        self.qat_callback = _prepare_from_state(self, state, callback)  # type: ignore[arg-type]


class ModelCheckpointWithFinalLast(ModelCheckpoint):
    """``ModelCheckpoint`` that also writes ``last.ckpt`` when training ends.

    Lightning (2.6) writes ``last.ckpt`` only together with a periodic checkpoint, plus once at the
    end of training when none was written at all. With ``every_n_train_steps=N`` and a run whose
    step count is not a multiple of N, ``last.ckpt`` therefore holds step ``N * floor(steps / N)``:
    the final steps are lost for resuming, ``restore`` and ``qlightning export``. This writes it
    again in ``on_train_end`` (before ``QuantizationAwareTraining`` converts in ``on_fit_end``, so
    it holds the prepared model, as every QAT checkpoint does) whenever the global step has moved
    since the last save (with ``save_last="link"``, a periodic checkpoint is saved first and linked).
    """

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Lightning's ``on_train_end``, then ``last.ckpt`` at the final step.

        Args:
            trainer: the Trainer.
            pl_module: the model.
        """
        super().on_train_end(trainer, pl_module)
        compat.save_last_now(self, trainer)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each local checkpoint to a temporary file beside it, then ``os.replace``s it into place.

    A process killed while saving leaves the previous file (or none), never a truncated one.
    Lightning's own save is atomic only when the system temp directory is on the checkpoints'
    filesystem: it writes through an fsspec transaction whose temporary file is made by
    ``tempfile.mkstemp()`` and moved with ``shutil.move``, which copies across filesystems. Remote
    paths (``s3://``...) keep Lightning's behaviour. Use with ``Trainer(plugins=[AtomicCheckpointIO()])``.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        """Write ``checkpoint`` to ``path`` atomically (remote paths and storage options: Lightning's own save).

        Args:
            checkpoint: what Lightning saves.
            path: the file.
            storage_options: passed to Lightning's save; a local save takes none.
        """
        if "://" in str(path) or storage_options is not None:
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.partial")  # one name: a kill leaves at most one stale file
        try:
            with open(partial, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------- data


def _sampler_epoch(loader: DataLoader) -> Optional[int]:
    """The epoch Lightning last gave the loader's sampler through ``set_epoch`` (``None``: not epoch-aware)."""
    for sampler in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        epoch = getattr(sampler, "epoch", None)
        if isinstance(epoch, int):
            return epoch
    return None


class _SkipFirst:
    """The loader's index sampler, minus the batches a resumed checkpoint had already consumed.

    Lazy: the decision is taken when the first index is drawn, after Lightning's ``set_epoch``.
    """

    def __init__(self, loader: "ResumableDataLoader", index_sampler: Any) -> None:
        self.loader, self.index_sampler = loader, index_sampler

    def __len__(self) -> int:
        return len(self.index_sampler)

    def __iter__(self) -> Iterator[Any]:
        indices = iter(self.index_sampler)
        skip = self.loader._start_pass(len(self.index_sampler))
        for _ in range(skip):
            next(indices, None)  # index lists only: skipped samples are never loaded
        yield from indices


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` that resumes in the middle of an epoch, exactly.

    Lightning saves ``state_dict()`` of every training loader that has one in each checkpoint
    (``loops.fit_loop.state_dict.combined_loader``) and, when ``fit(ckpt_path=...)`` restarts
    inside an epoch, calls ``load_state_dict`` before it iterates again. A plain ``DataLoader``
    would start its epoch over (Lightning only shortens it to the batches that are left), so the
    resumed run would see the first batches of the epoch again and miss the last ones; this one
    skips the batches the checkpoint had consumed (as index lists: nothing is loaded for them) and
    yields the rest of the epoch in order, so a deterministic run resumed mid-epoch ends with the
    same weights as one that never stopped.

    The order within an epoch must be reproducible for this to be exact: use a sampler whose
    order depends only on (seed, epoch) and that has ``set_epoch``/``epoch`` (like
    :class:`~qlightning.examples.digits.EpochShuffleSampler` or ``DistributedSampler``). The
    state is plain data, ``{"epoch": int | None, "batches": int}``: the sampler's epoch of the
    interrupted pass and how many batches of it were handed to the trainer; a checkpoint taken
    after the last batch of an epoch resumes at the start of the next one.

    Lightning 2.6 never calls ``load_state_dict`` when ``configure_optimizers`` reads
    ``trainer.estimated_stepping_batches`` (the loader is built before the loops are restored,
    Lightning issue #20550): pass the state through your data module's ``state_dict`` /
    ``load_state_dict`` and ``resume_state=`` instead, as
    :class:`~qlightning.examples.digits.DigitsDataModule` does. With worker processes, the sampler
    is given the saved epoch on load (workers draw indices before Lightning's ``set_epoch``).

    Takes ``DataLoader``'s arguments plus ``resume_state`` (a saved state), so Lightning can
    re-create it (with a ``DistributedSampler`` under DDP; every rank then skips its own consumed
    batches) and keep the pending state.
    """

    def __init__(self, *args: Any, resume_state: Optional[dict[str, Any]] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if isinstance(self.dataset, IterableDataset):
            raise TypeError(
                "ResumableDataLoader: an IterableDataset has no index order to skip in; make the dataset "
                "itself resumable (state_dict/load_state_dict) or use a map-style dataset"
            )
        # an __init__ argument (not only load_state_dict) so that a loader Lightning re-creates
        # (DDP sampler injection) keeps it, and a data module can hand it over (see DigitsDataModule)
        self.resume_state: Optional[dict[str, Any]] = None  # loaded state, waiting for the next pass
        self._epoch: Optional[int] = None  # sampler epoch of the current pass
        self._position = 0  # batches of the current pass handed out (skipped ones included)
        if resume_state:
            self.load_state_dict(resume_state)

    @property
    def _index_sampler(self) -> Any:  # type: ignore[override]
        return _SkipFirst(self, super()._index_sampler)

    def _start_pass(self, length: int) -> int:
        resume, self.resume_state = self.resume_state, None
        self._epoch = _sampler_epoch(self)
        skip = 0
        if resume is not None:
            saved_epoch, batches = resume.get("epoch"), int(resume.get("batches", 0))
            same_epoch = saved_epoch is None or self._epoch is None or saved_epoch == self._epoch
            if same_epoch and 0 < batches < length:
                skip = batches
        self._position = skip
        return skip

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        iterator = super().__iter__()

        def counted() -> Iterator[Any]:
            for batch in iterator:
                self._position += 1
                yield batch

        return counted()

    def state_dict(self) -> dict[str, Any]:
        """``{epoch, batches}``: where in which epoch the loader is (what a mid-epoch resume skips)."""
        if self.resume_state is not None:  # loaded but not iterated yet: keep what was loaded
            return dict(self.resume_state)
        return {"epoch": self._epoch, "batches": self._position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Skip the batches already seen in the next pass of the same epoch.

        Args:
            state_dict: what :meth:`state_dict` returned.
        """
        self.resume_state = dict(state_dict)
        epoch = state_dict.get("epoch")
        if epoch is not None:
            # worker processes draw indices as soon as the iterator exists, before Lightning's
            # set_epoch: give the sampler its epoch now
            compat.set_sampler_epoch(self, int(epoch))
