"""PostTrainingQuantization and ptq_baseline, trained for real on digits."""

from __future__ import annotations

import copy
import inspect

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from conftest import make_trainer, test_accuracy
from qlightning import ConfigError, Phase, QuantizationAwareTraining, QuantSpec
from qlightning.callbacks.ptq import (
    PostTrainingQuantization,
    collect_inputs,
    float_module_from,
    ptq_baseline,
    run_to_targets,
)
from qlightning.errors import FidelityError
from qlightning.examples import DigitsClassifier, DigitsDataModule
from qlightning.examples.digits import ClassifierModule
from qlightning.engines.fx.qconfigs import ptq_qconfig_mapping


def int8_layers(net: nn.Module) -> dict[str, int]:
    import torch.ao.nn.intrinsic.quantized as nniq
    import torch.ao.nn.quantized as nnq

    return {
        "conv_relu": sum(isinstance(m, nniq.ConvReLU2d) for m in net.modules()),
        "linear": sum(isinstance(m, nnq.Linear) for m in net.modules()),
    }


@pytest.fixture(scope="module")
def ptq_fit(tmp_path_factory):
    """Float training (6 epochs) with the PTQ callback attached: calibrate + convert at fit end."""
    pl.seed_everything(0)
    dm = DigitsDataModule(seed=0)
    model = DigitsClassifier()
    ptq = PostTrainingQuantization(modules=["net"], backend="x86", num_calibration_batches=8)
    ckpt = ModelCheckpoint(dirpath=tmp_path_factory.mktemp("ckpt"), save_last=True)
    trainer = make_trainer([ptq, ckpt], max_epochs=6, enable_checkpointing=True)
    trainer.fit(model, datamodule=dm)
    return trainer, model, dm, ptq, ckpt.last_model_path


def test_fit_trains_in_float_then_calibrates_and_converts_at_fit_end(ptq_fit):
    trainer, model, dm, ptq, _ = ptq_fit
    assert ptq.converted and ptq.targets == ["net"]
    assert ptq.num_calibrated == 8
    assert int8_layers(model.net) == {"conv_relu": 3, "linear": 1}
    float_acc = test_accuracy(ptq.float_modules["net"], dm)
    int8_acc = trainer.test(model, datamodule=dm, verbose=False)[0]["test/accuracy"]
    assert float_acc > 0.95
    assert int8_acc >= float_acc - 0.01, (int8_acc, float_acc)


def test_the_gate_compares_int8_with_the_float_model_on_calibration_batches(ptq_fit):
    """PTQ had no gate (issue 14): now the int8 model as it runs is compared with the float submodule."""
    *_, ptq, _ = ptq_fit
    result = ptq.fidelity_results["net"]
    assert result["passed"] and result["against"] == "float" and result["inputs"] == "4 train calibration batches"
    assert result["sqnr_db"] >= 25 and result["top1_agreement"] >= 0.98  # 34 dB measured (FX), 38 dB (PT2E)


def _ptq_on_trained(fidelity, engine="fx"):
    pl.seed_everything(0)
    model, dm = DigitsClassifier(), DigitsDataModule(seed=0)
    make_trainer([], max_epochs=2).fit(model, datamodule=dm)
    float_net = copy.deepcopy(model.net).eval()
    ptq = PostTrainingQuantization(modules=["net"], engine=engine, num_calibration_batches=4, fidelity=fidelity)
    return model, dm, ptq, float_net


def test_a_ptq_model_that_departs_fails_naming_the_module_before_evaluating():
    model, dm, ptq, _ = _ptq_on_trained({"min_sqnr_db": 150.0})  # no real int8 model reaches 150 dB
    with pytest.raises(FidelityError) as info:
        make_trainer([ptq]).validate(model, datamodule=dm, verbose=False)
    text = str(info.value)
    assert "PostTrainingQuantization: the int8 model departs from the float model it was calibrated from" in text
    assert "net: int8 vs float" in text and "< 150 dB" in text and "'fallback' keeps the float module" in text


