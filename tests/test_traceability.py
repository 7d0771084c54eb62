"""Models that FX cannot trace end to end, quantized through `Trainer.fit` by the four routes of the guide.

1.a quantize only what traces (nested names, glob patterns), 1.b skip what does not (it runs in
float between dequantize and quantize), 2.a refactor, 2.b custom modules (user-defined static,
dynamic and weight-only pairs); plus standalone modules, input/output quantized indexes and
submodules called with several tensors and keyword arguments.
"""

from __future__ import annotations

import ast
import lightning.pytorch as pl
import pytest
import torch
import torch.ao.nn.quantized as nnq
from torch import nn

from conftest import make_trainer, test_accuracy
from qlightning import QuantizationAwareTraining, TraceError
from qlightning.examples import DigitsClassifier, DigitsDataModule
from qlightning.examples.custom_modules import (
    ELMAN_DYNAMIC,
    ELMAN_STATIC,
    ELMAN_WEIGHT_ONLY,
    AttentionOutput,
    DynamicQuantElmanRNN,
    FeedForwardOutput,
    HybridClassifier,
    HybridNet,
    IterativeRefine,
    RefineDigitsNet,
    RowRNNClassifier,
    SelfAttention,
    StaticQuantElmanRNN,
    WeightOnlyQuantElmanRNN,
)

SHORT = dict(fake_quant_start={"epoch": 1}, observer_freeze={"epoch": 2}, bn_freeze={"epoch": 2})

def _through_clamps(node):
    """The node behind the FX engine's clamps to the trained activation range (quantized::clamp)."""
    while node.meta.get("qlightning_activation_clamp") and node.args:
        node = node.args[0]
    return node



@pytest.fixture(autouse=True)
def seeded():
    """Models are built before `fit` seeds: seed first, so no test depends on the ones before it."""
    pl.seed_everything(0, verbose=False)


def fit(model, qat, dm, epochs: int = 3, batches: int = 10, extra=()) -> pl.Trainer:
    pl.seed_everything(0)
    trainer = make_trainer([qat, *extra], max_epochs=epochs, limit_train_batches=batches, limit_val_batches=2)
    trainer.fit(model, datamodule=dm)
    return trainer


