"""The QuantizationAwareTraining callback on both engines (FX and PT2E), trained for real on digits.

Tests that exercise engine-neutral behaviour are parametrised over ``engine``; the PT2E variants of
FX-only features are skipped with the reason.
"""

from __future__ import annotations

import copy
import importlib.util
import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from conftest import DEFAULT_SCHEDULE, make_trainer, test_accuracy
from qlightning import ConfigError, Phase, QLightningError, QuantizationAwareTraining
from qlightning.examples import DigitsClassifier, DigitsDataModule
from qlightning.examples.digits import ClassifierModule, DigitsCNN


NO_TORCHAO = importlib.util.find_spec("torchao") is None
ENGINES = ["fx", pytest.param("pt2e", marks=pytest.mark.skipif(NO_TORCHAO, reason="the pt2e engine needs torchao"))]


def fx_only(reason: str) -> list:
    return ["fx", pytest.param("pt2e", marks=pytest.mark.skip(reason=reason))]


def is_int8(module: nn.Module) -> bool:
    """The converted model of either engine: FX's quantized modules, or a PT2E graph whose weights are int8."""
    if any(type(m).__module__.startswith("torch.ao.nn.quantized") for m in module.modules()):
        return True
    matrices = [v for v in module.state_dict().values() if v.dim() >= 2]
    fake_quant = any(hasattr(m, "fake_quant_enabled") for m in module.modules())
    return bool(matrices) and all(v.dtype == torch.int8 for v in matrices) and not fake_quant


@pytest.fixture(scope="module", params=ENGINES)
def trained(request):
    """One full default-schedule QAT run (8 epochs) per engine, shared by the tests that only read its result."""
    if request.param == "fx":
        return request.getfixturevalue("trained_qat")
    pl.seed_everything(0)
    dm = DigitsDataModule(seed=0)
    model = DigitsClassifier()
    qat = QuantizationAwareTraining(modules=["net"], backend="x86", engine=request.param, **DEFAULT_SCHEDULE)
    trainer = make_trainer([qat])
    trainer.fit(model, datamodule=dm)
    return trainer, model, dm, qat


def quant_buffers(qat: QuantizationAwareTraining, model: pl.LightningModule) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{key}": value.clone()
        for name in qat.targets
        for key, value in qat.engine.quant_state(model.get_submodule(name))
    }


def assert_equal(x, y, key: str) -> None:
    if isinstance(x, torch.Tensor):
        if x.is_quantized:
            assert torch.equal(x.int_repr(), y.int_repr()), key
            assert torch.equal(x.dequantize(), y.dequantize()), key
        else:
            assert torch.equal(x, y), key
    elif isinstance(x, (tuple, list)):
        assert len(x) == len(y), key
        for i, (u, v) in enumerate(zip(x, y)):
            assert_equal(u, v, f"{key}[{i}]")
    else:
        assert x == y, key


def assert_state_dicts_equal(a: dict, b: dict) -> None:
    """Tensor by tensor (int8 values and scales of quantized tensors included)."""
    assert a.keys() == b.keys()
    for key in a:
        assert_equal(a[key], b[key], key)


def test_int8_keeps_float_accuracy_and_agrees_with_fake_quant(trained):
    trainer, model, dm, qat = trained
    assert qat.converted
    int8_acc = trainer.test(model, datamodule=dm, verbose=False)[0]["test/accuracy"]
    fake = qat.fake_quant_modules["net"]
    fp32 = copy.deepcopy(fake)
    fp32.load_state_dict(qat.float_snapshot["net"])  # the float model QAT started from (end of warm-up)
    qat.engine.set_phase(fp32, Phase(fake_quant=False, observe=False, bn_frozen=True))
    fp32_acc = test_accuracy(fp32, dm)
    assert int8_acc >= fp32_acc - 0.005, (int8_acc, fp32_acc)
    assert int8_acc > 0.95
    x, _ = dm.splits["test"].tensors
    with torch.no_grad():
        agreement = (fake(x).argmax(1) == model.net(x).argmax(1)).float().mean().item()
    assert agreement >= 0.99


