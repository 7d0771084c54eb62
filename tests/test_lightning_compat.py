"""Guards for qlightning/callbacks/lightning_compat.py, the one module that reads Lightning's private state.

Each test checks that a private name the module relies on is still there, with the shape it is used with,
so that a Lightning upgrade that moves one fails here, by name, rather than in a user's run.
"""

from __future__ import annotations

import inspect

import lightning
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelPruning
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from packaging.version import Version

from qlightning.callbacks import lightning_compat as compat


def test_the_checked_range_covers_the_installed_lightning_or_says_so():
    low, high = (Version(v) for v in compat.CHECKED_ON)
    installed = Version(lightning.__version__)
    assert installed >= low, f"lightning {installed} is older than the oldest checked ({low})"
    # a newer Lightning may still work: the tests below say what moved, if anything did
    assert installed <= high or all(hasattr(_MultiProcessingLauncher, n) for n in ("_recover_results_in_main_process", "get_extra_results"))


def test_the_fit_loops_data_source_is_where_the_module_reads_it():
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu", devices=1)
    for stage in ("train", "val"):
        source = compat.loop_data_source(trainer, stage)
        assert callable(source.is_defined) and callable(source.dataloader)
    # what first_training_batch reads: the loader of the data attached by fit (here, by hand as fit does)
    from qlightning.examples import DigitsClassifier, DigitsDataModule

    dm = DigitsDataModule(seed=0)
    trainer._data_connector.attach_data(DigitsClassifier(), datamodule=dm)
    dm.setup("fit")
    x, y = compat.first_training_batch(trainer)()
    assert x.shape[1:] == (1, 8, 8) and len(x) == len(y)


def test_batch_transfer_handler_and_sampler_epoch():
    assert "device" in inspect.signature(pl.LightningModule._apply_batch_transfer_handler).parameters
    from lightning.fabric.utilities.data import _set_sampler_epoch

    assert list(inspect.signature(_set_sampler_epoch).parameters)[:2] == ["dataloader", "epoch"]


def test_model_pruning_keeps_its_pairs_where_the_module_repoints_them():
    pruning = ModelPruning("l1_unstructured", parameter_names=["weight"])
    assert pruning._parameter_names == ["weight"]
    assert hasattr(pruning, "_parameters_to_prune") and callable(ModelPruning.sanitize_parameters_to_prune)
    compat.set_pruning_pairs(pruning, [])
    assert compat.pruning_pairs(pruning) == []


def test_the_multiprocessing_launcher_hooks_the_module_wraps():
    assert callable(_MultiProcessingLauncher._recover_results_in_main_process)
    assert callable(_MultiProcessingLauncher.get_extra_results)
    assert "start_method" in inspect.signature(_MultiProcessingLauncher.__init__).parameters
    launcher = _MultiProcessingLauncher(strategy=None, start_method="spawn")  # type: ignore[arg-type]
    assert launcher._start_method == "spawn"


def test_the_main_process_recovery_wraps_the_method_lightning_calls_with_the_fields_it_reads():
    """``install_main_process_recovery`` reads ``worker_output.extra`` / ``.weights_path`` and calls the original
    as ``(self, worker_output, trainer)``; a Lightning that renames any of them fails here."""
    from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput

    assert list(inspect.signature(_MultiProcessingLauncher._recover_results_in_main_process).parameters) == [
        "self", "worker_output", "trainer"]
    assert list(inspect.signature(_MultiProcessingLauncher.get_extra_results).parameters) == ["self", "trainer"]
    assert {"extra", "weights_path"} <= set(_WorkerOutput._fields)
    # and Lightning still calls it where it loads rank 0's weights into the main process's model
    assert "_recover_results_in_main_process" in inspect.getsource(_MultiProcessingLauncher.launch)


def test_the_main_process_recovery_is_one_wrapper_that_passes_through_and_can_be_undone():
    import qlightning  # noqa: F401  (constructing a QAT callback installs it; here by hand)

    was_installed = compat.uninstall_main_process_recovery()
    original = _MultiProcessingLauncher._recover_results_in_main_process
    seen = []
    try:
        compat.install_main_process_recovery(lambda trainer, extra, fitted: seen.append((trainer, extra, fitted)) or {"k": []},
                                             lambda trainer, expected: seen.append(expected))
        compat.install_main_process_recovery(lambda *a: {}, lambda *a: None)  # idempotent: the first stays
        wrapped = _MultiProcessingLauncher._recover_results_in_main_process
        assert wrapped is not original and getattr(wrapped, "_qlightning", False)
        calls = []
        wrapped._original = lambda self, output, trainer: calls.append((output, trainer))  # Lightning's, stubbed
        from collections import namedtuple

        output = namedtuple("Output", "extra weights_path")({"a": 1}, None)
        wrapped(object(), output, "trainer")
        assert seen == [("trainer", {"a": 1}, False), {"k": []}] and calls == [(output, "trainer")]
        wrapped._original = original
    finally:
        assert compat.uninstall_main_process_recovery()
        assert _MultiProcessingLauncher._recover_results_in_main_process is original
        assert not compat.uninstall_main_process_recovery()
        if was_installed:
            from qlightning.callbacks.distributed import install_main_process_recovery

            install_main_process_recovery()


def test_model_checkpoint_saves_last_through_the_methods_the_module_calls():
    from lightning.pytorch.callbacks import ModelCheckpoint

    for name, params in (("_should_skip_saving_checkpoint", ["self", "trainer"]), ("_monitor_candidates", ["self", "trainer"]),
                         ("_save_topk_checkpoint", ["self", "trainer", "monitor_candidates"]),
                         ("_save_last_checkpoint", ["self", "trainer", "monitor_candidates"])):
        assert list(inspect.signature(getattr(ModelCheckpoint, name)).parameters) == params, name


def test_a_module_without_a_trainer_has_none_attached():
    from qlightning.examples import DigitsClassifier

    module = DigitsClassifier()
    assert compat.attached_trainer(module) is None
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu", devices=1)
    module.trainer = trainer
    assert compat.attached_trainer(module) is trainer
