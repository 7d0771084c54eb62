"""4-bit weights, 8-bit activations (W4A8): helpers, and PTQ vs QAT on a compact digits CNN."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from conftest import make_trainer
from qlightning import ConfigError, QuantizationAwareTraining
from qlightning.callbacks.ptq import PostTrainingQuantization
from qlightning.examples import DigitsClassifier, DigitsDataModule
from qlightning.engines.fx.qconfigs import (
    clamp_quantized_weights,
    low_bit_qconfig,
    low_bit_qconfig_mapping,
    ptq_qconfig_mapping,
    weight_int_range,
    weight_range,
)

# (8, 16, 32) channels: with the default (16, 32, 64) digits is so redundant that per-channel
# 4-bit PTQ loses nothing measurable (median of 3 seeds: float 99.07%, PTQ 99.07%, QAT 99.07%).
CHANNELS = (8, 16, 32)
SCHEDULE = dict(fake_quant_start={"epoch": 3}, observer_freeze={"epoch": 6}, bn_freeze={"epoch": 6})


def held_out_accuracy(net: nn.Module, dm: DigitsDataModule) -> float:
    """Accuracy on validation + test (540 images: one image = 0.19 points)."""
    dm.setup()
    x = torch.cat([dm.splits["val"].tensors[0], dm.splits["test"].tensors[0]])
    y = torch.cat([dm.splits["val"].tensors[1], dm.splits["test"].tensors[1]])
    with torch.no_grad():
        return (net(x).argmax(1) == y).float().mean().item()


def test_weight_range_and_activation_range_choices():
    assert weight_range(4) == (-7, 7) and weight_range(4, narrow_range=False) == (-8, 7)
    assert weight_range(8) == (-127, 127)
    w4 = low_bit_qconfig(4)
    act, weight = w4.activation(), w4.weight()
    assert (weight.quant_min, weight.quant_max, weight.qscheme) == (-7, 7, torch.per_channel_symmetric)
    assert (act.quant_min, act.quant_max) == (0, 255)  # 4-bit weights cannot overflow x86's int16 pairs
    a8w8 = low_bit_qconfig(8, backend="x86").activation()
    assert (a8w8.quant_min, a8w8.quant_max) == (0, 127)  # 8-bit weights: reduce_range as torch's default
    assert low_bit_qconfig(4, per_channel=False).weight().qscheme == torch.per_tensor_symmetric
    with pytest.raises(ConfigError) as info:
        low_bit_qconfig(weight_bits=9, activation_bits=1, activation_observer="mse")
    assert len(info.value.problems) == 3


def test_qat_weight_fake_quant_uses_the_scale_convert_will_use():
    from torch.ao.quantization import FakeQuantize

    fq = low_bit_qconfig(4, is_qat=True).weight()
    assert type(fq) is FakeQuantize  # not the fused kernel: its scales differ at narrow ranges
    x = torch.tensor([[1.0, -0.5], [0.3, -2.0]])
    fq(x)
    fq(1.5 * x)
    scale, _ = fq.calculate_qparams()
    torch.testing.assert_close(fq.scale, scale)
    torch.testing.assert_close(scale, torch.tensor([1.5, 3.0]) / 7)  # averaging_constant=1: current range


def test_ptq_counterpart_keeps_bits_and_drops_fake_quant():
    mapping = ptq_qconfig_mapping(low_bit_qconfig_mapping("x86", weight_bits=4, is_qat=True))
    weight = mapping.global_qconfig.weight()
    assert type(weight).__name__ == "PerChannelMinMaxObserver" and (weight.quant_min, weight.quant_max) == (-7, 7)


@pytest.mark.parametrize("backend", ["x86", "fbgemm", "qnnpack", "onednn"])
def test_every_backend_accepts_w4a8_and_unsupported_qconfigs_are_detected(backend):
    from torch.ao.quantization import MinMaxObserver, QConfig

    from qlightning.engines.fx.qconfigs import unsupported_types

    low_bit_qconfig_mapping(backend, weight_bits=4)  # check=True: raises if Conv2d/Linear would stay float
    bad = QConfig(activation=MinMaxObserver.with_args(dtype=torch.quint8), weight=MinMaxObserver.with_args(dtype=torch.quint8))
    assert unsupported_types(bad, backend, (nn.Conv2d, nn.Linear)) == [nn.Conv2d, nn.Linear]


def test_clamp_quantized_weights_to_the_low_bit_range():
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    x = torch.randn(16, 8)
    prepared = prepare_fx(net, get_default_qconfig_mapping("x86"), (x,))
    prepared(x)
    int8 = convert_fx(prepared)
    assert max(hi for _, hi in weight_int_range(int8).values()) > 7
    assert clamp_quantized_weights(int8, -7, 7) > 0
    assert all(lo >= -7 and hi <= 7 for lo, hi in weight_int_range(int8).values())
    int8(x)


@pytest.fixture(scope="module")
def w4a8_runs():
    """Seed 0: 8 float epochs + W4A8 PTQ at fit end, and 8 epochs of W4A8 QAT (default schedule)."""
    pl.seed_everything(0)
    dm = DigitsDataModule(seed=0)
    model = DigitsClassifier(channels=CHANNELS)
    ptq = PostTrainingQuantization(qconfig_mapping=low_bit_qconfig_mapping("x86", weight_bits=4), num_calibration_batches=8)
    make_trainer([ptq], max_epochs=8).fit(model, datamodule=dm)

    pl.seed_everything(0)
    dm_qat = DigitsDataModule(seed=0)
    qat_model = DigitsClassifier(channels=CHANNELS)
    qat = QuantizationAwareTraining(qconfig_mapping=low_bit_qconfig_mapping("x86", weight_bits=4, is_qat=True), **SCHEDULE)
    make_trainer([qat], max_epochs=8).fit(qat_model, datamodule=dm_qat)
    return dm, ptq, model, qat, qat_model


def test_w4a8_qat_recovers_what_ptq_loses(w4a8_runs):
    """Measured (seeds 0/1/2, AVX2 and Xeon CPUs): float 98.70/98.33/99.44, PTQ 97.04/97.41/96.48, QAT
    98.33/97.96/98.70. On an AMD EPYC with AVX-512 (stop 52) seed 0 trains otherwise (float kernels round
    differently): float 98.89, PTQ 97.78, QAT 97.96 (its fake-quant model 97.96 too): QAT recovers 1 of the 6 images
    PTQ loses. The margin asked of QAT is therefore any gain over PTQ, not a fixed one."""
    dm, ptq, model, qat, qat_model = w4a8_runs
    float_acc = held_out_accuracy(ptq.float_modules["net"], dm)
    ptq_acc = held_out_accuracy(model.net, dm)
    qat_acc = held_out_accuracy(qat_model.net, dm)
    assert float_acc > 0.97
    assert ptq_acc <= float_acc - 0.008, (ptq_acc, float_acc)  # PTQ measurably below float (>= 4 images)
    assert qat_acc >= float_acc - 0.015, (qat_acc, float_acc)  # QAT within 1.5 points of float
    assert qat_acc > ptq_acc, (qat_acc, ptq_acc, float_acc)


def test_w4a8_models_really_hold_4_bit_weights_and_qat_int8_matches_fake_quant(w4a8_runs):
    dm, _, model, qat, qat_model = w4a8_runs
    for net in (model.net, qat_model.net):
        ranges = weight_int_range(net)
        assert len(ranges) == 4 and all(-7 <= lo and hi <= 7 for lo, hi in ranges.values()), ranges
    fake = qat.fake_quant_modules["net"]
    dm.setup()
    x, _ = dm.splits["test"].tensors
    with torch.no_grad():
        agreement = (fake(x).argmax(1) == qat_model.net(x).argmax(1)).float().mean().item()
    assert agreement >= 0.99