def test_submodule_is_replaced_by_a_lowered_int8_module(trained):
    _, model, _, qat = trained
    assert is_int8(model.net) and not qat.engine.is_prepared(model.net)
    if qat.engine.name == "fx":
        import torch.ao.nn.intrinsic.quantized as nniq
        import torch.ao.nn.quantized as nnq

        assert sum(isinstance(m, nniq.ConvReLU2d) for m in model.net.modules()) == 3
        assert sum(isinstance(m, nnq.Linear) for m in model.net.modules()) == 1
        assert not any(p.dtype.is_floating_point for p in model.net.parameters())
    else:  # a q/dq graph: int8 weights (3 convs, BatchNorm folded, and the classifier), every activation quantized
        weights = [v for v in model.net.state_dict().values() if v.dim() >= 2]
        assert sorted(tuple(w.shape) for w in weights) == [(10, 64), (16, 1, 3, 3), (32, 16, 3, 3), (64, 32, 3, 3)]
        targets = [n.target for n in model.net.graph.nodes if n.op == "call_function"]
        assert torch.ops.aten.batch_norm.default not in targets
        assert targets.count(torch.ops.quantized_decomposed.dequantize_per_channel.default) == 4


# pt2e: the mid-QAT resume point runs with the quick tests, the other two with the slow ones (each is two fits)
RESUME_CASES = [
    pytest.param(epoch, engine, id=f"{name}-{engine}", marks=marks)
    for epoch, name in [(1, "before-fake-quant"), (3, "fake-quant-observing"), (6, "after-freeze")]
    for engine, marks in [
        ("fx", ()),
        ("pt2e", [pytest.mark.skipif(NO_TORCHAO, reason="the pt2e engine needs torchao")] + ([] if epoch == 3 else [pytest.mark.slow])),
    ]
]


@pytest.mark.parametrize("resume_epoch, engine", RESUME_CASES)
def test_resume_from_checkpoint_gives_the_same_int8_model(tmp_path, resume_epoch, engine):
    def run(ckpt_path=None, save=False):
        pl.seed_everything(0)
        model = DigitsClassifier()
        qat = QuantizationAwareTraining(modules=["net"], engine=engine, **DEFAULT_SCHEDULE)
        callbacks = [qat]
        if save:
            callbacks.append(ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=-1, every_n_epochs=1))
        trainer = make_trainer(callbacks, enable_checkpointing=save)
        trainer.fit(model, datamodule=DigitsDataModule(seed=0), ckpt_path=ckpt_path)
        return model

    uninterrupted = run(save=True)
    ckpt = tmp_path / f"epoch={resume_epoch}.ckpt"
    # the checkpoint is plain data and its keys are exactly the prepared model's
    state = torch.load(ckpt, weights_only=True)
    resumed = run(ckpt_path=str(ckpt))  # Lightning loads strictly: missing/unexpected keys would raise
    assert state["callbacks"]
    assert_state_dicts_equal(uninterrupted.net.state_dict(), resumed.net.state_dict())


@pytest.mark.parametrize("engine", fx_only("a torch.ao QConfigMapping (learnable fake-quant) is FX-only; pt2e takes "
                                           "X86InductorQuantizer configs, which have no learnable variant"))
