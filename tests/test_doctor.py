"""`qlightning doctor`: what traces, what does not and why (with the source line), and the route that fits."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from qlightning import QuantizationAwareTraining
from qlightning.cli import main as cli_main
from qlightning.quantize.doctor import diagnose
from qlightning.examples.custom_modules import (
    ElmanRNN,
    HybridClassifier,
    IterativeRefine,
    KeywordOnly,
    LengthNormalize,
    RefineDigitsNet,
    RowLoop,
    RowRNNClassifier,
)


def logged(fn):
    """A hand-written decorator: without functools.wraps the forward's signature is (*args, **kwargs)."""

    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


class Decorated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    @logged
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Mixed(nn.Module):
    """One of each trace breaker, under a parent whose own forward branches on the input's rank."""

    def __init__(self) -> None:
        super().__init__()
        self.keyword = KeywordOnly()
        self.norm = LengthNormalize()
        self.rows = RowLoop()
        self.decorated = Decorated()
        self.refine = nn.Sequential(nn.Linear(8, 8), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3:
            x = x.mean(1)
        return self.refine(self.decorated(self.rows(self.norm(self.keyword(x)))))


def test_each_known_trace_breaker_is_recognised_with_its_source_line():
    report = diagnose(Mixed(), example_inputs=torch.rand(4, 8))
    kinds = {f.name: f.kind for f in report.findings if not f.traces}
    assert kinds == {"": "control_flow", "keyword": "keyword_only", "norm": "len", "rows": "iteration",
                     "decorated": "variadic"}
    root = report.get("")
    assert root.source == "if x.dim() == 3:" and "test_doctor.py:" in root.location
    assert "len(x)" in report.get("norm").source
    assert "for row in x" in report.get("rows").source
    assert "scale" in report.get("keyword").error or "NoneType" in report.get("keyword").error
    assert report.get("refine").traces
    assert report.get("decorated").route == "1.a" and "proj" in report.get("decorated").advice
    text = report.to_text()
    for fragment in ("data-dependent control flow", "len() of a tensor", "iteration over a tensor",
                     "keyword-only forward parameter", "*args/**kwargs forward", "if x.dim() == 3:"):
        assert fragment in text


def test_view_unpacking_is_recognised_and_the_refactor_is_route_2a():
    report = diagnose(HybridClassifier())
    attention = report.get("net.encoder.layer.0.attention.self")
    assert attention.kind == "view_unpack" and attention.route == "2.a"
    assert attention.source == "x = x.view(*new_shape)"
    assert "x.view(new_shape)" in attention.advice
    # the refactored model: the whole encoder traces
    refactored = diagnose(HybridClassifier(traceable_attention=True))
    assert refactored.get("net.encoder").traces


def test_data_dependent_submodule_gets_route_1b_and_the_snippet_prepares():
    report = diagnose(RefineDigitsNet())
    refine = report.get("net.refine")
    assert refine.kind == "control_flow" and refine.route == "1.b"
    assert refine.source == "if update.abs().amax() < self.tol:"
    (route,) = report.skip_routes()
    assert (route.name, route.skip) == ("net", ["refine"])
    assert "non_traceable_module_names:\n          - refine" in report.to_text()
    model = RefineDigitsNet()
    qat = QuantizationAwareTraining(modules=[route.name], prepare_custom_config={"non_traceable_module_names": route.skip})
    qat.prepare(model)  # the suggested config traces
    assert type(model.net.refine) is IterativeRefine


def test_route_1a_snippet_names_the_blocks_that_trace_and_they_all_prepare():
    report = diagnose(HybridClassifier())
    names = report.traceable_modules()
    assert "net.encoder.layer.0.attention.output" in names and "net.backbone.layer3" in names
    assert "net.encoder.layer.0.attention.self" not in names  # it does not trace
    assert "net.encoder.layer.*.intermediate" in report.modules_snippet()
    model = HybridClassifier()
    qat = QuantizationAwareTraining(modules=names)
    qat.prepare(model)
    assert len(qat.targets) == len(names)


def test_a_loop_with_layers_inside_gets_the_custom_module_route():
    report = diagnose(RowRNNClassifier())
    rnn = report.get("net.rnn")
    assert rnn.kind == "iteration" and rnn.source == "for t in range(x.size(1)):"
    assert rnn.route == "1.b" and "2.b" in rnn.advice  # float inside the int8 graph, or a custom module pair
    standalone = diagnose(ElmanRNN(8, 8))
    assert standalone.get("").route == "2.b"


def test_shape_arithmetic_that_traces_but_breaks_the_default_mapping_is_flagged():
    class GuideRefactor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            new_shape = x.size()[:-1] + (2, 4)
            return self.proj(x).view(new_shape)

    report = diagnose(GuideRefactor())
    assert report.get("").traces
    assert any("operator.add" in n for n in report.get("").notes)
    assert "Traces, with a caveat" in report.to_text()


def test_lstm_traces_as_a_leaf():
    from qlightning.examples.lstm import LSTMClassifier

    report = diagnose(LSTMClassifier())
    assert report.get("").traces  # nn.LSTM is one call for FX; static int8 needs the custom module pair
    assert report.traceable_modules() == []  # the root is not a target name; `net` is covered by it


def test_cli_on_an_import_path_prints_the_report(capsys):
    assert cli_main(["doctor", "qlightning.examples.custom_modules:RefineDigitsNet"]) == 0
    out = capsys.readouterr().out
    assert "net.refine" in out and "IterativeRefine" in out and "1.b" in out
    assert "if update.abs().amax() < self.tol:" in out


def test_cli_json_and_bad_targets(capsys):
    assert cli_main(["doctor", "qlightning.examples.custom_modules:HybridClassifier", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "net.backbone.layer3" in data["traceable_modules"]
    assert cli_main(["doctor", "qlightning.examples.custom_modules:NoSuchThing"]) == 2
    assert "cannot load" in capsys.readouterr().err


def test_cli_on_a_recipe_checks_the_configured_modules(capsys, tmp_path):
    good = tmp_path / "refine.yaml"
    good.write_text(  # RefineDigitsNet takes the default model's arguments (channels, lr, weight_decay)
        "# qlightning train recipe=refine.yaml\nschema_version: 1\n"
        "model: {_target_: qlightning.examples.custom_modules.RefineDigitsNet}\n"
        "quant:\n  modules: [net]\n  prepare: {non_traceable_module_names: [refine]}\n"
    )
    assert cli_main(["doctor", f"recipe={good}"]) == 0
    assert "configured quant.modules target 'net': traces" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text(good.read_text().replace("\n  prepare: {non_traceable_module_names: [refine]}", ""))
    assert cli_main(["doctor", f"recipe={bad}"]) == 1
    assert "does NOT trace" in capsys.readouterr().out




def test_cli_on_a_recipe_dry_runs_convert_and_the_int8_forward(capsys, tmp_path):
    """Issue 17: the doctor said "traces" (exit 0) for a mapping torch.ao refuses only when it prepares and converts."""
    from test_validate_dry_run import CONV_W4A8

    recipe = tmp_path / "conv_w4a8.yaml"
    recipe.write_text(CONV_W4A8)
    assert cli_main(["doctor", f"recipe={recipe}"]) == 1
    out = capsys.readouterr().out
    assert "configured quant.modules target 'net': traces" in out
    assert "config problem: quant.qconfig_mapping.object_type" in out and "same qconfig" in out, out
    assert cli_main(["doctor", f"recipe={recipe}", "--no-dry-run"]) == 0  # tracing alone sees nothing
    capsys.readouterr()
    assert cli_main(["doctor", "recipe=digits_fast"]) == 0
    assert "dry run (prepare -> forward -> convert -> int8 forward on one batch): ok" in capsys.readouterr().out


@pytest.mark.parametrize("recipe", ["lstm_static", "lstm_dynamic"])
def test_cli_on_the_shipped_lstm_recipes(capsys, recipe):
    assert cli_main(["doctor", f"recipe={recipe}"]) == 0
    assert "configured quant.modules target 'net': traces" in capsys.readouterr().out
