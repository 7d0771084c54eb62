"""The only place that touches Lightning's private state, each use with its reason and version range.

Lightning's public API has no hook for these; each function names the Lightning issue or pull request
(or the missing hook) and the versions it was checked on (:data:`CHECKED_ON`: lightning 2.4 - 2.6.6).
``tests/test_lightning_compat.py`` fails loudly when an upgrade removes or reshapes one of them, instead
of a user's run going wrong; ``tests/test_layering.py`` keeps every other module off Lightning's privates.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch.callbacks import ModelCheckpoint, ModelPruning
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from torch import nn

#: the oldest and newest Lightning every function here was checked on
CHECKED_ON = ("2.4", "2.6.6")


# ---------------------------------------------------------------------- the fit's own data


def loop_data_source(trainer: Any, stage: str) -> Any:
    """The ``_DataConnector`` source of the fit (``"train"``) or validate (``"val"``) loop.

    No public accessor returns the loader a fit *will* use before the loop starts
    (``trainer.train_dataloader`` is ``None`` until then), and QAT needs one batch of it in
    ``configure_model`` to capture example inputs (Lightning issue #10430 asks for such an accessor).
    ``fit_loop._data_source``, a ``_DataConnectorSource``; checked on lightning 2.4 - 2.6.6.

    Args:
        trainer: the Trainer whose loop to read.
        stage: ``"train"`` (the fit loop) or ``"val"`` (the validate loop).
    """
    loop = trainer.fit_loop if stage == "train" else trainer.validate_loop
    return loop._data_source


def first_training_batch(trainer: Any) -> Callable[[], Any]:
    """A function returning one batch of the fit's training loader (``None`` when it has none).

    Args:
        trainer: the Trainer of the fit (see :func:`loop_data_source`).
    """

    def first() -> Any:
        source = loop_data_source(trainer, "train")
        if not source.is_defined():
            return None
        return next(iter(source.dataloader()))

    return first


def to_module_device(batch: Any, pl_module: nn.Module, trainer: Optional[Any]) -> Any:
    """A batch moved the way Lightning moves it, the user's ``transfer_batch_to_device`` hooks included.

    ``LightningModule._apply_batch_transfer_handler`` is the one function that runs the three
    public transfer hooks (``on_before_batch_transfer``, ``transfer_batch_to_device``,
    ``on_after_batch_transfer``) in Lightning's order; calibration outside a loop needs the same and
    Lightning has no public entry point for it. Checked on lightning 2.4 - 2.6.6.

    Args:
        batch: a batch of the user's loader.
        pl_module: the LightningModule whose device (and transfer hooks) to use.
        trainer: its Trainer, or ``None`` outside one (then the batch is only moved).
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
    ``lightning.fabric.utilities.data._set_sampler_epoch``, checked on lightning 2.4 - 2.6.6.

    Args:
        loader: the DataLoader whose samplers to set.
        epoch: the epoch to set.
    """
    _set_sampler_epoch(loader, epoch)


def attached_trainer(pl_module: Any) -> Optional[Any]:
    """The Trainer ``pl_module`` is attached to, or ``None``.

    ``LightningModule.trainer`` raises when no Trainer is attached (and a checkpoint can be loaded
    into a module outside any fit); ``_trainer`` is the attribute behind it. Checked on lightning
    2.4 - 2.6.6.

    Args:
        pl_module: the LightningModule.
    """
    return getattr(pl_module, "_trainer", None)


# ---------------------------------------------------------------------- ModelCheckpoint


def save_last_now(callback: ModelCheckpoint, trainer: Any) -> None:
    """Write ``callback``'s ``last.ckpt`` now, as its own periodic save would (with ``save_last="link"``,
    a top-k checkpoint first, which ``last.ckpt`` links to).

    ``ModelCheckpoint`` has no public entry point to save outside its own schedule (no Lightning issue
    found for one); its ``_should_skip_saving_checkpoint``, ``_monitor_candidates``,
    ``_save_topk_checkpoint`` and ``_save_last_checkpoint`` are what its hooks call. Checked on
    lightning 2.4 - 2.6.6.

    Args:
        callback: the ModelCheckpoint.
        trainer: its Trainer.
    """
    if callback.save_last and not callback._should_skip_saving_checkpoint(trainer):
        candidates = callback._monitor_candidates(trainer)
        if callback.save_last == "link":
            callback._save_topk_checkpoint(trainer, candidates)
        callback._save_last_checkpoint(trainer, candidates)


# ---------------------------------------------------------------------- ModelPruning


def pruning_pairs(callback: ModelPruning) -> list[tuple[nn.Module, str]]:
    """The ``(module, parameter name)`` pairs ``ModelPruning`` collected in its ``setup``.

    ModelPruning collects them from the float modules before ``configure_model``, where QAT then
    replaces those modules; there is no public getter or setter. ``_parameters_to_prune`` (and
    ``_parameter_names``, ``_original_layers`` below) since Lightning PR #5825 (1.2); checked on
    lightning 2.4 - 2.6.6.

    Args:
        callback: the ModelPruning callback, after its ``setup``.
    """
    return list(callback._parameters_to_prune)


def default_pruning_pairs(callback: ModelPruning, pl_module: nn.Module) -> list[tuple[nn.Module, str]]:
    """The pairs ModelPruning would select by default (its ``parameter_names`` over the whole model).

    Args:
        callback: the ModelPruning callback.
        pl_module: the model it prunes.
    """
    return callback.filter_parameters_to_prune(
        ModelPruning.sanitize_parameters_to_prune(pl_module, (), parameter_names=callback._parameter_names)
    )


def set_pruning_pairs(callback: ModelPruning, pairs: list[tuple[nn.Module, str]]) -> None:
    """Point ModelPruning at new pairs; for the lottery-ticket mode also at their initial weights.

    Args:
        callback: the ModelPruning callback.
        pairs: the ``(module, parameter name)`` pairs it is to prune from now on.
    """
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
    them in a main process (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``), else ``None``.

    The launcher class and its ``_start_method`` are private (``_MultiProcessingLauncher``; Lightning
    PR #13405 added the fork start methods, 1.7); checked on lightning 2.4 - 2.6.6.

    Args:
        trainer: the Trainer whose strategy to ask.
    """
    launcher = getattr(trainer.strategy, "launcher", None)
    return launcher._start_method if isinstance(launcher, _MultiProcessingLauncher) else None


