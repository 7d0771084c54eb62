"""Cross-layer, input-weight and selective equalization on a trained digits CNN made imbalanced."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from conftest import make_trainer, test_accuracy
from qlightning import Inputs, QuantSpec
from qlightning.callbacks.ptq import PostTrainingQuantization, ptq_baseline
from qlightning.quantize.equalization import (
    EqualizationPair,
    _rescale,
    cross_layer_equalization,
    effective_weight,
    find_pairs,
    fused_reference,
    input_weight_equalization_mapping,
    equalized_layers,
    layer_output_sqnr,
    selective_cross_layer_equalization,
    weight_sqnr,
)
from qlightning.examples import DigitsClassifier, DigitsDataModule
from qlightning.engines.fx.qconfigs import low_bit_qconfig, low_bit_qconfig_mapping

LAYERS = ["features.0.0", "features.1.0", "features.3.0", "classifier"]
PER_TENSOR = QuantSpec(backend="x86", is_qat=False,
                       qconfig_mapping=low_bit_qconfig_mapping("x86", weight_bits=8, per_channel=False))
PER_TENSOR_WEIGHT = low_bit_qconfig(8, per_channel=False).weight


def imbalance(net: nn.Module, spread: float = 2.0, seed: int = 123) -> nn.Module:
    """A copy of ``net`` computing the same function with channel ranges spread by up to e^+-spread:
    output channel i of each layer (through its BatchNorm) times a_i, the next layer's input channel i / a_i."""
    out = copy.deepcopy(net)
    g = torch.Generator().manual_seed(seed)
    for pair in find_pairs(out):
        n = out.get_submodule(pair.first).weight.shape[0]
        a = torch.exp((torch.rand(n, generator=g) * 2 - 1) * spread)
        _rescale(out, pair, 1 / a)
    return out


@pytest.fixture(scope="module")
def trained():
    pl.seed_everything(0)
    dm = DigitsDataModule(seed=0)
    model = DigitsClassifier()
    make_trainer([], max_epochs=6).fit(model, datamodule=dm)
    dm.setup()
    calib = [x for x, _ in list(dm.train_dataloader())[:8]]
    return model.net.eval(), dm, calib


def test_pairs_of_the_digits_cnn_are_found_through_bn_relu_pool_and_flatten(trained):
    net, *_ = trained
    assert find_pairs(net) == [
        EqualizationPair("features.0.0", "features.1.0", "features.0.1"),
        EqualizationPair("features.1.0", "features.3.0", "features.1.1"),  # through MaxPool2d
        EqualizationPair("features.3.0", "classifier", "features.3.1"),  # AdaptiveAvgPool2d + flatten
    ]


def test_cle_preserves_the_function_and_equalizes_ranges(trained):
    net, dm, _ = trained
    x, _ = dm.splits["test"].tensors
    eq = copy.deepcopy(net)
    result = cross_layer_equalization(eq)
    assert 1 < result.iterations < 50
    with torch.no_grad():
        torch.testing.assert_close(eq(x), net(x), rtol=1e-4, atol=1e-4)
    bn_after = {"features.1.0": "features.1.1", "features.3.0": "features.3.1"}
    for pair in result.pairs:
        w1 = effective_weight(eq.get_submodule(pair.first), eq.get_submodule(pair.bn))
        r1 = w1.reshape(w1.shape[0], -1).abs().amax(1)
        second = eq.get_submodule(pair.second)
        w2 = effective_weight(second, eq.get_submodule(bn_after[pair.second]) if pair.second in bn_after else None)
        r2 = w2.transpose(0, 1).reshape(w2.shape[1], -1).abs().amax(1)
        torch.testing.assert_close(r1, r2, rtol=1e-3, atol=1e-6)  # both sides at sqrt(r1 * r2)
    # in train mode too (BatchNorm weight and bias carry the scale, batch statistics follow)
    a, b = copy.deepcopy(net).train(), copy.deepcopy(net).train()
    cross_layer_equalization(b)
    with torch.no_grad():
        torch.testing.assert_close(b(x[:64]), a(x[:64]), rtol=1e-4, atol=1e-4)


def test_cle_handles_groups_leaky_relu_and_linear_pairs_and_skips_residual_branches():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c1, self.c2, self.c3 = nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3, groups=4), nn.Conv2d(8, 8, 1)
            self.l1, self.l2 = nn.Linear(32, 16), nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = nn.functional.leaky_relu(self.c2(torch.relu(self.c1(x))))
            y = y + self.c3(y)  # y feeds two branches: c2 -> c3 must not be rescaled
            y = torch.flatten(nn.functional.adaptive_avg_pool2d(y, 2), 1)
            return self.l2(torch.relu(self.l1(y)))

    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        net.c1.weight[:4] *= 20
    x = torch.randn(4, 3, 10, 10)
    before = net(x)
    assert find_pairs(net) == [EqualizationPair("c1", "c2"), EqualizationPair("l1", "l2")]
    cross_layer_equalization(net)
    torch.testing.assert_close(net(x), before, rtol=1e-4, atol=1e-4)


