"""Nothing lost: mid-epoch resume, a killed `qlightning train` resumed, load_from_checkpoint, ModelPruning.

Every run trains the digits CNN for real on CPU; "equal" means tensor by tensor (int8 values and
scales of quantized tensors included), not "close".

Mid-epoch resume needs the training loader to continue where the checkpoint stopped: Lightning
2.6 keeps the loop counters but a plain ``DataLoader`` starts its epoch again (Lightning only stops
it early), so the resumed run sees the epoch's first batches twice and its last ones never.
``DigitsDataModule`` returns a ``ResumableDataLoader`` (state: sampler epoch and batches handed out)
and carries its state in the data module's own checkpoint entry too, because Lightning drops a
stateful loader's state when ``configure_optimizers`` reads ``trainer.estimated_stepping_batches``
(Lightning issue #20550; ``ClassifierModule`` does).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, ModelPruning
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from conftest import make_trainer, test_accuracy
from qlightning import ConfigError, QuantizationAwareTraining, restore
from qlightning.callbacks.checkpoint import (
    AtomicCheckpointIO,
    ModelCheckpointWithFinalLast,
    QATCheckpointMixin,
    ResumableDataLoader,
)
from qlightning.examples import DigitsClassifier, DigitsDataModule
from qlightning.examples.digits import EpochShuffleSampler
from test_qat_callback import assert_state_dicts_equal

STEP_SCHEDULE = dict(fake_quant_start={"step": 50}, observer_freeze={"step": 110}, bn_freeze={"step": 120})
STEPS_PER_EPOCH = 20  # 1258 training images at batch 64
EPOCHS = 8


def fit_steps(ckpt_path=None, dirpath=None, model_cls=DigitsClassifier, datamodule=None, **fit_kwargs):
    """The step-schedule run (160 steps); with ``dirpath`` a checkpoint every 25 steps, all kept."""
    pl.seed_everything(0)
    model = model_cls()
    qat = QuantizationAwareTraining(modules=["net"], **STEP_SCHEDULE)
    callbacks = [qat]
    if dirpath is not None:
        callbacks.append(ModelCheckpoint(dirpath=dirpath, filename="{step}", save_top_k=-1, every_n_train_steps=25))
    trainer = make_trainer(callbacks, max_epochs=EPOCHS, enable_checkpointing=dirpath is not None)
    if datamodule is None and "train_dataloaders" not in fit_kwargs:
        datamodule = DigitsDataModule(seed=0)
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path, **fit_kwargs)
    assert trainer.global_step == EPOCHS * STEPS_PER_EPOCH and qat.converted
    return model, qat


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    dirpath = tmp_path_factory.mktemp("steps")
    model, qat = fit_steps(dirpath=dirpath)
    return dirpath, model, qat


def batches_done_in_epoch(ckpt: Path) -> int:
    state = torch.load(ckpt, weights_only=True)  # plain data, loader state included
    return state["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["processed"]


# ---------------------------------------------------------------------------------------------- mid-epoch


@pytest.mark.parametrize(
    "step, batches_done",
    [(25, 5), (75, 15), (100, 20), (125, 5)],
    ids=["before-fake-quant", "fake-quant-observing", "last-batch-of-epoch-4", "after-freeze"],
)
def test_mid_epoch_resume_gives_the_same_int8_model(uninterrupted, step, batches_done):
    dirpath, reference, reference_qat = uninterrupted
    ckpt = dirpath / f"step={step}.ckpt"
    assert batches_done_in_epoch(ckpt) == batches_done  # 5 and 15 of 20: in the middle of an epoch
    resumed, qat = fit_steps(ckpt_path=str(ckpt))
    assert_state_dicts_equal(reference.net.state_dict(), resumed.net.state_dict())
    assert_state_dicts_equal(
        reference_qat.fake_quant_modules["net"].state_dict(), qat.fake_quant_modules["net"].state_dict()
    )


class PlainLoaderDigits(DigitsDataModule):
    """The same (seed, epoch) order, through a plain DataLoader: restarts its epoch on resume."""

    def train_dataloader(self) -> DataLoader:
        self.setup()
        data = self.splits["train"]
        return DataLoader(data, batch_size=self.batch_size, sampler=EpochShuffleSampler(len(data), self.seed))

    def state_dict(self) -> dict:
        return {}


def test_a_plain_loader_would_not_resume_mid_epoch(uninterrupted):
    """The control: without the resumable loader the same resume ends with different weights."""
    dirpath, reference, _ = uninterrupted
    with pytest.warns(UserWarning, match="dataloader is not resumable"):
        resumed, _ = fit_steps(ckpt_path=str(dirpath / "step=125.ckpt"), datamodule=PlainLoaderDigits(seed=0))
    differ = [k for k, v in reference.net.state_dict().items() if isinstance(v, torch.Tensor) and v.is_quantized
              and not torch.equal(v.int_repr(), resumed.net.state_dict()[k].int_repr())]
    assert differ


class AdamDigits(DigitsClassifier):
    """No ``estimated_stepping_batches`` in configure_optimizers: Lightning restores the loader itself."""

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def test_a_loader_passed_to_fit_resumes_through_lightning(tmp_path):
    dm = DigitsDataModule(seed=0)
    reference, _ = fit_steps(dirpath=tmp_path, model_cls=AdamDigits, train_dataloaders=dm.train_dataloader())
    ckpt = tmp_path / "step=75.ckpt"
    assert torch.load(ckpt, weights_only=True)["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [
        {"epoch": 3, "batches": 15}
    ]
    resumed, _ = fit_steps(
        ckpt_path=str(ckpt), model_cls=AdamDigits, train_dataloaders=DigitsDataModule(seed=0).train_dataloader()
    )
    assert_state_dicts_equal(reference.net.state_dict(), resumed.net.state_dict())


def test_resumable_loader_skips_consumed_batches_of_the_same_epoch_only():
    data = TensorDataset(torch.arange(10))

    def loader(**kwargs):
        return ResumableDataLoader(data, batch_size=3, sampler=EpochShuffleSampler(10, seed=1), **kwargs)

    def epoch(dl, e):
        dl.sampler.set_epoch(e)
        return [b[0].tolist() for b in dl]

    full = epoch(loader(), 2)
    first = loader()
    first.sampler.set_epoch(2)
    it = iter(first)
    seen = [next(it)[0].tolist(), next(it)[0].tolist()]
    assert seen == full[:2] and first.state_dict() == {"epoch": 2, "batches": 2}

    resumed = loader()
    resumed.load_state_dict(first.state_dict())
    assert epoch(resumed, 2) == full[2:]  # the rest of epoch 2, in order
    assert resumed.state_dict() == {"epoch": 2, "batches": 4}
    assert epoch(resumed, 3) == epoch(loader(), 3)  # the next pass is whole

    moved_on = loader(resume_state={"epoch": 2, "batches": 2})
    assert epoch(moved_on, 3) == epoch(loader(), 3)  # saved in epoch 2, resumed at epoch 3: nothing skipped
    finished = loader(resume_state={"epoch": 2, "batches": 4})
    assert epoch(finished, 2) == full  # saved after the last batch: the next pass starts over
    assert len(loader(resume_state={"epoch": 2, "batches": 2})) == 4

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(TypeError, match="IterableDataset"):
        ResumableDataLoader(Stream())


@pytest.mark.parametrize("in_hook", [True, False], ids=["made-in-a-dataloader-hook", "made-outside"])
def test_lightning_can_recreate_the_loader_with_its_resume_state(in_hook):
    """Under DDP Lightning re-creates the loader with a DistributedSampler; the pending state survives."""
    from contextlib import nullcontext

    from lightning.fabric.utilities.data import _replace_dunder_methods
    from lightning.pytorch.utilities.data import _update_dataloader
    from torch.utils.data import DistributedSampler

    dm = DigitsDataModule(seed=0)
    dm.load_state_dict({"train_loader": {"epoch": 3, "batches": 15}})
    with _replace_dunder_methods(DataLoader, "dataset") if in_hook else nullcontext():  # what Lightning does
        loader = dm.train_dataloader()
    copy = _update_dataloader(loader, DistributedSampler(loader.dataset, num_replicas=2, rank=1, shuffle=True))
    assert isinstance(copy, ResumableDataLoader) and copy is not loader
    assert copy.state_dict() == {"epoch": 3, "batches": 15}
    assert len(copy) == 10  # 629 of the 1258 images at batch 64


# ---------------------------------------------------------------------------------------------- fault


def _cli(run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "qlightning.cli", "train", "recipe=digits_step_schedule", f"hydra.run.dir={run_dir}",
        "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
        # the comparison is about training: skip the exports and checks that do not change the int8 model
        "export.formats=[torchscript]", "parity.enabled=false", "report.latency_repeats=1", *extra,
    ]


@pytest.mark.slow
def test_a_killed_training_run_resumes_to_the_same_int8_model_and_report(tmp_path):
    # one thread in every run: the same float reduction order in all three
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    ref_dir, run_dir = tmp_path / "uninterrupted", tmp_path / "killed"
    ref = subprocess.run(_cli(ref_dir), env=env, capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr[-4000:]

    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(_cli(run_dir), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            # the first checkpoint (step 25, batch 5 of epoch 1): kill as soon as last.ckpt is written
            # (after epoch=1-step=25.ckpt; both written atomically, so never half a file)
            while not (run_dir / "checkpoints" / "last.ckpt").exists():
                log_tail = (tmp_path / "killed.log").read_text()[-4000:]
                assert proc.poll() is None and time.monotonic() < deadline, log_tail
                time.sleep(0.02)
            os.killpg(proc.pid, signal.SIGKILL)
        finally:
            proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    last = run_dir / "checkpoints" / "last.ckpt"
    killed_at = torch.load(last, weights_only=True)["global_step"]
    assert 0 < killed_at < EPOCHS * STEPS_PER_EPOCH and batches_done_in_epoch(last) not in (0, STEPS_PER_EPOCH)
    assert not (run_dir / "report.json").exists()

    resumed = subprocess.run(_cli(run_dir, f"ckpt_path={last}"), env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]

    reports = [json.loads((d / "report.json").read_text()) for d in (ref_dir, run_dir)]
    assert reports[0]["metrics"] == reports[1]["metrics"]  # fp32 / fake_quant / int8 accuracy and loss, exactly
    assert reports[0]["size_bytes"] == reports[1]["size_bytes"]
    dm = DigitsDataModule(seed=0)
    dm.setup()
    x, _ = dm.splits["test"].tensors
    with torch.no_grad():
        # TorchScript keeps packed int8 weights out of its state_dict: compare what the files compute
        scripted = [torch.jit.load(str(d / "int8_net.pt"))(x) for d in (ref_dir, run_dir)]
        assert torch.equal(*scripted)
        # last.ckpt holds each run's final state (not the last multiple of 25 steps): it rebuilds that int8 model
        restored = []
        for d in (ref_dir, run_dir):
            ckpt = d / "checkpoints" / "last.ckpt"
            assert torch.load(ckpt, weights_only=True)["global_step"] == EPOCHS * STEPS_PER_EPOCH
            restored.append(restore(DigitsClassifier(), ckpt).net)
        assert_state_dicts_equal(restored[0].state_dict(), restored[1].state_dict())
        assert torch.equal(restored[0](x), scripted[0])


def test_last_checkpoint_holds_the_final_steps(tmp_path):
    pl.seed_everything(0)
    model, qat = DigitsClassifier(), QuantizationAwareTraining(modules=["net"], fake_quant_start={"epoch": 1})
    ckpt = ModelCheckpointWithFinalLast(dirpath=tmp_path, save_last=True, every_n_train_steps=25, every_n_epochs=None)
    trainer = make_trainer([qat, ckpt], max_epochs=2, enable_checkpointing=True, plugins=[AtomicCheckpointIO()])
    trainer.fit(model, datamodule=DigitsDataModule(seed=0))
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 40  # plain ModelCheckpoint: 25
    rebuilt = restore(DigitsClassifier(), tmp_path / "last.ckpt").net
    assert_state_dicts_equal(model.net.state_dict(), rebuilt.state_dict())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=1-step=25.ckpt", "last.ckpt"]


KEEP_SAVING = """
import sys, torch
from qlightning.callbacks.checkpoint import AtomicCheckpointIO
io, state = AtomicCheckpointIO(), {"w": torch.randn(2_000_000), "i": 0}
while True:
    state["i"] += 1
    io.save_checkpoint(state, sys.argv[1])