def agreement(a: nn.Module, b: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        return (a(x).argmax(1) == b(x).argmax(1)).float().mean().item()


def assert_int8_keeps_fake_quant_accuracy(int8: nn.Module, fake_quant: nn.Module, dm, floor: float) -> None:
    """A few QAT steps leave small logit margins, so compare accuracies rather than per-image agreement.

    (Also: x86's default activation fake-quant clamps to [0, 127] (reduce_range) while the int8
    tensors hold [0, 255], so values beyond the observed range differ between the two.)
    """
    int8_acc, fq_acc = test_accuracy(int8, dm), test_accuracy(fake_quant, dm)
    assert int8_acc >= fq_acc - 0.05, (int8_acc, fq_acc)
    assert int8_acc > floor, int8_acc


def quantized_ops(module: nn.Module) -> int:
    """int8 kernels in a converted GraphModule: quantized modules plus quantized::* calls."""
    mods = sum(type(m).__module__.startswith("torch.ao.nn.quantized") or type(m).__module__.startswith("torch.ao.nn.intrinsic.quantized")
               for m in module.modules())
    calls = sum(1 for n in getattr(module, "graph", torch.fx.Graph()).nodes
                if n.op == "call_function" and "quantized" in str(n.target))
    return mods + calls


# ----------------------------------------------------------------------------- 1.a


def test_route_1a_nested_names_and_globs_each_prepared_and_converted_on_their_own():
    dm = DigitsDataModule(seed=0)
    model = HybridClassifier()
    qat = QuantizationAwareTraining(
        modules=["net.backbone.layer3", "net.encoder.layer.0.intermediate", "net.encoder.layer.*.output"], **SHORT
    )
    fit(model, qat, dm)
    # fnmatch's `*` crosses dots: `layer.*.output` also matches the attention outputs
    assert qat.targets == [
        "net.backbone.layer3",
        "net.encoder.layer.0.intermediate",
        "net.encoder.layer.0.attention.output",
        "net.encoder.layer.0.output",
        "net.encoder.layer.1.attention.output",
        "net.encoder.layer.1.output",
    ]
    for name in qat.targets:
        converted = model.get_submodule(name)
        assert isinstance(converted, torch.fx.GraphModule), name
        assert quantized_ops(converted) >= 1, name
    # the parents that do not trace run unchanged around the int8 blocks
    assert type(model.net) is HybridNet
    attention = model.net.encoder.layer[0].attention
    assert type(attention.self) is SelfAttention and type(attention.self.query) is nn.Linear
    assert type(model.net.backbone.layer1[0]) is nn.Conv2d
    assert_int8_keeps_fake_quant_accuracy(model.net, _with(model, qat), dm, 0.5)


def _with(model, qat):
    """The model's net with every converted block replaced by its fake-quant copy."""
    import copy

    from qlightning.core.session import set_submodule as _set_submodule

    twin = copy.deepcopy(model)
    for name, module in qat.fake_quant_modules.items():
        _set_submodule(twin, name, module)
    return twin.net


def test_route_1a_blocks_called_with_two_tensors_and_keyword_arguments():
    """AttentionOutput is called as output(context, residual=hidden): both inputs are captured and traced."""
    model = HybridClassifier()
    qat = QuantizationAwareTraining(modules=["net.encoder.layer.0.attention.output", "net.encoder.layer.0.output"])
    qat.prepare(model)
    inputs = qat.inputs["net.encoder.layer.0.attention.output"]
    assert len(inputs.args) == 1 and set(inputs.kwargs) == {"residual"}
    assert isinstance(model.net.encoder.layer[0].attention.output, torch.fx.GraphModule)
    assert [n.name for n in model.net.encoder.layer[0].output.graph.nodes if n.op == "placeholder"] == ["x", "residual"]
    with torch.no_grad():
        model(torch.rand(4, 1, 8, 8))


def test_a_module_that_does_not_trace_fails_with_the_routes_named():
    with pytest.raises(TraceError, match="non_traceable_module_names.*qlightning doctor") as info:
        QuantizationAwareTraining(modules=["net.encoder"]).prepare(HybridClassifier())
    # where tracing stops and the modules list that works (the doctor's route 1.a), not only "run the doctor"
    text = str(info.value)
    assert "FX stops in net.encoder.layer.0.attention.self (SelfAttention): *args unpacking" in text, text
    assert "custom_modules.py:" in text  # the line that breaks
    routed = text.split("(route 1.a): modules=")[1].rstrip(".")
    modules = ast.literal_eval(routed)  # the list the message prints
    assert "net.encoder.layer.*.attention.self.query" in modules and "net.encoder.layer.*.intermediate" in modules
    model = HybridClassifier()
    QuantizationAwareTraining(modules=modules).prepare(model)  # the route it names prepares
    assert isinstance(model.net.encoder.layer[0].intermediate, torch.fx.GraphModule)


# ----------------------------------------------------------------------------- 1.b


def test_route_1b_non_traceable_submodule_runs_in_float_inside_the_int8_graph():
    dm = DigitsDataModule(seed=0)
    model = RefineDigitsNet()
    qat = QuantizationAwareTraining(modules=["net"], prepare_custom_config={"non_traceable_module_names": ["refine"]},
                                    **SHORT)
    fit(model, qat, dm)
    net = model.net
    assert isinstance(net, torch.fx.GraphModule)
    assert type(net.refine) is IterativeRefine and type(net.refine.step) is nn.Conv2d  # float, untouched
    (call,) = [n for n in net.graph.nodes if n.op == "call_module" and n.target == "refine"]
    # int8 stem -> dequantize -> float refine -> quantize -> int8 features
    assert call.args[0].target == "dequantize"
    assert all(u.target == torch.quantize_per_tensor for u in call.users)
    assert quantized_ops(net) >= 4
    assert_int8_keeps_fake_quant_accuracy(net, qat.fake_quant_modules["net"], dm, 0.5)


def test_route_1b_by_class_marks_every_instance_as_a_leaf():
    model = RefineDigitsNet()
    qat = QuantizationAwareTraining(
        modules=["net"],
        prepare_custom_config={"non_traceable_module_classes": ["qlightning.examples.custom_modules.IterativeRefine"]},
    )
    qat.prepare(model)
    assert any(n.op == "call_module" and n.target == "refine" for n in model.net.graph.nodes)
    qat.engine.set_observers(model.net, True)
    with torch.no_grad():
        model(torch.rand(8, 1, 8, 8))
    qat.convert(model)
    assert type(model.net.refine) is IterativeRefine


# ----------------------------------------------------------------------------- 2.a


def test_route_2a_refactored_attention_lets_the_whole_encoder_be_quantized():
    dm = DigitsDataModule(seed=0)
    model = HybridClassifier(traceable_attention=True)
    # int8 Linears (LayerNorm, softmax and the residual adds stay float), as for MiniLM
    linear_only = {"global": None, "object_type": [{"type": "torch.nn.Linear", "qconfig": "default"}]}
    qat = QuantizationAwareTraining(modules=["net.encoder", "net.head"], qconfig_mapping=linear_only, **SHORT)
    fit(model, qat, dm)
    encoder = model.net.encoder
    assert isinstance(encoder, torch.fx.GraphModule)
    linears = [m for m in encoder.modules() if isinstance(m, nnq.Linear)]
    assert len(linears) == 2 * 6  # q, k, v, attention dense, intermediate, output per layer
    assert not any(isinstance(m, nn.Linear) for m in encoder.modules())
    assert_int8_keeps_fake_quant_accuracy(model.net, _with(model, qat), dm, 0.5)


# ----------------------------------------------------------------------------- 2.b


def test_route_2b_user_defined_custom_module_static():
    dm = DigitsDataModule(seed=0, as_sequence=True)
    model = RowRNNClassifier()
    # a user-written int8 RNN that its fake-quant twin only approximates: the fit-end gate warns (18.6 dB)
    qat = QuantizationAwareTraining(modules=["net"], **SHORT, **ELMAN_STATIC, fidelity={"on_breach": "warn"})
    with pytest.warns(UserWarning, match="departs from the fake-quant model"):
        fit(model, qat, dm)
    rnn = model.net.rnn
    assert type(rnn) is StaticQuantElmanRNN
    assert isinstance(rnn.ih, nnq.Linear) and isinstance(rnn.hh, nnq.Linear)
    # the custom module takes the int8 embedding's output and returns int8 states
    (call,) = [n for n in model.net.graph.nodes if n.op == "call_module" and n.target == "rnn"]
    assert _through_clamps(call.args[0]).target == torch.quantize_per_tensor
    with torch.no_grad():
        assert model.net.rnn(torch.quantize_per_tensor(torch.rand(2, 8, 48), 0.01, 0, torch.quint8)).is_quantized
    assert_int8_keeps_fake_quant_accuracy(model.net, qat.fake_quant_modules["net"], dm, 0.4)


@pytest.mark.parametrize("kind", ["dynamic", "weight_only"])
def test_route_2b_custom_module_dynamic_and_weight_only(kind):
    dm = DigitsDataModule(seed=0, as_sequence=True)
    model = RowRNNClassifier()
    config = {"dynamic": ELMAN_DYNAMIC, "weight_only": ELMAN_WEIGHT_ONLY}[kind]
    qat = QuantizationAwareTraining(modules=["net"], **SHORT, **config, fidelity={"on_breach": "warn"})
    fit(model, qat, dm, epochs=3)  # SHORT freezes at epoch 2
    rnn = model.net.rnn
    if kind == "dynamic":
        assert type(rnn) is DynamicQuantElmanRNN
        assert type(rnn.ih).__module__.startswith("torch.ao.nn.quantized.dynamic")
    else:
        assert type(rnn) is WeightOnlyQuantElmanRNN and rnn.ih.qweight.dtype == torch.qint8
    # float in and out: no quantize/dequantize around the custom module
    (call,) = [n for n in model.net.graph.nodes if n.op == "call_module" and n.target == "rnn"]
    assert _through_clamps(call.args[0]).target != torch.quantize_per_tensor
    assert_int8_keeps_fake_quant_accuracy(model.net, qat.fake_quant_modules["net"], dm, 0.3)


# ----------------------------------------------------------------------------- standalone, quantized indexes


def test_standalone_module_is_prepared_with_its_own_captured_inputs():
    dm = DigitsDataModule(seed=0)
    model = DigitsClassifier()
    qat = QuantizationAwareTraining(modules=["net"], prepare_custom_config={"standalone_module_names": ["features"]},
                                    **SHORT)
    fit(model, qat, dm)
    features = model.net.features
    assert isinstance(features, torch.fx.GraphModule) and features is not model.net
    assert quantized_ops(features) >= 3
    assert_int8_keeps_fake_quant_accuracy(model.net, qat.fake_quant_modules["net"], dm, 0.3)


def test_input_and_output_quantized_indexes_make_the_int8_module_take_and_return_int8():
    dm = DigitsDataModule(seed=0)
    model = DigitsClassifier()
    qat = QuantizationAwareTraining(
        modules=["net"], prepare_custom_config={"input_quantized_indexes": [0], "output_quantized_indexes": [0]}, **SHORT
    )
    fit(model, qat, dm)
    net = model.net
    assert not any(n.target == torch.quantize_per_tensor for n in net.graph.nodes)  # no quantize at the input
    x, _ = dm.splits["test"].tensors
    qx = torch.quantize_per_tensor(x, 1.0 / 255, 0, torch.quint8)
    with torch.no_grad():
        out = net(qx)
    assert out.is_quantized
    labels = dm.splits["test"].tensors[1]
    assert (out.dequantize().argmax(1) == labels).float().mean() > 0.3


def test_two_callbacks_chain_int8_blocks_without_a_dequantize_between():
    dm = DigitsDataModule(seed=0)
    model = DigitsClassifier()
    body = QuantizationAwareTraining(modules=["net.features"], prepare_custom_config={"output_quantized_indexes": [0]},
                                     **SHORT)
    head = QuantizationAwareTraining(modules=["net.classifier"], prepare_custom_config={"input_quantized_indexes": [0]},
                                     **SHORT)
    fit(model, body, dm, extra=[head])
    assert not any(n.target == "dequantize" for n in model.net.features.graph.nodes)
    assert not any(n.target == torch.quantize_per_tensor for n in model.net.classifier.graph.nodes)
    with torch.no_grad():
        assert model.net.features(torch.rand(2, 1, 8, 8)).is_quantized  # int8 straight into the int8 head
    fake_quant = _with(model, body)
    fake_quant.classifier = head.fake_quant_modules["net.classifier"]
    assert_int8_keeps_fake_quant_accuracy(model.net, fake_quant, dm, 0.3)