@pytest.mark.parametrize("engine", ["fx", "pt2e"])
def test_ptq_on_breach_fallback_keeps_the_float_module_and_says_so(engine):
    model, dm, ptq, float_net = _ptq_on_trained({"min_sqnr_db": 150.0, "on_breach": "fallback"}, engine)
    with pytest.warns(UserWarning, match="departs from the float model"):
        make_trainer([ptq]).validate(model, datamodule=dm, verbose=False)
    assert ptq.fidelity_results["net"]["action"] == "fell back to the float module"
    x, _ = dm.splits["test"].tensors
    with torch.no_grad():
        assert torch.allclose(model.net(x), float_net(x), atol=1e-4)  # the float net (FX folds BN: float rounding)


def test_checkpoints_written_during_fit_hold_float_weights(ptq_fit):
    *_, last = ptq_fit
    state = torch.load(last, weights_only=True)["state_dict"]
    assert state["net.features.0.0.weight"].dtype == torch.float32
    assert not any("activation_post_process" in k for k in state)


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_validate_with_ckpt_path_loads_float_weights_then_calibrates_on_val(ptq_fit):
    _, _, dm, _, last = ptq_fit
    model = DigitsClassifier()  # untrained: the checkpoint's weights must be loaded before calibration
    ptq = PostTrainingQuantization(calibrate_on="val", num_calibration_batches=2)
    result = make_trainer([ptq]).validate(model, datamodule=dm, ckpt_path=last, verbose=False)[0]
    assert ptq.converted and ptq.num_calibrated == 2
    assert int8_layers(model.net) == {"conv_relu": 3, "linear": 1}
    # the metrics validate reports are the int8 model's
    dm.setup()
    x, y = dm.splits["val"].tensors
    with torch.no_grad():
        int8_val = (model.net(x).argmax(1) == y).float().mean().item()
    assert result["val/accuracy"] == pytest.approx(int8_val, abs=1e-6)
    assert int8_val > 0.95


def test_test_stage_quantizes_once_and_later_stages_reuse_it(ptq_fit):
    _, fitted, dm, ptq_fitted, _ = ptq_fit
    model = DigitsClassifier()
    model.net = copy.deepcopy(ptq_fitted.float_modules["net"])
    ptq = PostTrainingQuantization(num_calibration_batches=4)
    trainer = make_trainer([ptq])
    first = trainer.test(model, datamodule=dm, verbose=False)[0]["test/accuracy"]
    net = model.net
    second = trainer.test(model, datamodule=dm, verbose=False)[0]["test/accuracy"]
    assert model.net is net and first == second and ptq.num_calibrated == 4


def test_calibration_runs_steps_only_up_to_the_quantized_modules():
    class Probe(ClassifierModule):
        after_forward = 0

        def training_step(self, batch, batch_idx):
            logits = self(batch[0])
            Probe.after_forward += 1  # loss, metrics and self.log would come here
            return logits.sum()

    model = Probe(nn.Sequential(nn.Flatten(), nn.Linear(64, 10)))
    seen = []
    ran = run_to_targets(model, ["net"], lambda: model.training_step((torch.rand(4, 1, 8, 8), None), 0),
                         on_input=lambda name, inp: seen.append(inp.args[0].shape))
    assert ran == ["net"] and Probe.after_forward == 0 and seen == [torch.Size([4, 1, 8, 8])]
    assert model.training  # modes restored
    assert not model.net._forward_hooks and not model.net._forward_pre_hooks


def test_bad_arguments_are_reported_together():
    with pytest.raises(ConfigError) as info:
        PostTrainingQuantization(
            modules=[], backend="arm", mode="sparse", calibrate_on="test", num_calibration_batches=0,
            cross_layer_equalization="maybe", equalization=3, example_inputs=[1],
        )
    text = str(info.value)
    for key in ("modules=", "backend=", "mode=", "calibrate_on=", "num_calibration_batches=",
                "cross_layer_equalization=", "equalization=", "example_inputs"):
        assert key in text, key
    assert len(info.value.problems) == 8


def test_dynamic_mode_rejects_static_only_options():
    with pytest.raises(ConfigError) as info:
        PostTrainingQuantization(mode="dynamic", equalization="all", cross_layer_equalization=True)
    assert len(info.value.problems) == 2


