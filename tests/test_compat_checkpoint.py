"""Checkpoints written before the restructuring (main at f92789e) still resume.

``tests/data/qat_digits_step75_f92789e.ckpt`` is the step-75 checkpoint (fake-quant on, observers
running, mid-epoch) of ``test_resume.fit_steps`` as that commit wrote it;
``qat_digits_final_f92789e.pt`` holds that commit's int8 and fake-quant state dicts at the end of the
same uninterrupted run. Both were made by running ``test_resume.fit_steps(dirpath=...)`` on the old tree.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from conftest import test_accuracy
from qlightning.examples import DigitsDataModule
from test_resume import EPOCHS, STEPS_PER_EPOCH, fit_steps

DATA = Path(__file__).parent / "data"


def test_a_checkpoint_from_before_the_restructuring_resumes_to_the_same_model():
    old = torch.load(DATA / "qat_digits_final_f92789e.pt", weights_only=True)
    checkpoint = torch.load(DATA / "qat_digits_step75_f92789e.ckpt", weights_only=True)  # plain data
    assert checkpoint["global_step"] == 75

    resumed, qat = fit_steps(ckpt_path=str(DATA / "qat_digits_step75_f92789e.ckpt"))

    assert qat.phase is not None and qat.phase.fake_quant and not qat.phase.observe  # ended after the freeze
    assert qat.converted and resumed.trainer.global_step == EPOCHS * STEPS_PER_EPOCH
    # the old int8 and fake-quant state dicts have exactly the structure of today's modules
    assert set(old["int8"]) == set(resumed.net.state_dict())
    assert set(old["fake_quant"]) == set(qat.fake_quant_modules["net"].state_dict())
    old_int8 = copy.deepcopy(resumed.net)
    old_int8.load_state_dict(old["int8"], strict=True)
    dm = DigitsDataModule(seed=0)
    new_acc, old_acc = test_accuracy(resumed.net, dm), test_accuracy(old_int8, dm)
    assert abs(new_acc - old_acc) <= 0.01, (new_acc, old_acc)
    x, _ = dm.splits["test"].tensors
    with torch.no_grad():
        agreement = (resumed.net(x).argmax(1) == old_int8(x).argmax(1)).float().mean().item()
    assert agreement >= 0.98