def test_learnable_qparams_are_optimized(engine):
    from torch.ao.quantization import MovingAverageMinMaxObserver, QConfig, QConfigMapping
    from torch.ao.quantization._learnable_fake_quantize import _LearnableFakeQuantize

    act = _LearnableFakeQuantize.with_args(
        observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255, dtype=torch.quint8,
        qscheme=torch.per_tensor_affine, scale=0.1, zero_point=0.0, use_grad_scaling=True,
    )
    weight = _LearnableFakeQuantize.with_args(
        observer=MovingAverageMinMaxObserver, quant_min=-128, quant_max=127, dtype=torch.qint8,
        qscheme=torch.per_tensor_symmetric, scale=0.1, zero_point=0.0, use_grad_scaling=True,
    )
    mapping = QConfigMapping().set_global(QConfig(activation=act, weight=weight))
    pl.seed_everything(0)
    model = DigitsClassifier()
    qat = QuantizationAwareTraining(
        modules=["net"], qconfig_mapping=mapping, fake_quant_start={"epoch": 1}, observer_freeze={"epoch": 2},
        convert_on_fit_end=False,
    )
    snapshots = {}

    class AtFreeze(pl.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch == 2:
                snapshots.update({n: p.detach().clone() for n, p in pl_module.net.named_parameters() if n.endswith("scale")})

    trainer = make_trainer([qat, AtFreeze()], max_epochs=4)
    trainer.fit(model, datamodule=DigitsDataModule(seed=0))
    scales = {n: p for n, p in model.net.named_parameters() if n.endswith("scale")}
    assert scales, "the learnable fake-quants should own scale parameters"
    optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert all(id(p) in optimized for p in scales.values())
    moved = [n for n, p in scales.items() if not torch.equal(p.detach(), snapshots[n])]
    assert len(moved) >= len(scales) // 2, f"only {moved} of {list(scales)} moved after the observers froze"


@pytest.mark.parametrize("engine", ENGINES)
def test_validate_test_and_predict_leave_observers_untouched(engine):
    pl.seed_everything(0)
    model, dm = DigitsClassifier(), DigitsDataModule(seed=0)
    qat = QuantizationAwareTraining(modules=["net"], engine=engine, fake_quant_start={"epoch": 1}, convert_on_fit_end=False)
    trainer = make_trainer([qat], max_epochs=2)
    trainer.fit(model, datamodule=dm)
    before = quant_buffers(qat, model)
    trainer.validate(model, datamodule=dm, verbose=False)
    trainer.test(model, datamodule=dm, verbose=False)
    trainer.predict(model, datamodule=dm)
    after = quant_buffers(qat, model)
    assert_state_dicts_equal(before, after)
    # fake-quant stays on for evaluation: validation measured quantized numerics
    assert all(bool(m.fake_quant_enabled[0]) for m in model.net.modules() if hasattr(m, "fake_quant_enabled"))


@pytest.mark.parametrize("engine", ENGINES)
def test_observe_stages_lets_validation_calibrate(engine):
    pl.seed_everything(0)
    model, dm = DigitsClassifier(), DigitsDataModule(seed=0)
    qat = QuantizationAwareTraining(modules=["net"], engine=engine, observe_stages=["train", "validate"], convert_on_fit_end=False)
    trainer = make_trainer([qat], max_epochs=1)
    trainer.fit(model, datamodule=dm)
    before = quant_buffers(qat, model)
    trainer.validate(model, datamodule=dm, verbose=False)
    after = quant_buffers(qat, model)
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_logged_phase_flags_follow_the_schedule_at_every_logged_step(tmp_path):
    """The ``qat/*`` phase flags are logged when they change and on the loggers' writing steps, not every
    step (a ``log`` call costs ~1 ms): every row the logger writes must still carry the phase of its step,
    across epoch boundaries, with the activation scales beside them."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    pl.seed_everything(0)
    model, dm = DigitsClassifier(), DigitsDataModule(seed=0)
    qat = QuantizationAwareTraining(modules=["net"], fake_quant_start={"step": 9}, observer_freeze={"step": 31},
                                    bn_freeze={"step": 44}, convert_on_fit_end=False)
    trainer = make_trainer([qat], max_epochs=3, logger=CSVLogger(tmp_path), log_every_n_steps=4)
    trainer.fit(model, datamodule=dm)
    rows = [r for r in csv.DictReader(open(tmp_path / "lightning_logs" / "version_0" / "metrics.csv")) if r.get("train/loss")]
    assert len(rows) >= 12, rows  # 20 batches an epoch: a row every 4th step
    for row in rows:
        step = int(row["step"])
        expected = qat.schedule.phase(step, int(row["epoch"]))
        logged = Phase(*(float(row[f"qat/{k}"]) == 1.0 for k in ("fake_quant", "observe", "bn_frozen")))
        assert logged == expected, (step, row)
        assert any(k.startswith("qat/scale/net.") and row[k] for k in row), (step, row)


class CountingClassifier(DigitsClassifier):
    steps = 0

    def training_step(self, batch, batch_idx):
        type(self).steps += 1
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("engine", ENGINES)
def test_unknown_submodule_fails_before_training_and_lists_choices(engine):
    CountingClassifier.steps = 0
    qat = QuantizationAwareTraining(modules=["nett", "net.features.9"], engine=engine)
    with pytest.raises(ConfigError) as err:
        make_trainer([qat], max_epochs=1).fit(CountingClassifier(), datamodule=DigitsDataModule())
    text = str(err.value)
    assert "no submodule 'nett'" in text and "closest: ['net'" in text and "top-level submodules: ['net', 'metrics']" in text
    assert "no submodule 'net.features.9'" in text  # both problems at once
    assert CountingClassifier.steps == 0


def test_bad_arguments_are_all_reported_at_construction():
    with pytest.raises(ConfigError) as err:
        QuantizationAwareTraining(
            modules=["net"], backend="tensorrt", engine="onnx", fake_quant_start={"epoch": 4},
            observer_freeze={"epoch": 2}, bn_freeze={"step": -1}, observe_stages=["training"],
        )
    text = str(err.value)
    for fragment in (
        "backend='tensorrt': unknown backend; valid choices: ['x86', 'fbgemm', 'qnnpack', 'onednn']",
        "engine='onnx': unknown engine; valid choices: ['fx', 'pt2e']",
        "observer_freeze (epoch 2) comes before schedule.fake_quant_start (epoch 4)",
        "schedule.bn_freeze.step=-1: must be >= 0",
        "observe_stages=['training']",
    ):
        assert fragment in text
    with pytest.raises(ConfigError, match="observer_freeze .step 0.: must be positive"):
        QuantizationAwareTraining(observer_freeze={"step": 0})


class LazyClassifier(ClassifierModule):
    """Builds its network in ``configure_model``, as large-model code does."""

    def __init__(self):
        super().__init__(nn.Identity())
        self.example_input_array = torch.zeros(1, 1, 8, 8)

    def configure_model(self):
        if isinstance(self.net, nn.Identity):
            self.net = DigitsCNN()


@pytest.mark.parametrize("engine", ENGINES)
def test_submodules_built_in_configure_model_are_prepared(engine):
    pl.seed_everything(0)
    model = LazyClassifier()
    qat = QuantizationAwareTraining(modules=["net"], engine=engine, fake_quant_start={"epoch": 2})
    trainer = make_trainer([qat], max_epochs=4)
    trainer.fit(model, datamodule=DigitsDataModule(seed=0))
    assert qat.converted and is_int8(model.net)
    assert trainer.test(model, datamodule=DigitsDataModule(seed=0), verbose=False)[0]["test/accuracy"] > 0.9


class NoExampleClassifier(DigitsClassifier):
    def __init__(self):
        super().__init__()
        self.example_input_array = None


@pytest.mark.parametrize("engine", ENGINES)
def test_example_inputs_come_from_a_training_batch_when_the_model_has_none(engine):
    qat = QuantizationAwareTraining(modules=["net.features", "net.classifier"], engine=engine, convert_on_fit_end=False)
    model = NoExampleClassifier()
    make_trainer([qat], max_epochs=1, limit_train_batches=2, limit_val_batches=1).fit(model, datamodule=DigitsDataModule())
    assert qat.inputs["net.features"].args[0].shape == (64, 1, 8, 8)
    assert qat.inputs["net.classifier"].args[0].shape == (64, 64)
    assert qat.engine.is_prepared(model.net.features) and qat.engine.is_prepared(model.net.classifier)


@pytest.mark.parametrize("engine", ENGINES)
def test_missing_example_inputs_is_a_clear_error(engine):
    qat = QuantizationAwareTraining(modules=["net"], engine=engine)
    model = NoExampleClassifier()
    with pytest.raises(ConfigError, match="could not find inputs for \\['net'\\]"):
        qat.prepare(model)  # no trainer, no example_input_array, nothing configured


@pytest.mark.parametrize("engine", ENGINES)
def test_fit_twice_without_converting_then_convert(engine):
    pl.seed_everything(0)
    model, dm = DigitsClassifier(), DigitsDataModule(seed=0)
    qat = QuantizationAwareTraining(modules=["net"], engine=engine, fake_quant_start={"epoch": 0}, convert_on_fit_end=False)
    make_trainer([qat], max_epochs=1).fit(model, datamodule=dm)
    prepared = model.net
    make_trainer([qat], max_epochs=2).fit(model, datamodule=dm)
    assert model.net is prepared, "a second fit must not prepare again"
    qat.convert(model)
    assert qat.converted and is_int8(model.net) and test_accuracy(model.net, dm) > 0.8
    with pytest.raises(QLightningError, match="already converted"):
        make_trainer([qat], max_epochs=3).fit(model, datamodule=dm)


@pytest.mark.parametrize("engine", fx_only("pt2e targets x86 only (X86InductorQuantizer, lowered by inductor); other "
                                           "backends are a ConfigError, see test_engine_pt2e.py::test_fx_only_settings_are_config_errors"))
@pytest.mark.parametrize("backend", ["qnnpack", "onednn", "fbgemm"])
def test_other_backends_convert_and_run(backend, engine):
    pl.seed_everything(0)
    model, dm = DigitsClassifier(), DigitsDataModule(seed=0)
    qat = QuantizationAwareTraining(modules=["net"], backend=backend, fake_quant_start={"epoch": 1})
    make_trainer([qat], max_epochs=3).fit(model, datamodule=dm)
    torch.backends.quantized.engine = backend
    assert test_accuracy(model.net, dm) > 0.9


@pytest.mark.parametrize("engine", fx_only("about torch.ao FX missing; pt2e without torchao is "
                                           "test_engine_pt2e.py::test_import_qlightning_without_torchao"))
def test_fx_engine_missing_gives_a_clear_error_and_import_still_works(engine):
    code = (
        "import sys; sys.modules['torch.ao.quantization.quantize_fx'] = None\n"
        "import qlightning\n"
        "qat = qlightning.QuantizationAwareTraining(modules=['net'])\n"
        "try:\n    qlightning.get_engine('fx')\nexcept qlightning.EngineUnavailableError as e:\n    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ERR engine='fx' needs torch.ao FX graph mode quantization" in out.stdout
    assert "use engine='pt2e'" in out.stdout


class _WeightRanges(pl.Callback):
    """Every observer's range after every training step, and which fake-quants keep only the current range."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []
        self.current_range: set[str] = set()  # fake-quants whose observer keeps the current range only

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.steps:
            self.current_range = {f"{name}.activation_post_process" for name, m in pl_module.net.named_modules()
                                  if getattr(getattr(m, "activation_post_process", None), "averaging_constant", 0) == 1}
        self.steps.append({k: v.clone() for k, v in pl_module.net.state_dict().items() if k.endswith(("min_val", "max_val"))})


@pytest.mark.parametrize("engine", ["fx", "pt2e"])
def test_the_float_warm_up_leaves_current_range_weight_observers_alone_and_ships_the_same_int8_model(monkeypatch, engine):
    """Under the default schedule the conv-bn weight observers keep only the current weights' range, which the
    first fake-quant step takes anew: they sit out the float warm-up (work with no effect), while the activation
    observers and the Linear's averaged weight range calibrate. The int8 model is the one observing them gave."""
    from qlightning.core.schedule import Schedule

    def fit(rest: bool) -> tuple[_WeightRanges, ClassifierModule, QuantizationAwareTraining]:
        if not rest:
            monkeypatch.setattr(Schedule, "observes_after_fake_quant_start", lambda self: False)
        pl.seed_everything(0, verbose=False)
        model, ranges = ClassifierModule(DigitsCNN()), _WeightRanges()
        qat = QuantizationAwareTraining(modules=["net"], engine=engine, fidelity={"on_breach": "warn"})
        make_trainer([qat, ranges], max_epochs=4).fit(model, datamodule=DigitsDataModule(seed=0))
        monkeypatch.undo()
        return ranges, model, qat

    rested, model, qat = fit(True)
    observed, ref_model, _ = fit(False)
    start = qat.schedule.fake_quant_start.step
    conv_bn_weights = rested.current_range  # the three conv-bn weights (the Linear's range is averaged)
    assert len(conv_bn_weights) == 3 and start > 10
    assert engine == "pt2e" or all(k.endswith("weight_fake_quant.activation_post_process") for k in conv_bn_weights)

    def moved(steps: list[dict[str, torch.Tensor]], observer: str) -> bool:
        return any(not torch.equal(steps[0][f"{observer}.{end}"], steps[start - 1][f"{observer}.{end}"])
                   for end in ("min_val", "max_val"))

    for observer in conv_bn_weights:
        assert not moved(rested.steps, observer) and moved(observed.steps, observer), observer
    for key, value in rested.steps[start - 1].items():  # the activations and the Linear calibrated as before
        if key.rsplit(".", 1)[0] not in conv_bn_weights:
            assert torch.equal(value, observed.steps[start - 1][key]), key
    # from the first fake-quant step on, the same ranges; the same int8 model
    for step in (start, len(rested.steps) - 1):
        for key, value in rested.steps[step].items():
            assert torch.equal(value, observed.steps[step][key]), (step, key)
    shipped, reference = model.net.state_dict(), ref_model.net.state_dict()
    assert shipped.keys() == reference.keys()
    for key, value in shipped.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value.int_repr() if value.is_quantized else value,
                               reference[key].int_repr() if reference[key].is_quantized else reference[key]), key
