"""nn.MultiheadAttention under the FX engine: its projections in int8 (issue 17).

torch.ao FX keeps ``nn.MultiheadAttention`` a float leaf (torchvision's VisionTransformer ran its attention
projections in float). The FX engine splits each one into four ``nn.Linear`` around a float attention core
(``qlightning/engines/fx/attention.py``): the split must compute what the module computes, its projections
must come out int8 and close to the fake-quant model, and a user's config that names the module keeps it whole.
"""

from __future__ import annotations

import copy
import importlib.util

import lightning.pytorch as pl
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from qlightning import Inputs, QuantizationAwareTraining, QuantSpec, get_engine
from qlightning.engines.fx.attention import AttentionCore, ProjectedMultiheadAttention
from qlightning.errors import TraceError
from qlightning.examples.digits import ClassifierModule, DigitsDataModule
from tests.conftest import make_trainer, test_accuracy


class RowAttention(nn.Module):
    """The 8 digit rows as tokens through one pre-LayerNorm block whose attention is an ``nn.MultiheadAttention``
    (as torchvision's ViT EncoderBlock calls it)."""

    def __init__(self, d: int = 48, heads: int = 4, mlp: int = 96) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.pos = nn.Parameter(torch.randn(1, 8, d) * 0.02)
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, mlp), nn.ReLU(), nn.Linear(mlp, d))
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x.reshape(-1, 8, 8)) + self.pos
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.ln2(x))
        return self.head(x.mean(dim=1))


PROJECTIONS = ("linear_Q", "linear_K", "linear_V", "out_proj")


@settings(max_examples=60, deadline=None)
@given(
    batch_first=st.booleans(), kdim=st.sampled_from([None, 6]), bias=st.booleans(), need_weights=st.booleans(),
    average=st.booleans(), batched=st.booleans(), mask=st.sampled_from([None, "bool", "float", "per_head", "causal"]),
    padding=st.booleans(), training=st.booleans(), seed=st.integers(0, 2**16),
)
def test_the_split_computes_what_multihead_attention_computes(batch_first, kdim, bias, need_weights, average, batched,
                                                               mask, padding, training, seed):
    torch.manual_seed(seed)
    heads, n, target, source = 4, 3, 5, 7
    float_ = nn.MultiheadAttention(16, heads, dropout=0.25, bias=bias, kdim=kdim, vdim=kdim, batch_first=batch_first)
    split = ProjectedMultiheadAttention.from_float(float_)
    float_.train(training), split.train(training)

    def shaped(length: int, width: int) -> torch.Tensor:
        if not batched:
            return torch.randn(length, width)
        return torch.randn(n, length, width) if batch_first else torch.randn(length, n, width)

    q, k, v = shaped(target, 16), shaped(source, kdim or 16), shaped(source, kdim or 16)
    kwargs = {"need_weights": need_weights, "average_attn_weights": average}
    if mask == "bool":
        kwargs["attn_mask"] = torch.rand(target, source) > 0.7
    elif mask == "float":
        kwargs["attn_mask"] = torch.randn(target, source)
    elif mask == "per_head":
        kwargs["attn_mask"] = torch.randn((n if batched else 1) * heads, target, source)
    elif mask == "causal":
        kwargs["attn_mask"] = torch.triu(torch.full((target, source), float("-inf")), 1)
        kwargs["is_causal"] = True
    if padding and mask != "float" and mask != "per_head":  # torch deprecates mixing float and bool masks
        padding_mask = torch.rand(n, source) > 0.7
        kwargs["key_padding_mask"] = padding_mask if batched else padding_mask[0]
    with torch.no_grad():
        seed_of_dropout = torch.seed()
        torch.manual_seed(seed_of_dropout)
        expected, expected_weights = float_(q, k, v, **kwargs)
        torch.manual_seed(seed_of_dropout)
        got, weights = split(q, k, v, **kwargs)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5, equal_nan=True)
    assert (weights is None) == (expected_weights is None)
    if weights is not None:
        torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=1e-5, equal_nan=True)


def test_qat_fit_quantizes_the_attention_projections_and_int8_matches_fake_quant():
    pl.seed_everything(0)
    dm = DigitsDataModule(seed=0)
    model = ClassifierModule(RowAttention(), lr=3e-3)
    qat = QuantizationAwareTraining(modules=["net"], backend="x86")
    make_trainer([qat], max_epochs=10).fit(model, datamodule=dm)

    int8 = model.net
    kinds = {name: type(int8.get_submodule(f"attn.{name}")) for name in PROJECTIONS}
    assert all(k.__module__.startswith("torch.ao.nn.quantized") and k.__name__ == "Linear" for k in kinds.values()), kinds
    fidelity = qat.fidelity_results["net"]
    assert fidelity["passed"] and fidelity["sqnr_db"] >= 25 and fidelity["top1_agreement"] >= 0.99, fidelity
    int8_accuracy = test_accuracy(int8, dm)
    fake_quant_accuracy = test_accuracy(qat.fake_quant_modules["net"], dm)
    assert int8_accuracy >= 0.85 and abs(int8_accuracy - fake_quant_accuracy) <= 0.01, (int8_accuracy, fake_quant_accuracy)


def _prepare(net: nn.Module, **spec) -> nn.Module:
    return get_engine("fx").prepare(net, Inputs((torch.randn(4, 64),)), QuantSpec(backend="x86", **spec))


def test_the_prepared_split_restores_its_state_into_a_fresh_prepare():
    torch.manual_seed(0)
    net = RowAttention()
    first, second = _prepare(copy.deepcopy(net)), _prepare(copy.deepcopy(net))
    x = torch.randn(16, 64)
    first(x)  # observers move
    second.load_state_dict(first.state_dict())
    first.eval(), second.eval()
    assert any(k.startswith("attn.linear_Q.") for k in first.state_dict())
    assert torch.equal(first(x), second(x))


