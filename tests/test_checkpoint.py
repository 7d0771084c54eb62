"""QAT checkpoints: plain data, testable with ckpt_path=, rebuildable without a Trainer."""

from __future__ import annotations

import subprocess
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from conftest import DEFAULT_SCHEDULE, make_trainer, test_accuracy
from qlightning import QuantizationAwareTraining
from qlightning.examples import DigitsClassifier, DigitsDataModule


def train_with_checkpoints(tmp_path):
    pl.seed_everything(0)
    model, dm = DigitsClassifier(), DigitsDataModule(seed=0)
    qat = QuantizationAwareTraining(modules=["net"], **DEFAULT_SCHEDULE)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    make_trainer([qat, ckpt], enable_checkpointing=True).fit(model, datamodule=dm)
    return model, dm, tmp_path / "last.ckpt"


def test_checkpoint_rebuilds_int8_and_fake_quant_models_in_a_fresh_process(tmp_path):
    model, dm, last = train_with_checkpoints(tmp_path)
    expected_int8 = test_accuracy(model.net, dm)
    code = (
        "import torch, warnings; warnings.filterwarnings('ignore')\n"
        "from qlightning import restore\n"
        "from qlightning.examples import DigitsClassifier, DigitsDataModule\n"
        "dm = DigitsDataModule(seed=0); dm.setup(); x, y = dm.splits['test'].tensors\n"
        f"int8 = restore(DigitsClassifier(), '{last}')\n"
        f"fq = restore(DigitsClassifier(), '{last}', convert=False)\n"
        "with torch.no_grad():\n"
        "    print((int8.net(x).argmax(1) == y).float().mean().item(), (fq.net(x).argmax(1) == y).float().mean().item())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    int8_acc, fq_acc = map(float, out.stdout.split())
    assert int8_acc == expected_int8  # the same int8 model, rebuilt from plain data
    assert abs(fq_acc - int8_acc) <= 0.01


def test_trainer_test_with_ckpt_path_loads_a_qat_checkpoint(tmp_path):
    _, dm, last = train_with_checkpoints(tmp_path)
    fresh = DigitsClassifier()
    qat = QuantizationAwareTraining(modules=["net"])
    result = make_trainer([qat]).test(fresh, datamodule=dm, ckpt_path=str(last), verbose=False)
    assert result[0]["test/accuracy"] > 0.95  # loaded strictly into the fake-quant model, then converted
    assert qat.prepared and qat.converted  # what ships is what is tested: the int8 model
    fake_quant = QuantizationAwareTraining(modules=["net"], convert_on_fit_end=False)
    result = make_trainer([fake_quant]).test(DigitsClassifier(), datamodule=dm, ckpt_path=str(last), verbose=False)
    assert result[0]["test/accuracy"] > 0.95 and fake_quant.prepared and not fake_quant.converted