"""


def test_a_run_killed_while_saving_leaves_a_whole_checkpoint(tmp_path):
    """Lightning's own save is atomic only with the temp dir on the checkpoints' filesystem (else
    ``shutil.move`` copies; measured: 3 of 12 SIGKILLs left a truncated file with TMPDIR=/dev/shm)."""
    path = tmp_path / "last.ckpt"
    proc = subprocess.Popen([sys.executable, "-c", KEEP_SAVING, str(path)])
    try:
        deadline = time.monotonic() + 300
        while not path.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.005)
        time.sleep(0.1)  # a few saves later: most likely inside one
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert torch.load(path, weights_only=True)["i"] >= 1  # whole, never half written


def test_atomic_checkpoint_io_keeps_the_previous_file_when_a_save_fails(tmp_path):
    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1, "w": torch.ones(1000)}, path)
    with pytest.raises(RuntimeError, match="boom"):
        io.save_checkpoint({"step": 2, "w": torch.zeros(1000), "x": Unpicklable()}, path)
    assert torch.load(path, weights_only=True)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


# ---------------------------------------------------------------------------------------------- load_from_checkpoint


class QATDigitsClassifier(QATCheckpointMixin, DigitsClassifier):
    pass


@pytest.fixture(scope="module")
def qat_checkpoint(tmp_path_factory):
    dirpath = tmp_path_factory.mktemp("lfc")
    pl.seed_everything(0)
    model, dm = QATDigitsClassifier(), DigitsDataModule(seed=0)
    qat = QuantizationAwareTraining(
        modules=["net"], fake_quant_start={"epoch": 1}, observer_freeze={"epoch": 2}, bn_freeze={"epoch": 2}
    )
    checkpoint = ModelCheckpoint(dirpath=dirpath, save_last=True)
    trainer = make_trainer([qat, checkpoint], max_epochs=3, enable_checkpointing=True)
    trainer.fit(model, datamodule=dm)
    return dirpath / "last.ckpt", model, qat, dm


def test_load_from_checkpoint_of_a_plain_module_fails_on_prepared_keys(qat_checkpoint):
    last = qat_checkpoint[0]
    with pytest.raises(RuntimeError, match="Missing key|Unexpected key"):
        DigitsClassifier.load_from_checkpoint(last)


def test_load_from_checkpoint_with_the_mixin_gives_the_fake_quant_model(qat_checkpoint):
    last, trained, qat, dm = qat_checkpoint
    loaded = QATDigitsClassifier.load_from_checkpoint(last).eval()
    fake_quant = qat.fake_quant_modules["net"]
    assert type(loaded.net).__name__ == "GraphModule" and loaded.qat_callback.targets == ["net"]
    assert_state_dicts_equal(fake_quant.state_dict(), loaded.net.state_dict())
    x, _ = dm.splits["test"].tensors
    with torch.no_grad():
        assert torch.equal(fake_quant(x), loaded.net(x))  # fake-quant on, observers off: nothing moved
    assert test_accuracy(loaded.net, dm) == test_accuracy(fake_quant, dm) > 0.9
    loaded.qat_callback.convert(loaded)
    assert_state_dicts_equal(trained.net.state_dict(), loaded.net.state_dict())  # the same int8 model


def test_trainer_test_with_the_mixin_works_with_and_without_the_callback(qat_checkpoint):
    last, _, qat, dm = qat_checkpoint
    expected = test_accuracy(qat.fake_quant_modules["net"], dm)
    for callbacks in ([], [QuantizationAwareTraining(modules=["net"])]):
        result = make_trainer(callbacks).test(QATDigitsClassifier(), datamodule=dm, ckpt_path=str(last), verbose=False)
        assert result[0]["test/accuracy"] == pytest.approx(expected, abs=1e-6)


def test_the_mixin_leaves_float_checkpoints_alone(tmp_path):
    pl.seed_everything(0)
    model = QATDigitsClassifier()
    trainer = make_trainer([], max_epochs=1, limit_train_batches=2, limit_val_batches=0)
    trainer.fit(model, datamodule=DigitsDataModule(seed=0))
    trainer.save_checkpoint(tmp_path / "float.ckpt")
    loaded = QATDigitsClassifier.load_from_checkpoint(tmp_path / "float.ckpt")
    assert loaded.qat_callback is None and isinstance(loaded.net.features[0][0], torch.nn.Conv2d)


# ---------------------------------------------------------------------------------------------- ModelPruning


def int8_sparsity(net: torch.nn.Module) -> dict[str, float]:
    out = {}
    for name, module in net.named_modules():
        weight = getattr(module, "weight", None)
        weight = weight() if callable(weight) else weight
        if isinstance(weight, torch.Tensor) and weight.is_quantized:
            out[name] = (weight.int_repr() == 0).float().mean().item()  # symmetric qint8 weights: 0 is 0
    return out


def fit_pruned(tmp_path, **pruning):
    pl.seed_everything(0)
    model, dm = DigitsClassifier(), DigitsDataModule(seed=0)
    qat = QuantizationAwareTraining(
        modules=["net"], fake_quant_start={"epoch": 1}, observer_freeze={"epoch": 4}, bn_freeze={"epoch": 4}
    )
    pruning = {"amount": 0.3, "use_global_unstructured": False, "use_lottery_ticket_hypothesis": False,
               "apply_pruning": lambda epoch: epoch < 3, **pruning}  # 1 - 0.7**3 = 65.7% of each tensor
    callbacks = [ModelPruning("l1_unstructured", **pruning), qat, ModelCheckpoint(dirpath=tmp_path, save_last=True)]
    make_trainer(callbacks, max_epochs=6, enable_checkpointing=True).fit(model, datamodule=dm)
    return model, qat, dm


@pytest.mark.parametrize("permanent", [True, False], ids=["pruning-made-permanent", "masks-kept"])
def test_model_pruning_prunes_the_qat_weights_and_int8_keeps_the_sparsity(tmp_path, permanent):
    model, qat, dm = fit_pruned(tmp_path, make_pruning_permanent=permanent)
    sparsity = int8_sparsity(model.net)
    assert set(sparsity) == {"features.0.0", "features.1.0", "features.3.0", "classifier"}
    assert all(0.65 <= s <= 0.67 for s in sparsity.values()), sparsity
    fake_quant = qat.fake_quant_modules["net"]
    x, _ = dm.splits["test"].tensors
    with torch.no_grad():
        agreement = (fake_quant(x).argmax(1) == model.net(x).argmax(1)).float().mean().item()
    assert agreement >= 0.98 and test_accuracy(model.net, dm) > 0.95, (agreement, test_accuracy(model.net, dm))
    if permanent:  # ModelPruning writes the masked weights into the checkpoint: the same int8 model rebuilds
        rebuilt = restore(DigitsClassifier(), tmp_path / "last.ckpt").net
        assert_state_dicts_equal(model.net.state_dict(), rebuilt.state_dict())


def test_model_pruning_of_a_batchnorm_folded_by_qat_fails_before_training(tmp_path):
    model = DigitsClassifier()
    bn = model.net.features[0][1]
    qat = QuantizationAwareTraining(modules=["net"])
    pruning = ModelPruning("l1_unstructured", parameters_to_prune=[(bn, "weight")], amount=0.5)
    trainer = make_trainer([qat, pruning], max_epochs=1)
    with pytest.raises(ConfigError, match=r"net\.features\.0\.1\.weight.*folded into its conv"):
        trainer.fit(model, datamodule=DigitsDataModule(seed=0))
    assert trainer.global_step == 0


# ---------------------------------------------------------------------------------------------- DDP

DDP_SCRIPT = textwrap.dedent(
    """
    import sys, logging, warnings
    from pathlib import Path
    import torch
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from qlightning import QuantizationAwareTraining
    from qlightning.examples import DigitsClassifier, DigitsDataModule

    out, resume = Path(sys.argv[1]), (sys.argv[2] if len(sys.argv) > 2 else None)
    pl.seed_everything(0, verbose=False)
    qat = QuantizationAwareTraining(
        modules=["net"], fake_quant_start={"step": 50}, observer_freeze={"step": 100}, bn_freeze={"step": 110}
    )
    callbacks = [qat]
    if resume is None:
        callbacks.append(
            ModelCheckpoint(dirpath=out / "ckpt", filename="{step}", save_top_k=-1, every_n_train_steps=30)
        )
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=4, limit_val_batches=2, num_sanity_val_steps=0,
        callbacks=callbacks, logger=False, enable_checkpointing=resume is None, enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = DigitsClassifier()
    trainer.fit(model, datamodule=DigitsDataModule(batch_size=16, seed=0), ckpt_path=resume)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(model.net.state_dict(), out / f"int8_rank{trainer.global_rank}.pt")
    """
)


@pytest.mark.slow
def test_ddp_mid_epoch_resume_gives_the_same_int8_model(tmp_path):
    """2 CPU processes (gloo), 40 steps per epoch per rank; resumed at step 90 = epoch 2, batch 10."""
    script = tmp_path / "ddp_resume.py"
    script.write_text(DDP_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}

    def run(out: Path, *resume: str) -> None:
        command = [sys.executable, str(script), str(out), *resume]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]

    run(tmp_path / "ref")
    ckpt = tmp_path / "ref" / "ckpt" / "step=90.ckpt"
    assert batches_done_in_epoch(ckpt) == 10
    run(tmp_path / "resumed", str(ckpt))
    reference = torch.load(tmp_path / "ref" / "int8_rank0.pt", weights_only=False)
    for rank in (0, 1):
        resumed = torch.load(tmp_path / "resumed" / f"int8_rank{rank}.pt", weights_only=False)
        assert_state_dicts_equal(reference, resumed)
