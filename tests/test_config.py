"""The Hydra configuration surface: every key reaches the prepared/converted model, every bad
input is caught before training with a clear message, and recipes cannot run code."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from qlightning import QuantizationAwareTraining
from qlightning.cli import main as cli_main
from qlightning.config.build import build_callback
from qlightning.config.compose import compose_config
from qlightning.config.reference import END, START, markdown
from qlightning.examples import DigitsClassifier

ROOT = Path(__file__).resolve().parents[1]


def prepared_net(*overrides: str, model: nn.Module | None = None):
    """Compose the config with overrides, build the callback and prepare the digits model (no training)."""
    cfg = compose_config(list(overrides))
    callback = build_callback(cfg)
    lm = model if model is not None else DigitsClassifier()
    callback.prepare(lm)
    return callback, lm.net


def fake_quants(net: nn.Module) -> dict[str, nn.Module]:
    from torch.ao.quantization import FakeQuantizeBase

    return {n: m for n, m in net.named_modules() if isinstance(m, FakeQuantizeBase)}


# ------------------------------------------------------------------ each key has its effect


def test_default_mapping_is_the_backends_per_channel_qat_default_with_current_weight_ranges():
    from torch.ao.quantization import FusedMovingAvgObsFakeQuantize

    _, net = prepared_net()
    fq = fake_quants(net)
    weight = fq["features.0.0.weight_fake_quant"]
    assert isinstance(weight, FusedMovingAvgObsFakeQuantize) and type(weight).__name__ == "ZeroCenteredFusedFakeQuantize"
    assert weight.qscheme == torch.per_channel_symmetric
    assert weight.activation_post_process.averaging_constant == 1.0  # the current weights' range (notes/defaults.md)
    assert fq["activation_post_process_0"].activation_post_process.reduce_range  # x86 default


def test_global_preset_per_tensor_and_module_name_none():
    _, net = prepared_net("quant.qconfig_mapping={global: per_tensor_symmetric, module_name: [{name: classifier, qconfig: null}]}")
    fq = fake_quants(net)
    assert fq["features.0.0.weight_fake_quant"].qscheme == torch.per_tensor_symmetric
    assert "classifier.weight_fake_quant" not in fq and type(net.classifier) is nn.Linear


def test_object_type_w4a8_sets_the_weight_range():
    _, net = prepared_net("quant.qconfig_mapping={global: default, object_type: [{type: torch.nn.Linear, qconfig: w4a8}]}")
    fq = fake_quants(net)
    assert (fq["classifier.weight_fake_quant"].quant_min, fq["classifier.weight_fake_quant"].quant_max) == (-7, 7)
    assert fq["features.0.0.weight_fake_quant"].quant_max == 127


def test_module_name_regex_and_order():
    _, net = prepared_net(
        "quant.qconfig_mapping={global: default, module_name_regex: [{regex: 'features[.]3.*', qconfig: per_tensor_affine}],"
        " module_name_object_type_order: [{module_name: '', object_type: torch.flatten, index: 0, qconfig: null}]}"
    )
    fq = fake_quants(net)
    assert fq["features.3.0.weight_fake_quant"].qscheme == torch.per_tensor_symmetric
    assert fq["features.0.0.weight_fake_quant"].qscheme == torch.per_channel_symmetric


def test_presets_keep_x86_int8_sums_from_overflowing():
    """Found by the README test on an AVX2 machine (no VNNI): the per_channel_symmetric preset's activations on
    [0, 255] with 8-bit weights made int8 12.4 dB from fake-quant (fbgemm's u8 x s8 pair sums saturate in
    int16). On x86/fbgemm the presets take 7-bit weights (MiniLM: cosine to float 0.995, against 0.983 with
    torch.ao's 7-bit activations); a given weight range keeps its bits and halves the activations instead;
    qnnpack keeps 8 bits; both ranges given and overflowing is refused naming the key and the fix."""
    from qlightning.engines.fx.qconfig_builder import QConfigBuilder
    from qlightning.errors import ConfigError

    def ranges(backend: str, spec) -> tuple[tuple[int, int], tuple[int, int]]:
        errors: list[str] = []
        qconfig = QConfigBuilder(backend, is_qat=True).qconfig(spec, "quant.qconfig_mapping.global", errors)
        assert not errors, errors
        act, weight = qconfig.activation(), qconfig.weight()
        return (int(act.quant_min), int(act.quant_max)), (int(weight.quant_min), int(weight.quant_max))

    for preset in ("per_channel_symmetric", "per_tensor_affine", "histogram", "learnable"):
        assert ranges("x86", preset) == ((0, 255), (-64, 63)), preset
        assert ranges("fbgemm", preset) == ((0, 255), (-64, 63)), preset
        assert ranges("qnnpack", preset) == ((0, 255), (-128, 127)), preset
    assert ranges("x86", "w4a8") == ((0, 255), (-7, 7))  # 4-bit weights cannot overflow
    # the weight range left to us: 7 bits; given: the activations take [0, 127]
    assert ranges("x86", {"activation": {"observer": "moving_average_minmax"}}) == ((0, 255), (-64, 63))
    per_channel = {"observer": "moving_average_per_channel_minmax", "dtype": "qint8", "qscheme": "per_channel_symmetric"}
    assert ranges("x86", {"activation": {"observer": "moving_average_minmax"}, "weight": per_channel})[1] == (-64, 63)
    assert ranges("x86", {"weight": {**per_channel, "quant_min": -128, "quant_max": 127}}) == ((0, 127), (-128, 127))
    errors: list[str] = []
    QConfigBuilder("x86", is_qat=True).qconfig(
        {"activation": {"observer": "moving_average_minmax", "quant_min": 0, "quant_max": 255},
         "weight": {**per_channel, "quant_min": -128, "quant_max": 127}},
        "quant.qconfig_mapping.global", errors)
    assert len(errors) == 1 and "quant.qconfig_mapping.global: activations [0, 255] with weights up to |128|" in errors[0]
    assert "use activation quant_max: 127" in errors[0] and "backend qnnpack" in errors[0]
    with pytest.raises(ConfigError, match="overflow the int16 pair sums"):
        prepared_net("quant.qconfig_mapping={global: {activation: {quant_min: 0, quant_max: 255},"
                     " weight: {dtype: qint8, qscheme: per_tensor_symmetric, quant_min: -128, quant_max: 127}}}")


def test_each_caller_gets_its_own_copy_of_the_parsed_presets():
    """The shipped presets are parsed once per process: a caller that edits what it got changes nobody else's."""
    from qlightning.engines.fx.qconfig_builder import load_presets

    first = load_presets()
    name = next(iter(first))
    first[name]["global"] = "edited"
    first["added"] = {}
    second = load_presets()
    assert "added" not in second and second[name].get("global") != "edited"


def test_learnable_preset_makes_scales_parameters():
    _, net = prepared_net("quant.qconfig_mapping=learnable")
    scales = [n for n, _ in net.named_parameters() if n.endswith(".scale")]
    assert scales and all(type(m).__name__ == "_LearnableFakeQuantize" for m in fake_quants(net).values())


def test_inline_observer_arguments_reach_the_observer():
    _, net = prepared_net(
        "quant.qconfig_mapping={global: {activation: {observer: moving_average_minmax, dtype: quint8, qscheme: per_tensor_affine,"
        " quant_min: 0, quant_max: 127, averaging_constant: 0.05, eps: 0.0001}, weight: {fake_quant: fake_quantize,"
        " observer: per_channel_minmax, dtype: qint8, qscheme: per_channel_affine, quant_min: -64, quant_max: 63, ch_axis: 0}}}"
    )
    fq = fake_quants(net)
    act = fq["activation_post_process_0"].activation_post_process
    assert act.averaging_constant == 0.05 and act.quant_max == 127 and float(act.eps) == pytest.approx(1e-4)
    weight = fq["features.0.0.weight_fake_quant"]
    assert type(weight).__name__ == "FakeQuantize" and weight.qscheme == torch.per_channel_affine
    assert (weight.quant_min, weight.quant_max, weight.ch_axis) == (-64, 63, 0)


def test_user_presets_and_histogram():
    _, net = prepared_net(
        "+quant.qconfig_presets.mine={activation: {observer: histogram, fake_quant: fake_quantize}, "
        "weight: {observer: minmax, dtype: qint8, qscheme: per_tensor_symmetric}}",
        "quant.qconfig_mapping=mine",
    )
    assert type(fake_quants(net)["activation_post_process_0"].activation_post_process).__name__ == "HistogramObserver"


def test_non_traceable_module_names_and_classes_stay_float_modules():
    _, net = prepared_net("quant.prepare.non_traceable_module_names=[features.2]",
                          "quant.prepare.non_traceable_module_classes=[torch.nn.AdaptiveAvgPool2d]")
    call_modules = {n.target for n in net.graph.nodes if n.op == "call_module"}
    assert "features.2" in call_modules and "features.4" in call_modules  # leaves, not traced through


def test_standalone_module_is_prepared_as_one_unit():
    from torch.ao.quantization.fx.graph_module import _is_observed_standalone_module

    _, net = prepared_net("quant.prepare.standalone_module_names=[classifier]")
    assert _is_observed_standalone_module(net.classifier)


def test_preserved_attributes_survive_prepare():
    class Net(DigitsClassifier):
        def __init__(self):
            super().__init__()
            self.net.tag = "keep-me"

    _, net = prepared_net("quant.prepare.preserved_attributes=[tag]", model=Net())
    assert net.tag == "keep-me"


def test_backend_config_and_backend_reach_the_engine():
    callback, _ = prepared_net("quant.backend=qnnpack", "quant.backend_config=qnnpack")
    assert callback.spec.backend == "qnnpack" and callback.spec.backend_config.name == "qnnpack"


def test_equalization_is_refused_for_qat_with_the_reason():
    with pytest.raises(Exception, match="quant.equalization: input-weight equalization is applied by FX prepare_fx"):
        prepared_net("quant.equalization=[features.0.0]")


def test_float_to_observed_and_observed_to_quantized_custom_modules():
    """An LSTM through torch.ao's quantizable LSTM: float -> observed -> quantized, set from the command line."""
    import lightning.pytorch as pl

    class Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(8, 16, batch_first=True)
            self.head = nn.Linear(16, 10)

        def forward(self, x):
            # torch.ao's quantizable LSTM takes the state explicitly: (input, (h0, c0))
            state = torch.zeros(1, x.size(0), 16)
            out, _ = self.lstm(x, (state, state))
            return self.head(out[:, -1])

    class SeqModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Seq()
            self.example_input_array = torch.randn(2, 8, 8)

        def forward(self, x):
            return self.net(x)

    callback, net = prepared_net(
        "+quant.prepare.float_to_observed.static=[{float: torch.nn.LSTM, observed: torch.ao.nn.quantizable.LSTM}]",
        "+quant.convert.observed_to_quantized.static=[{observed: torch.ao.nn.quantizable.LSTM, quantized: torch.ao.nn.quantized.LSTM}]",
        "quant.qconfig_mapping={global: default, module_name: [{name: head, qconfig: null}]}",
        model=SeqModule(),
    )
    assert type(net.lstm).__module__.startswith("torch.ao.nn.quantizable")
    callback.engine.set_observers(net, True)  # calibrate once (the callback does this inside training steps)
    net(torch.randn(4, 8, 8))
    lm = SeqModule()
    lm.net = net
    callback.convert(lm)
    assert type(lm.net.lstm).__module__.startswith("torch.ao.nn.quantized")
    # running the static int8 LSTM end to end (with quantized state) is covered in tests/test_lstm.py


def test_python_dicts_and_native_objects_give_the_same_prepared_graph():
    from torch.ao.quantization import QConfigMapping
    from torch.ao.quantization.fx.custom_config import PrepareCustomConfig

    from qlightning.engines.fx.weights import default_qat_qconfig  # "default": x86's, weights on their current range

    native = QuantizationAwareTraining(
        qconfig_mapping=QConfigMapping().set_global(default_qat_qconfig("x86")).set_module_name("classifier", None),
        prepare_custom_config=PrepareCustomConfig().set_non_traceable_module_names(["features.2"]),
    )
    data = QuantizationAwareTraining(
        qconfig_mapping={"global": "default", "module_name": [{"name": "classifier", "qconfig": None}]},
        prepare_custom_config={"non_traceable_module_names": ["features.2"]},
    )
    graphs = []
    for callback in (native, data):
        torch.manual_seed(0)
        lm = DigitsClassifier()
        callback.prepare(lm)
        graphs.append((str(lm.net.graph), sorted((n, type(m).__name__) for n, m in lm.net.named_modules())))
    assert graphs[0] == graphs[1]


# ------------------------------------------------------------------ bad input, caught early

BAD_INPUTS = [
    (["quant.backend=tensorrt"], "quant.backend: Invalid value 'tensorrt', expected one of [x86, fbgemm, qnnpack, onednn]"),
    (["quant.engine=onnx"], "quant.engine: Invalid value 'onnx'"),
    (["trainer.max_epoch=3"], "Key 'max_epoch' not in 'TrainerConf' (did you mean 'max_epochs'?)"),
    (["quant.shedule.bn_freeze.epoch=1"], "did you mean 'schedule'?"),
    (["seed=abc"], "seed: Value 'abc' of type 'str' could not be converted to Integer"),
    (["trainer.max_epochs=three"], "trainer.max_epochs: Value 'three'"),
    (["quant.observe_stages=[training]"], "Invalid value 'training'"),
    (["quant.convert_on_fit_end=maybe"], "quant.convert_on_fit_end"),
    (["quant.schedule.fake_quant_start.epoch=4", "quant.schedule.observer_freeze.epoch=2"], "comes before"),
    (["quant.schedule.bn_freeze.epoch=-1"], "quant.schedule.bn_freeze.epoch=-1: must be >= 0"),
    (["quant.schedule.observer_freeze.step=10"], "give either 'epoch' (3) or 'step' (10), not both"),
    (["quant.schedule.observer_freeze.epoch=0"], "observer_freeze (epoch 0): must be positive"),
    (["quant.modules=[backbone]"], "no submodule 'backbone'"),
    (["quant.modules=[net.featurs]"], "closest: ['net.features'"),
    (["quant.qconfig_mapping=w4a9"], "unknown qconfig preset (did you mean 'w4a8'?)"),
    (["quant.qconfig_mapping={global: {activation: {observer: minmaxx}}}"], "unknown observer (did you mean 'minmax'?)"),
    (["quant.qconfig_mapping={global: {activation: {dtype: qint9}}}"], "unknown dtype"),
    (["quant.qconfig_mapping={global: {activation: {qscheme: per_tensor}}}"], "unknown qscheme"),
    (["quant.qconfig_mapping={global: {weight: {dtype: qint8, quant_min: 10, quant_max: 5}}}"], "must be an integer smaller than quant_max=5"),
    (["quant.qconfig_mapping={global: {weight: {dtype: qint8, quant_min: -200, quant_max: 127}}}"], "does not fit dtype qint8"),
    (["quant.qconfig_mapping={global: {weight: {observer: minmax, qscheme: per_channel_symmetric}}}"], "needs a per-channel observer"),
    (["quant.qconfig_mapping={global: {activation: {observer: histogram, fake_quant: fused_moving_avg}}}"], "use fake_quant: fake_quantize"),
    (["quant.qconfig_mapping={global: default, module_name_regex: [{regex: 'feat(', qconfig: null}]}"], "not a valid regular expression"),
    (["quant.qconfig_mapping={global: default, module_name: [{name: clasifier, qconfig: null}]}"], "closest: ['classifier']"),
    (["quant.qconfig_mapping={global: default, module_name_regex: [{regex: '^decoder', qconfig: null}]}"], "matches no submodule"),
    (["quant.qconfig_mapping={global: default, object_type: [{type: torch.nn.LSTM, qconfig: null}]}"], "no module of this type"),
    (["quant.qconfig_mapping={global: default, object_type: [{type: torch.nn.NoSuchLayer, qconfig: null}]}"], "cannot be resolved"),
    (["quant.qconfig_mapping={global: default, unknown_key: 1}"], "unknown key(s) ['unknown_key']"),
    (["quant.prepare.non_traceable_module_names=[features.9]"], "matches no submodule"),
    (["quant.prepare.non_traceable_module_classes=[os.system]"], "not an allowed class"),
    (["+quant.prepare.float_to_observed.static=[{float: torch.nn.LSTM, observed: torch.ao.nn.quantizable.LSTM}]"], "does not occur in ['net']"),
    (["+quant.convert.observed_to_quantized.sometimes=[]"], "unknown quantization type"),
    (["quant.backend_config=tensorrt"], "unknown backend config"),
    (["+quant.example_inputs.net={shape: [1, 0], dtype: float32}"], "give positive sizes"),
    (["+quant.example_inputs.net={shape: [1, 8], dtype: float33}"], "not a torch dtype"),
    (["model._target_=builtins.eval"], "not an allowed class"),
    (["quant.engine=pt2e", "quant.backend=qnnpack"], "the pt2e engine supports only 'x86'"),
    (["+quant.engine_options.fast_qta=false"], "quant.engine_options.fast_qta: unknown option for engine 'fx'; valid: ['clamp_activations', 'compile', 'fast_conv_bn'"),
    (["+quant.engine_options.fast_linear=1"], "quant.engine_options.fast_linear=1: true or false"),
    (["quant.engine=pt2e", "+quant.engine_options.fast_qat=false"], "unknown option for engine 'pt2e'"),
    (["quant.method=ptq", "+quant.engine_options.dynamic_dims=[1]"], "unknown option for engine 'fx'"),
]


@pytest.mark.parametrize("overrides, fragment", BAD_INPUTS, ids=[o[0].split("=")[0] + f"-{i}" for i, (o, _) in enumerate(BAD_INPUTS)])
def test_bad_input_is_reported_by_validate_without_training(overrides, fragment, capsys):
    code = cli_main(["recipes", "validate", "digits_fast", *overrides])
    err = capsys.readouterr().err
    assert code == 1, err
    assert fragment in err, err
    assert "Traceback" not in err


def test_every_problem_is_reported_at_once(capsys):
    code = cli_main(["recipes", "validate", "digits_fast", "quant.backend=foo", "trainer.max_epoch=1", "seed=x"])
    err = capsys.readouterr().err
    assert code == 1 and "3 problem(s)" in err


def test_bad_yaml_and_missing_files(tmp_path, capsys):
    broken = tmp_path / "broken.yaml"
    broken.write_text("quant: {backend: x86\n  modules: [net")
    assert cli_main(["recipes", "validate", str(broken)]) == 1
    assert "not valid YAML" in capsys.readouterr().err
    assert cli_main(["recipes", "validate", str(tmp_path / "missing.yaml")]) == 1
    assert "no such file" in capsys.readouterr().err
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n- b\n")
    assert cli_main(["recipes", "validate", str(listed)]) == 1
    assert "a recipe must be a mapping" in capsys.readouterr().err
    newer = tmp_path / "newer.yaml"
    newer.write_text("schema_version: 7\n")
    assert cli_main(["recipes", "validate", str(newer)]) == 1
    assert "written for a newer qlightning" in capsys.readouterr().err


def test_bad_input_through_train_exits_2_before_any_step(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "qlightning.cli", "train", "quant.qconfig_mapping=w4a9", "trainer.max_epoch=2",
         "quant.modules=[backbone]", f"hydra.run.dir={tmp_path}/run"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert out.returncode == 2
    assert "did you mean 'max_epochs'" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


# ------------------------------------------------------------------ hostile recipes

HOSTILE = {
    "target_os_system": "model:\n  _target_: os.system\n  command: 'touch {marker}'\n",
    "target_subprocess": "data:\n  _target_: subprocess.run\n  args: ['touch', '{marker}']\n",
    "target_builtins_exec": "model:\n  _target_: builtins.exec\n  _args_: ['open(\"{marker}\", \"w\")']\n",
    "target_pickle": "model:\n  _target_: pickle.loads\n  _args_: ['x']\n",
    "target_importlib": "model:\n  _target_: importlib.import_module\n  name: os\n",
    "target_nested": "model:\n  _target_: qlightning.examples.DigitsClassifier\n  lr: {{_target_: os.system, command: 'touch {marker}'}}\n",
    "target_torch_hub": "model:\n  _target_: torch.hub.load\n  repo_or_dir: x\n",
    "widen_allowlist": "trusted_modules: [os, subprocess]\nmodel:\n  _target_: os.system\n  command: 'touch {marker}'\n",
    "hydra_callback": "hydra:\n  callbacks:\n    evil:\n      _target_: os.system\n      command: 'touch {marker}'\n",
    "hydra_env": "hydra:\n  job:\n    env_set:\n      LD_PRELOAD: /tmp/evil.so\n",
    "defaults_list": "defaults:\n  - override /model: digits_cnn\n",
    "object_type_os": "quant:\n  qconfig_mapping:\n    object_type: [{{type: os.system, qconfig: null}}]\n",
    "custom_class_subprocess": "quant:\n  prepare:\n    non_traceable_module_classes: [subprocess.Popen]\n",
    "resolver_env": "model:\n  _target_: ${{oc.env:EVIL_TARGET}}\n",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_recipe_is_refused_and_runs_nothing(tmp_path, name, capsys, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("EVIL_TARGET", "os.system")
    recipe = tmp_path / f"{name}.yaml"
    recipe.write_text(HOSTILE[name].format(marker=marker))
    code = cli_main(["recipes", "validate", str(recipe)])
    err = capsys.readouterr().err
    assert code == 1, err
    assert any(s in err for s in ("not an allowed class", "which a recipe may not set", "_target_ is allowed only as",
                                  "no interpolation")), err
    assert not marker.exists()


def test_hostile_recipe_through_train_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    recipe = tmp_path / "evil.yaml"
    recipe.write_text(HOSTILE["widen_allowlist"].format(marker=marker))
    out = subprocess.run([sys.executable, "-m", "qlightning.cli", "train", f"recipe={recipe}", f"hydra.run.dir={tmp_path}/run"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 2 and "sets 'trusted_modules', which a recipe may not set" in out.stderr
    assert not marker.exists()


def test_trusted_modules_from_the_command_line_admit_a_user_class(tmp_path):
    pkg = tmp_path / "teamnets"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from qlightning.examples import DigitsClassifier as Net\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    args = [sys.executable, "-m", "qlightning.cli", "recipes", "validate", "digits_fast", "model._target_=teamnets.Net"]
    refused = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert refused.returncode == 1 and "not an allowed class" in refused.stderr
    allowed = subprocess.run(args + ["trusted_modules=[teamnets]"], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert allowed.returncode == 0, allowed.stderr


# ------------------------------------------------------------------ recipes from other packages, provenance, reference


@pytest.mark.slow
def test_recipe_from_an_installed_package(tmp_path):
    src = tmp_path / "src"
    (src / "team_recipes").mkdir(parents=True)
    (src / "team_recipes" / "__init__.py").write_text("")
    (src / "team_recipes" / "team_digits.yaml").write_text(
        "# qlightning train recipe=team_digits\nschema_version: 1\ntrainer:\n  max_epochs: 2\n"
        "quant:\n  backend: qnnpack\n  schedule:\n    fake_quant_start: {epoch: 0}\n    observer_freeze: {epoch: 1}\n    bn_freeze: {epoch: 1}\n"
    )
    (src / "pyproject.toml").write_text(textwrap.dedent("""
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "team-recipes"
        version = "0.1"
        [project.entry-points."qlightning.recipes"]
        team = "team_recipes"
        [tool.setuptools.package-data]
        team_recipes = ["*.yaml"]
    """))
    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                              "--target", str(site), str(src)], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr
    env = {**os.environ, "PYTHONPATH": str(site)}
    listing = subprocess.run([sys.executable, "-m", "qlightning.cli", "recipes", "list"], capture_output=True, text=True,
                             env=env, timeout=120, cwd=tmp_path)
    assert "team_digits" in listing.stdout and "team-recipes" in listing.stdout
    run = subprocess.run([sys.executable, "-m", "qlightning.cli", "train", "recipe=team_digits", f"hydra.run.dir={tmp_path}/run",
                          "trainer.enable_progress_bar=false"], capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert '"backend": "qnnpack"' in (tmp_path / "run" / "report.json").read_text()
    shown = subprocess.run([sys.executable, "-m", "qlightning.cli", "recipes", "show", "--from",
                            str(tmp_path / "run" / "checkpoints" / "last.ckpt")], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "# recipe team_digits (team-recipes), sha256 " in shown.stdout
    assert "backend: qnnpack" in shown.stdout and "max_epochs: 2" in shown.stdout and "torch 2." in shown.stdout


@pytest.mark.slow
def test_multirun_writes_a_comparison_table(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "qlightning.cli", "train", "-m", "recipe=digits_fast", "quant.backend=x86,qnnpack",
         "trainer.max_epochs=1", "quant.schedule.auto=true", "quant.fidelity.on_breach=warn",
         "trainer.enable_progress_bar=false", f"hydra.sweep.dir={tmp_path}/sweep"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    table = (tmp_path / "sweep" / "comparison.md").read_text()
    assert "quant.backend=x86" in table and "quant.backend=qnnpack" in table
    assert table.count("\n") == 4  # header, rule, two runs


def test_readme_config_reference_is_generated_from_the_schema():
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index(START): readme.index(END) + len(END)]
    assert block == markdown(), "run: python -m qlightning.config.reference --write README.md"
    assert "| `quant.schedule.fake_quant_start.epoch` | int \\| null | `3` |" in block


def test_readme_recipe_table_lists_every_shipped_recipe_from_its_header():
    from qlightning import recipes_registry
    from qlightning.config.reference import RECIPES_END, RECIPES_START, recipe_markdown

    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index(RECIPES_START): readme.index(RECIPES_END) + len(RECIPES_END)]
    assert block == recipe_markdown(), "run: python -m qlightning.config.reference --write README.md"
    shipped = [n for n, r in recipes_registry.discover().items() if r.origin == "qlightning"]
    assert all(f"| `{name}` |" in block for name in shipped) and "minilm_pt2e" in shipped


def test_every_schema_key_is_documented():
    from qlightning.config.reference import rows

    missing = [key for key, tp, _, help_text in rows() if not help_text]
    assert not missing


def test_every_shipped_recipe_starts_with_its_command():
    from qlightning import recipes_registry

    for name, recipe in recipes_registry.discover().items():
        assert recipe.command == f"qlightning train recipe={name}", recipe.path


def test_input_and_output_quantized_indexes_change_the_converted_interface():
    callback, net = prepared_net("quant.prepare.input_quantized_indexes=[0]", "quant.prepare.output_quantized_indexes=[0]")
    callback.engine.set_observers(net, True)
    net(torch.rand(8, 1, 8, 8))
    lm = DigitsClassifier()
    lm.net = net
    callback.convert(lm)
    x = torch.quantize_per_tensor(torch.rand(4, 1, 8, 8), 1 / 255, 0, torch.quint8)
    out = lm.net(x)  # takes an already quantized input ...
    assert out.is_quantized and out.shape == (4, 10)  # ... and returns a quantized output


def test_convert_preserved_attributes_survive_conversion():
    class Net(DigitsClassifier):
        def __init__(self):
            super().__init__()
            self.net.labels = list("0123456789")

    callback, net = prepared_net("quant.prepare.preserved_attributes=[labels]", "quant.convert.preserved_attributes=[labels]",
                                 model=Net())
    callback.engine.set_observers(net, True)
    net(torch.rand(8, 1, 8, 8))
    lm = DigitsClassifier()
    lm.net = net
    callback.convert(lm)
    assert lm.net.labels == list("0123456789")


def _short_fit_overrides(run_dir: Path) -> list[str]:
    return [f"hydra.run.dir={run_dir}", "trainer.max_epochs=1", "trainer.limit_train_batches=4", "trainer.limit_val_batches=2",
            "trainer.limit_test_batches=2", "trainer.num_sanity_val_steps=0", "trainer.enable_progress_bar=false",
            "report.latency_repeats=2", "parity.on_breach=warn", "quant.schedule.auto=true",
            "quant.fidelity.on_breach=warn"]  # 4 steps leave scales barely calibrated


@pytest.mark.slow  # a full CLI run (quick suite under 10 minutes)
def test_trainer_checkpoint_report_and_convert_keys_reach_the_run(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "qlightning.cli", "train", *_short_fit_overrides(tmp_path / "a"), "trainer.max_epochs=2",
         "checkpoint.every_n_train_steps=3", "checkpoint.save_top_k=-1", "report.latency_batch_size=8",
         "quant.observe_stages=[train,validate]"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    steps = sorted(p.name for p in (tmp_path / "a" / "checkpoints").glob("epoch=*-step=*.ckpt"))
    assert steps == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt"], steps
    report = (tmp_path / "a" / "report.json").read_text()
    assert '"latency_batch_size": 8' in report
    off = subprocess.run(
        [sys.executable, "-m", "qlightning.cli", "train", *_short_fit_overrides(tmp_path / "b"), "quant.convert_on_fit_end=false"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert off.returncode == 0, off.stderr[-2000:]
    assert not (tmp_path / "b" / "int8_net.pt").exists() and not (tmp_path / "b" / "report.json").exists()
    assert (tmp_path / "b" / "checkpoints" / "last.ckpt").is_file()


def test_recipes_diff(capsys):
    assert cli_main(["recipes", "diff", "digits_qat", "digits_qnnpack"]) == 0
    out = capsys.readouterr().out
    assert "-  backend: x86" in out and "+  backend: qnnpack" in out


def test_engine_options_reach_the_engine():
    """quant.engine_options.fast_qat=false gives torch.ao's modules untouched; the default the fast path."""
    from qlightning.engines.fx import fast_fq

    _, fast = prepared_net()
    _, plain = prepared_net("+quant.engine_options.fast_qat=false")
    assert any(fast_fq.is_fast(m) for m in fast.modules())
    assert not any(fast_fq.is_fast(m) or "forward" in m.__dict__ for m in plain.modules())


@pytest.mark.parametrize("command", ["validate", "train"])
def test_milestones_past_the_trainer_limits_are_refused_before_a_trainer_exists(command, tmp_path, capsys):
    # stop 24, noticed: `qlightning train` printed Lightning's model summary (and prepared the model) before the
    # callback found, at fit start, that the schedule's milestones lie beyond max_epochs; both limits are in the config
    overrides = ["quant.schedule.fake_quant_start.epoch=6", "quant.schedule.observer_freeze.epoch=7",
                 "quant.schedule.bn_freeze={step: 40, epoch: null}", "trainer.max_steps=40"]
    args = (["recipes", "validate", "digits_fast"] if command == "validate"
            else ["train", "recipe=digits_fast", f"hydra.run.dir={tmp_path}/run"])
    try:
        code = cli_main([*args, *overrides])
    except SystemExit as exc:  # `train` exits from inside Hydra's main
        code = exc.code
    out = capsys.readouterr()
    assert code, out.err
    assert "quant.schedule.fake_quant_start={epoch: 6}: the fit ends after max_epochs=4, so it is never reached" in out.err
    assert "quant.schedule.observer_freeze={epoch: 7}" in out.err and "quant.schedule.bn_freeze={step: 40}: the fit ends at max_steps=40" in out.err
    assert "set quant.schedule.auto=true" in out.err  # the command line's advice, not the callback argument's
    assert "Traceback" not in out.err and "Trainable params" not in out.out + out.err and "prepared" not in out.out + out.err
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("overrides", [["quant.schedule.auto=true", "trainer.max_steps=30"], ["trainer.max_steps=30"]],
                         ids=["derived", "explicit-within"])
def test_schedules_the_run_reaches_pass_the_limit_check(overrides, capsys):
    # the derived schedule holds a placeholder milestone (step 2**62) until the fit starts: not a milestone to check
    code = cli_main(["recipes", "validate", "digits_fast", *overrides])
    err = capsys.readouterr().err
    assert code == 0, err


@pytest.mark.parametrize("argv,required", [(["recipes", "validate"], "recipe"), (["doctor"], "target")])
def test_a_missing_argument_names_only_what_is_required(argv, required, capsys):
    # argparse listed the optional Hydra overrides as required too ("required: recipe, overrides")
    from qlightning.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().endswith(f"the following arguments are required: {required}")