def test_qat_and_ptq_on_the_same_module_is_an_error():
    model, dm = DigitsClassifier(), DigitsDataModule()
    trainer = make_trainer([QuantizationAwareTraining(modules=["net"]), PostTrainingQuantization(modules=["net.features"])], max_epochs=1)
    with pytest.raises(ConfigError, match="also quantized by QuantizationAwareTraining"):
        trainer.fit(model, datamodule=dm)


class RowLSTM(nn.Module):
    """Digits as 8 rows of 8 pixels -> LSTM -> Linear; ``branchy`` adds data-dependent control flow."""

    def __init__(self, branchy: bool = False) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 32, batch_first=True)
        self.head = nn.Linear(32, 10)
        self.branchy = branchy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        if self.branchy and bool(x.sum() > 0):  # FX cannot trace this
            out = out * 1.0
        return self.head(out[:, -1])


@pytest.fixture(scope="module")
def float_lstm():
    pl.seed_everything(0)
    dm = DigitsDataModule(as_sequence=True)
    model = ClassifierModule(RowLSTM())
    make_trainer([], max_epochs=3).fit(model, datamodule=dm)
    return model.net, dm


@pytest.mark.parametrize("branchy", [False, True], ids=["fx", "eager-fallback"])
@pytest.mark.parametrize("mode", ["dynamic", "weight_only"])
def test_dynamic_and_weight_only_quantize_lstm_and_linear(float_lstm, mode, branchy):
    import torch.ao.nn.quantized.dynamic as nnqd

    trained, dm = float_lstm
    model = ClassifierModule(RowLSTM(branchy))
    model.net.load_state_dict(trained.state_dict())
    model.example_input_array = torch.zeros(1, 8, 8)
    ptq = PostTrainingQuantization(mode=mode)
    make_trainer([ptq]).test(model, datamodule=dm, verbose=False)  # quantizes at test start
    assert ptq.details["net"]["path"] == ("eager" if branchy else "fx")
    assert isinstance(model.net.lstm, nnqd.LSTM) and isinstance(model.net.head, nnqd.Linear)
    expected = torch.qint8 if mode == "dynamic" else torch.float16
    assert model.net.head._packed_params.dtype == expected and model.net.lstm.dtype == expected
    x, _ = dm.splits["test"].tensors
    with torch.no_grad():
        agree = (model.net(x).argmax(1) == trained(x).argmax(1)).float().mean().item()
    assert agree >= 0.97


def test_ptq_baseline_quantizes_a_copy_and_matches_the_callback(ptq_fit):
    _, model, dm, ptq, _ = ptq_fit
    float_net = ptq.float_modules["net"]
    before = copy.deepcopy(float_net.state_dict())
    dm.setup()
    batches = [x for x, _ in list(dm.train_dataloader())[:8]]
    int8 = ptq_baseline(float_net, batches, QuantSpec(backend="x86", is_qat=True))  # a QAT spec: PTQ default
    assert int8_layers(int8) == {"conv_relu": 3, "linear": 1}
    assert all(torch.equal(before[k], v) for k, v in float_net.state_dict().items())
    assert abs(test_accuracy(int8, dm) - test_accuracy(float_net, dm)) <= 0.01


def test_ptq_counterpart_of_the_default_qat_mapping_uses_observers():
    from torch.ao.quantization import FakeQuantizeBase, get_default_qat_qconfig_mapping

    mapping = ptq_qconfig_mapping(get_default_qat_qconfig_mapping("x86"))
    observers = [mapping.global_qconfig.activation(), mapping.global_qconfig.weight()]
    assert not any(isinstance(o, FakeQuantizeBase) for o in observers)
    assert type(observers[1]).__name__ == "PerChannelMinMaxObserver"
    assert (observers[0].quant_min, observers[0].quant_max) == (0, 127)  # reduce_range kept


def test_collected_inputs_follow_the_submodule_and_leave_the_model_alone(ptq_fit):
    _, _, dm, ptq, _ = ptq_fit
    model = DigitsClassifier()
    model.net = copy.deepcopy(ptq.float_modules["net"]).train()
    dm.setup()
    batches = list(dm.train_dataloader())[:3]
    rng = torch.get_rng_state()
    bn_mean = model.net.features[0][1].running_mean.clone()
    inputs = collect_inputs(model, ["net", "net.classifier"], batches, "train")
    assert [len(v) for v in inputs.values()] == [3, 3]
    assert inputs["net.classifier"][0].args[0].shape == (64, 64)
    assert torch.equal(torch.get_rng_state(), rng) and model.net.training
    assert torch.equal(model.net.features[0][1].running_mean, bn_mean)  # eval mode: BN statistics untouched