def test_equalization_recovers_per_tensor_ptq_on_an_imbalanced_model(trained):
    """Channel scales that leave the float model unchanged wreck per-tensor PTQ; equalization repairs it."""
    net, dm, calib = trained
    imb = imbalance(net)
    float_acc = test_accuracy(net, dm)
    assert test_accuracy(imb, dm) == pytest.approx(float_acc, abs=1e-6)
    cle = copy.deepcopy(imb)
    cross_layer_equalization(cle)

    # per-layer weight SQNR (8-bit per-tensor, BN folded): every layer improves by > 5 dB
    w_imb, w_cle = weight_sqnr(imb, PER_TENSOR_WEIGHT), weight_sqnr(cle, PER_TENSOR_WEIGHT)
    for layer in LAYERS:
        assert w_cle[layer] > w_imb[layer] + 5, (layer, w_imb[layer], w_cle[layer])

    # per-layer output SQNR of the int8 model on calibration data: every layer improves
    q_imb, q_cle = ptq_baseline(imb, calib, PER_TENSOR), ptq_baseline(cle, calib, PER_TENSOR)
    inputs = [Inputs((x,)) for x in calib[:4]]
    o_imb = layer_output_sqnr(fused_reference(imb), q_imb, inputs, LAYERS)
    o_cle = layer_output_sqnr(fused_reference(cle), q_cle, inputs, LAYERS)
    for layer in LAYERS:
        assert o_cle[layer] > o_imb[layer], (layer, o_imb[layer], o_cle[layer])

    # accuracy (measured: float 99.6%, imbalanced PTQ 72.2%, after CLE 99.6%)
    acc_imb, acc_cle = test_accuracy(q_imb, dm), test_accuracy(q_cle, dm)
    assert acc_imb < float_acc - 0.10, (acc_imb, float_acc)
    assert acc_cle >= float_acc - 0.01, (acc_cle, float_acc)
    # input-weight equalization (activation statistics) also repairs most of it (measured 98.5%)
    acc_iw = test_accuracy(ptq_baseline(imb, calib, PER_TENSOR, equalization="all"), dm)
    assert acc_iw > acc_imb + 0.10, (acc_iw, acc_imb)


def test_selective_cle_keeps_a_pair_only_where_weight_sqnr_improves(trained):
    net, dm, _ = trained
    x, _ = dm.splits["test"].tensors
    # per-tensor weights on the imbalanced model: every pair helps
    imb = imbalance(net)
    result = selective_cross_layer_equalization(imb, PER_TENSOR_WEIGHT)
    assert len(result.kept) == 3 and not result.rejected
    # per-channel 4-bit weights on the balanced model: each decision is backed by its SQNR
    per_channel = low_bit_qconfig(4).weight
    model = copy.deepcopy(net)
    result = selective_cross_layer_equalization(model, per_channel)
    assert len(result.kept) + len(result.rejected) == 3
    for pair in result.pairs:
        layers = [pair.first, pair.second]
        mean = lambda d: sum(d[n] for n in layers) / 2  # noqa: E731
        if str(pair) in result.kept:
            assert mean(weight_sqnr(model, per_channel, layers)) >= mean(weight_sqnr(net, per_channel, layers)) - 0.5
    with torch.no_grad():
        torch.testing.assert_close(model(x), net(x), rtol=1e-4, atol=1e-4)


def test_input_weight_equalization_keeps_the_preceding_layer_torch_needs(trained):
    net, dm, calib = trained
    mapping = input_weight_equalization_mapping(net, ["features.1.0"])
    # torch.ao folds conv2's equalization scale into conv1 only if conv1 is equalized too
    assert equalized_layers(mapping) == ["features.0.0", "features.1.0"]
    q = ptq_baseline(net, calib, PER_TENSOR, equalization=["features.1.0"])
    assert test_accuracy(q, dm) >= test_accuracy(net, dm) - 0.01


def test_ptq_callback_with_selective_input_weight_equalization_and_cle(trained):
    net, dm, _ = trained
    model = DigitsClassifier()
    model.net = imbalance(net)
    ptq = PostTrainingQuantization(
        qconfig_mapping=low_bit_qconfig_mapping("x86", weight_bits=8, per_channel=False),
        num_calibration_batches=4, equalization="selective",
    )
    make_trainer([ptq]).test(model, datamodule=dm, verbose=False)
    details = ptq.details["net"]["equalization"]
    assert set(details["kept"]) | set(details["rejected"]) == set(LAYERS)
    for layer in details["kept"]:
        assert details["sqnr_db_with"][layer] > details["sqnr_db_without"][layer]
    plain = test_accuracy(ptq_baseline(imbalance(net), [x for x, _ in list(dm.train_dataloader())[:4]], PER_TENSOR), dm)
    assert test_accuracy(model.net, dm) >= plain

    model = DigitsClassifier()
    model.net = imbalance(net)
    ptq = PostTrainingQuantization(
        qconfig_mapping=low_bit_qconfig_mapping("x86", weight_bits=8, per_channel=False),
        num_calibration_batches=4, cross_layer_equalization="selective",
    )
    make_trainer([ptq]).test(model, datamodule=dm, verbose=False)
    assert len(ptq.details["net"]["cross_layer_equalization"]["kept"]) == 3
    assert test_accuracy(model.net, dm) >= test_accuracy(net, dm) - 0.01