@pytest.mark.parametrize("how", ["option", "object_type", "non_traceable", "custom_module"])
def test_a_config_that_names_the_module_keeps_it_whole(how):
    import torch.ao.nn.quantizable as nnqa
    from torch.ao.quantization import get_default_qat_qconfig_mapping
    from torch.ao.quantization.fx.custom_config import PrepareCustomConfig

    spec: dict = {}
    if how == "option":
        spec["options"] = {"split_attention": False}
    elif how == "object_type":
        spec["qconfig_mapping"] = get_default_qat_qconfig_mapping("x86").set_object_type(nn.MultiheadAttention, None)
    elif how == "non_traceable":
        spec["prepare_custom_config"] = PrepareCustomConfig().set_non_traceable_module_names(["attn"])
    else:  # torch.ao's own custom-module route: the module reaches it whole and comes out as its observed class
        spec["prepare_custom_config"] = PrepareCustomConfig().set_float_to_observed_mapping(
            nn.MultiheadAttention, nnqa.MultiheadAttention)
    prepared = _prepare(RowAttention(), **spec)
    expected = nnqa.MultiheadAttention if how == "custom_module" else nn.MultiheadAttention
    assert type(prepared.get_submodule("attn")) is expected


@pytest.mark.parametrize("by", ["name", "class"])
def test_a_standalone_module_config_keeps_the_module_whole(by):
    # torch.ao then traces nn.MultiheadAttention's own forward as a standalone graph, which fails on its control
    # flow: the error is torch.ao's, and the model is handed back unsplit
    from torch.ao.quantization.fx.custom_config import PrepareCustomConfig

    example = (torch.randn(2, 8, 48),) * 3
    config = (PrepareCustomConfig().set_standalone_module_name("attn", None, example, None, None) if by == "name"
              else PrepareCustomConfig().set_standalone_module_class(nn.MultiheadAttention, None, example, None, None))
    net = RowAttention()
    with pytest.raises(TraceError, match="control flow"):
        _prepare(net, prepare_custom_config=config)
    assert type(net.attn) is nn.MultiheadAttention


def test_a_failed_prepare_gives_the_model_back_as_it_was():
    class Untraceable(RowAttention):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # data-dependent control flow: FX cannot trace it
                x = x * 2
            return super().forward(x)

    net = Untraceable()
    with pytest.raises(TraceError):
        _prepare(net)
    assert type(net.attn) is nn.MultiheadAttention
    assert not any(isinstance(m, (AttentionCore, ProjectedMultiheadAttention)) for m in net.modules())


def test_the_attention_core_is_one_untraced_call():
    prepared = _prepare(RowAttention())
    calls = [n for n in prepared.graph.nodes if n.op == "call_module" and n.target == "attn.attention"]
    assert len(calls) == 1 and isinstance(prepared.get_submodule("attn.attention"), AttentionCore)


def test_post_training_static_quantization_quantizes_the_split_too():
    """prepare_fx (PTQ) goes through the same split: calibrated on digits, the int8 projections stay close to float."""
    from qlightning.core.metrics import sqnr_db

    torch.manual_seed(0)
    dm = DigitsDataModule(seed=0)
    dm.setup()
    x = dm.splits["train"].tensors[0][:256]
    net = RowAttention().eval()
    engine, spec = get_engine("fx"), QuantSpec(backend="x86", is_qat=False)
    observed = engine.prepare(copy.deepcopy(net), Inputs((x[:32],)), spec)
    with torch.no_grad():
        for i in range(0, 256, 64):
            observed(x[i:i + 64])
    int8 = engine.convert(observed, spec)
    assert all(type(int8.get_submodule(f"attn.{name}")).__module__.startswith("torch.ao.nn.quantized") for name in PROJECTIONS)
    with torch.no_grad():
        assert sqnr_db(net(x), int8(x)) >= 25


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None, reason="torchvision is not installed beside this torch")
def test_torchvision_vision_transformer_attention_projections_come_out_int8():
    """torchvision's VisionTransformer (its EncoderBlock calls nn.MultiheadAttention with need_weights=False): the
    converted model's attention projections are int8 Linears, and the prepared model computes what the float one
    does with fake-quant off."""
    from torchvision.models.vision_transformer import VisionTransformer

    from qlightning import Phase

    torch.manual_seed(0)
    net = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=64, mlp_dim=128,
                            num_classes=10)
    x = torch.randn(8, 3, 32, 32)
    with torch.no_grad():
        expected = net.eval()(x)
    engine, spec = get_engine("fx"), QuantSpec(backend="x86")
    prepared = engine.prepare(copy.deepcopy(net), Inputs((x[:2],)), spec)
    engine.set_phase(prepared, Phase(fake_quant=False, observe=True, bn_frozen=False))
    with torch.no_grad():
        torch.testing.assert_close(prepared.eval()(x), expected, atol=1e-5, rtol=1e-4)
        prepared.train()(x)
    engine.set_phase(prepared, Phase(fake_quant=True, observe=False, bn_frozen=True))
    int8 = engine.convert(prepared, spec)
    for layer in ("encoder_layer_0", "encoder_layer_1"):
        attention = int8.get_submodule(f"encoder.layers.{layer}.self_attention")
        assert all(type(getattr(attention, name)).__module__.startswith("torch.ao.nn.quantized") for name in PROJECTIONS)
    with torch.no_grad():
        assert int8(x).shape == (8, 10)