def test_float_module_rebuilt_from_a_qat_run_follows_training_and_snapshots():
    """The QAT wiring keeps a reference to the float net: prepare_qat_fx keeps its Parameters."""
    pl.seed_everything(0)
    dm = DigitsDataModule(seed=0)
    model = DigitsClassifier()
    float_ref = model.net
    qat = QuantizationAwareTraining(fake_quant_start={"epoch": 1}, convert_on_fit_end=False)
    make_trainer([qat], max_epochs=2).fit(model, datamodule=dm)
    dm.setup()
    x, _ = dm.splits["test"].tensors

    def fp32_of(prepared: nn.Module) -> torch.Tensor:
        fp32 = copy.deepcopy(prepared)
        qat.engine.set_phase(fp32, Phase(fake_quant=False, observe=False, bn_frozen=True))
        with torch.no_grad():
            return fp32.eval()(x)

    expected = fp32_of(model.net)
    with torch.no_grad():
        torch.testing.assert_close(float_module_from(float_ref, model.net)(x), expected, rtol=1e-4, atol=1e-4)
    # from a state dict saved earlier (as the QAT callback's float_snapshot), after the weights moved on
    state = {k: v.clone() for k, v in model.net.state_dict().items()}
    with torch.no_grad():
        for p in model.net.parameters():
            p.add_(0.05)
        for m in model.net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_var.mul_(2)
        torch.testing.assert_close(float_module_from(float_ref, model.net, state)(x), expected, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(float_module_from(float_ref, model.net)(x), expected, atol=1e-2)


@pytest.mark.skipif(
    "ptq_baseline" not in inspect.signature(QuantizationAwareTraining).parameters,
    reason="QuantizationAwareTraining(ptq_baseline=...) not wired in yet",
)
def test_qat_run_keeps_a_ptq_baseline_made_when_fake_quant_starts():
    pl.seed_everything(0)
    dm = DigitsDataModule(seed=0)
    model = DigitsClassifier()
    qat = QuantizationAwareTraining(fake_quant_start={"epoch": 2}, observer_freeze={"epoch": 3}, bn_freeze={"epoch": 3},
                                    ptq_baseline=4)
    make_trainer([qat], max_epochs=4).fit(model, datamodule=dm)
    assert int8_layers(qat.ptq_modules["net"]) == {"conv_relu": 3, "linear": 1}
    assert test_accuracy(qat.ptq_modules["net"], dm) > 0.9


def test_collecting_inputs_stops_before_the_targets_run():
    """The fidelity gate's held batches and PTQ's cached calibration inputs need the targets' inputs only: the
    step stops at the last target's input (a whole forward of the fake-quant model a batch saved at fit end),
    where calibration (``inputs_only=False``) still runs the targets for their observers."""

    class Counting(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner, self.calls = inner, 0

        def forward(self, x):
            self.calls += 1
            return self.inner(x)

    model = ClassifierModule(nn.Sequential(nn.Flatten(), Counting(nn.Linear(64, 32)), nn.ReLU(), Counting(nn.Linear(32, 10))))
    first, second = model.net[1], model.net[3]
    batches = [(torch.rand(4, 1, 8, 8), torch.zeros(4, dtype=torch.long)) for _ in range(3)]
    held = collect_inputs(model, ["net.1", "net.3"], batches, "val")
    assert [len(held[name]) for name in ("net.1", "net.3")] == [3, 3]
    assert first.calls == 3 and second.calls == 0  # the first target's output is the second's input
    for batch, inputs in zip(batches, held["net.3"]):
        assert torch.equal(inputs.args[0], model.net[2](model.net[1](model.net[0](batch[0]))))
    assert not second._forward_pre_hooks and not second._forward_hooks
    ran = run_to_targets(model, ["net.1", "net.3"], lambda: model.validation_step(batches[0], 0))
    assert ran == ["net.1", "net.3"] and second.calls == 1
