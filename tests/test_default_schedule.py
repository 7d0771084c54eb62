"""The schedule a new user gets (none given) keeps int8 within 3 points of float.

3 architectures x {Adam 1e-2, SGD 0.1 momentum 0.9} with a constant learning rate (the hard case for a
schedule: no decay hides a late freeze), seed 0, 6 epochs on digits. The defaults were chosen from
the 470-run study in notes/defaults.md (``python -m benchmarks.defaults_study``); these cells kept at
least 1.5 points of margin there. Before the derived schedule, fake-quant from step 0 with nothing
frozen lost 5.2 points in the median cell, up to 13.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from conftest import make_trainer, test_accuracy
from qlightning import QuantizationAwareTraining
from qlightning.examples.digits import ClassifierModule, DigitsCNN, DigitsDataModule, ResidualDepthwiseCNN, RowTransformer

ARCHS = {"cnn": DigitsCNN, "resdw": ResidualDepthwiseCNN, "transformer": RowTransformer}
OPTIMIZERS = {"adam": ("adam", 1e-2), "sgd": ("sgd", 0.1)}


def fit(arch: str, optimizer: str, callbacks: list) -> tuple[ClassifierModule, DigitsDataModule]:
    pl.seed_everything(0, verbose=False)
    dm = DigitsDataModule(seed=0)
    name, lr = OPTIMIZERS[optimizer]
    model = ClassifierModule(ARCHS[arch](), lr=lr, optimizer=name, scheduler="constant")
    model.example_input_array = torch.zeros(1, 1, 8, 8)
    make_trainer(callbacks, max_epochs=6, limit_val_batches=0, num_sanity_val_steps=0).fit(model, datamodule=dm)
    return model, dm


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_the_default_schedule_keeps_int8_within_3_points_of_float(arch, optimizer):
    torch.set_num_threads(1)
    model, dm = fit(arch, optimizer, [])
    float_accuracy = test_accuracy(model.net.eval(), dm)
    qat = QuantizationAwareTraining(modules=["net"])  # no schedule: derived from the run
    model, dm = fit(arch, optimizer, [qat])
    assert qat.converted
    assert qat.schedule.fake_quant_start.step == 60 and qat.schedule.observer_freeze.step == 102
    assert qat.schedule.bn_freeze is None
    assert test_accuracy(model.net, dm) >= float_accuracy - 0.03, (arch, optimizer)
