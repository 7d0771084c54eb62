"""The only place that touches Lightning's private state, each use with its reason and version range.

Lightning's public API has no hook for these; each function names the Lightning issue (or the
missing hook) and the versions it was checked on (lightning 2.4 - 2.6.6). ``tests/test_lightning_compat.py``
fails loudly when an upgrade removes or reshapes one of them, instead of a user's run going wrong.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch.callbacks import ModelPruning
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from torch import nn

CHECKED_ON = ("2.4", "2.6.6")


# ---------------------------------------------------------------------- the fit's own data


def loop_data_source(trainer: Any, stage: str) -> Any:
    """The ``_DataConnector`` source of the fit (``"train"``) or validate (``"val"``) loop.

    No public accessor returns the loader a fit *will* use before the loop starts
    (``trainer.train_dataloader`` is ``None`` until then), and QAT needs one batch of it in
    ``configure_model`` to capture example inputs (lightning 2.x ``fit_loop._data_source``).
    """
    loop = trainer.fit_loop if stage == "train" else trainer.validate_loop
    return loop._data_source


def first_training_batch(trainer: Any) -> Callable[[], Any]:
    """A function returning one batch of the fit's training loader (``None`` when it has none)."""

    def first() -> Any:
        source = loop_data_source(trainer, "train")
        if not source.is_defined():
            return None
        return next(iter(source.dataloader()))

    return first


def to_module_device(batch: Any, pl_module: nn.Module, trainer: Optional[Any]) -> Any:
    """A batch moved the way Lightning moves it, the user's ``transfer_batch_to_device`` hooks included.

    ``LightningModule._apply_batch_transfer_handler`` is the one function that runs the three
    public transfer hooks in Lightning's order; calibration outside a loop needs the same.
    """
    device = getattr(pl_module, "device", None)
    if trainer is not None and hasattr(pl_module, "_apply_batch_transfer_handler"):
        return pl_module._apply_batch_transfer_handler(batch, device=device)
    if device is None:
        return batch
    return move_data_to_device(batch, device)


def set_sampler_epoch(loader: Any, epoch: int) -> None:
    """``set_epoch`` on a loader's samplers, as Lightning's loops do (``lightning.fabric`` private helper).

    A resumed loader's worker processes draw indices as soon as its iterator exists, before
    Lightning's own ``set_epoch`` (Lightning issue #20550 keeps loader state from being restored).
    """
    _set_sampler_epoch(loader, epoch)


# ---------------------------------------------------------------------- ModelPruning


def pruning_pairs(callback: ModelPruning) -> list[tuple[nn.Module, str]]:
    """The ``(module, parameter name)`` pairs ``ModelPruning`` collected in its ``setup``.

    ModelPruning collects them from the float modules before ``configure_model``, where QAT then
    replaces those modules; there is no public setter (lightning 2.x ``_parameters_to_prune``).
    """
    return list(callback._parameters_to_prune)


def default_pruning_pairs(callback: ModelPruning, pl_module: nn.Module) -> list[tuple[nn.Module, str]]:
    """The pairs ModelPruning would select by default (its ``parameter_names`` over the whole model)."""
    return callback.filter_parameters_to_prune(
        ModelPruning.sanitize_parameters_to_prune(pl_module, (), parameter_names=callback._parameter_names)
    )


def set_pruning_pairs(callback: ModelPruning, pairs: list[tuple[nn.Module, str]]) -> None:
    """Point ModelPruning at new pairs; for the lottery-ticket mode also at their initial weights."""
    import copy

    callback._parameters_to_prune = pairs
    if getattr(callback, "_original_layers", None) is not None:
        callback._original_layers = {}
        for i, (module, param) in enumerate(pairs):
            entry = callback._original_layers.setdefault(id(module), {"data": copy.deepcopy(module), "names": []})
            entry["names"].append((i, param))


# ---------------------------------------------------------------------- spawn / fork hand-over


def spawn_start_method(trainer: Any) -> Optional[str]:
    """``"spawn"``/``"fork"``/``"forkserver"`` when Lightning started the processes itself and joins
    them in a main process (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``), else ``None``."""
    launcher = getattr(trainer.strategy, "launcher", None)
    return launcher._start_method if isinstance(launcher, _MultiProcessingLauncher) else None


def add_extra_result(trainer: Any, key: str, sub_key: str, value: Any) -> None:
    """Rank 0 of a spawn strategy: add ``value`` to what the launcher returns to the main process.

    ``get_extra_results`` is the launcher's documented extension point, but on a private class; this
    process's launcher (and only it) gets a wrapper that adds ours.
    """
    launcher = trainer.strategy.launcher
    original = launcher.get_extra_results

    def get_extra_results(trainer: Any) -> dict[str, Any]:
        extra = original(trainer)
        extra.setdefault(key, {})[sub_key] = value
        return extra

    launcher.get_extra_results = get_extra_results  # type: ignore[method-assign]


def install_main_process_recovery(before: Callable[[Any, Any], dict[str, list[str]]], after: Callable[[Any, dict], None]) -> None:
    """Run ``before(worker_output, trainer)`` / ``after(trainer, expected)`` around Lightning's recovery
    of rank 0's results in the main process of ``ddp_spawn``/``ddp_fork``/``ddp_notebook``.

    After the processes join, ``_MultiProcessingLauncher._recover_results_in_main_process`` loads rank
    0's final ``state_dict`` into the main process's model, which was never prepared nor converted
    (that ran in the workers). No callback hook runs in the main process then, and the launcher
    instance exists before any hook, so the method is wrapped on the class: the wrapper calls the
    original unchanged for trainers that ``before`` finds nothing to do for. Idempotent.
    """
    original = _MultiProcessingLauncher._recover_results_in_main_process
    if getattr(original, "_qlightning", False):
        return

    def _recover_results_in_main_process(self: Any, worker_output: Any, trainer: Any) -> None:
        expected = before(worker_output, trainer)
        original(self, worker_output, trainer)
        after(trainer, expected)

    _recover_results_in_main_process._qlightning = True  # type: ignore[attr-defined]
    _MultiProcessingLauncher._recover_results_in_main_process = _recover_results_in_main_process  # type: ignore[method-assign]