def add_extra_result(trainer: Any, key: str, sub_key: str, value: Any) -> None:
    """Rank 0 of a spawn strategy: add ``value`` to what the launcher returns to the main process.

    ``get_extra_results`` is the launcher's documented extension point (Lightning PR #7916 gave spawn
    strategies their extra results), but on a private class; this process's launcher (and only it) gets
    a wrapper that adds ours. Checked on lightning 2.4 - 2.6.6.

    Args:
        trainer: rank 0's Trainer.
        key: the top-level key of the extra results.
        sub_key: the entry under it (one per callback).
        value: what to send (picklable).
    """
    launcher = trainer.strategy.launcher
    original = launcher.get_extra_results

    def get_extra_results(trainer: Any) -> dict[str, Any]:
        extra = original(trainer)
        extra.setdefault(key, {})[sub_key] = value
        return extra

    launcher.get_extra_results = get_extra_results  # type: ignore[method-assign]


def install_main_process_recovery(
    before: Callable[[Any, dict[str, Any], bool], dict[str, list[str]]], after: Callable[[Any, dict], None]
) -> None:
    """Run ``before(trainer, extra, fitted)`` / ``after(trainer, expected)`` around Lightning's recovery
    of rank 0's results in the main process of ``ddp_spawn``/``ddp_fork``/``ddp_notebook``.

    After the processes join, ``_MultiProcessingLauncher._recover_results_in_main_process`` loads rank
    0's final ``state_dict`` into the main process's model with ``strict=False`` (Lightning PR #16365,
    for issue #14534), a model that was never prepared nor converted (that ran in the workers).

    Why this is the one process-wide patch, made when a ``QuantizationAwareTraining`` is constructed
    rather than in a hook: no callback hook ever runs in the main process of a spawn strategy
    (``setup`` and every later hook run in the workers; the main process only launches, joins and
    recovers), and the launcher instance is made with the Trainer, before any hook. So the method is
    wrapped on the class, once per process, and the wrapper calls the original unchanged for trainers
    that ``before`` finds nothing to do for (no QAT callback). :func:`uninstall_main_process_recovery`
    undoes it. ``before`` gets plain data (``extra``: the launcher's extra results; ``fitted``: rank 0's
    weights came back, i.e. a fit) rather than Lightning's private ``_WorkerOutput``. Checked on lightning
    2.4 - 2.6.6.

    Args:
        before: called before Lightning loads rank 0's weights; returns what ``after`` checks.
        after: called after Lightning's recovery with ``before``'s result.
    """
    original = _MultiProcessingLauncher._recover_results_in_main_process
    if getattr(original, "_qlightning", False):
        return

    def _recover_results_in_main_process(self: Any, worker_output: Any, trainer: Any) -> None:
        expected = before(trainer, dict(worker_output.extra or {}), worker_output.weights_path is not None)
        _recover_results_in_main_process._original(self, worker_output, trainer)  # type: ignore[attr-defined]
        after(trainer, expected)

    _recover_results_in_main_process._qlightning = True  # type: ignore[attr-defined]
    _recover_results_in_main_process._original = original  # type: ignore[attr-defined]
    _MultiProcessingLauncher._recover_results_in_main_process = _recover_results_in_main_process  # type: ignore[method-assign]


def uninstall_main_process_recovery() -> bool:
    """Undo :func:`install_main_process_recovery` (Lightning's own method again); False if it was not installed."""
    current = _MultiProcessingLauncher._recover_results_in_main_process
    if not getattr(current, "_qlightning", False):
        return False
    _MultiProcessingLauncher._recover_results_in_main_process = current._original  # type: ignore[attr-defined,method-assign]
    return True
