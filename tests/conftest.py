"""Shared fixtures: small real training runs on scikit-learn's digits."""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import warnings

# Two xdist workers of two torch threads share the machine's two cores. OpenMP's threads spin while they wait
# (its default), so a worker's thread that lost its core left the other burning it: the torch 2.13 suite took
# 2073 s spinning and 619 s passive on 2 idle cores (the six resume tests: 240 s against 34 s). Passive waiting
# changes scheduling only: each test still computes on its 2 threads. It must be set before torch loads OpenMP;
# the subprocesses the tests start (the CLI, DDP ranks) inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if "torch" in sys.modules:  # a plugin loaded it first: this process spins (its subprocesses still wait passively)
    warnings.warn("torch was imported before tests/conftest.py: set OMP_WAIT_POLICY=PASSIVE in the environment")

import lightning.pytorch as pl  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from qlightning import QuantizationAwareTraining  # noqa: E402
from qlightning.examples import DigitsClassifier, DigitsDataModule  # noqa: E402

torch.set_num_threads(2)
logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
logging.getLogger("torch.__trace").propagate = False  # always DEBUG: pytest's capture would hold every dynamo trace
warnings.filterwarnings("ignore", message=".*does not have many workers.*")
warnings.filterwarnings("ignore", message=".*LeafSpec.*")

@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Each test starts on the suite's 2 torch threads: a test that sets its own (the defaults study's 1 thread) does
    not leak it into the next test of its xdist worker, whose float sums would then round differently (the default
    job's int8 accuracy is 99.63 % on 2 threads and 99.26 % on 1: one image, across a test's bound)."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


DEFAULT_SCHEDULE = dict(fake_quant_start={"epoch": 3}, observer_freeze={"epoch": 6}, bn_freeze={"epoch": 6})


def make_trainer(callbacks, max_epochs: int = 8, **kwargs) -> pl.Trainer:
    kwargs.setdefault("logger", False)
    kwargs.setdefault("enable_checkpointing", False)
    return pl.Trainer(
        max_epochs=max_epochs,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        **kwargs,
    )


def test_accuracy(module, dm: DigitsDataModule) -> float:
    """Top-1 accuracy of ``module`` (a net, not a LightningModule) on the digits test split."""
    dm.setup()
    x, y = dm.splits["test"].tensors
    with torch.no_grad():
        return (module(x).argmax(1) == y).float().mean().item()


test_accuracy.__test__ = False  # a helper, not a test


@pytest.fixture(scope="session")
def trained_qat():
    """One full default-schedule QAT run (8 epochs) shared by the tests that only read its result."""
    pl.seed_everything(0)
    dm = DigitsDataModule(seed=0)
    model = DigitsClassifier()
    qat = QuantizationAwareTraining(modules=["net"], backend="x86", **DEFAULT_SCHEDULE)
    trainer = make_trainer([qat])
    trainer.fit(model, datamodule=dm)
    return trainer, model, dm, qat


@pytest.fixture(scope="session")
def digits_fast_run(tmp_path_factory):
    """One `qlightning train recipe=digits_fast` run (default export formats, csv and tensorboard loggers):
    its folder, for the tests of test_cli.py and test_export.py that only read its files."""
    tmp = tmp_path_factory.mktemp("digits_fast")
    loggers = "loggers=[csv,tensorboard]" if importlib.util.find_spec("tensorboard") else "loggers=[csv]"
    out = subprocess.run(
        [sys.executable, "-m", "qlightning.cli", "train", "recipe=digits_fast", f"hydra.run.dir={tmp}/run",
         "trainer.enable_progress_bar=false", "report.latency_repeats=5", loggers],
        cwd=tmp, capture_output=True, text=True, timeout=600, env={**os.environ, "HYDRA_FULL_ERROR": "1"},
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return tmp / "run"
