"""The parity gate and the extended report on a real (4-epoch) digits QAT run, in process."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from conftest import make_trainer
from qlightning import QuantizationAwareTraining
from qlightning.run import export as exporting
from qlightning.config.schema import section
from qlightning.run.artifacts import export_and_check
from qlightning.run.report import markdown_sections
from qlightning.examples import DigitsClassifier, DigitsDataModule
from qlightning.run.parity import ParityError, sqnr_db, top1_agreement

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
QUANTIZED_LAYERS = ["net.features.0.0", "net.features.1.0", "net.features.3.0", "net.classifier"]


@pytest.fixture(scope="module")
def qat_run():
    pl.seed_everything(0)
    dm = DigitsDataModule(seed=0)
    model = DigitsClassifier()
    qat = QuantizationAwareTraining(
        modules=["net"], fake_quant_start={"epoch": 1}, observer_freeze={"epoch": 3}, bn_freeze={"epoch": 3}
    )
    make_trainer([qat], max_epochs=4).fit(model, datamodule=dm)
    assert qat.converted
    return model, dm, qat


def configs(formats=("torchscript", "onnx", "pt2"), report=True, **parity):
    export_cfg = section(None, "export")
    export_cfg["formats"] = list(formats)
    parity_cfg = {**section(None, "parity"), **parity}
    report_cfg = {**section(None, "report"), "latency_repeats": 5, "enabled": report}
    return export_cfg, parity_cfg, report_cfg


@pytest.fixture(scope="module")
def report(qat_run, tmp_path_factory):
    model, dm, qat = qat_run
    out = tmp_path_factory.mktemp("run")
    extra = export_and_check(qat, model, dm, out, *configs())
    return out, extra


def png_contents(path: Path) -> list[str]:
    from PIL import Image

    with Image.open(path) as image:
        return json.loads(image.info["Contents"])


def check_png(path: Path, min_size: int = 200) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    pixels = matplotlib.image.imread(str(path))
    assert pixels.ndim == 3 and pixels.shape[0] >= min_size and pixels.shape[1] >= min_size
    assert pixels.std() > 0  # not a blank canvas


def test_sqnr_and_top1_agreement():
    x = torch.randn(100, 10, generator=torch.Generator().manual_seed(0))
    assert sqnr_db(x, x) == 200.0
    assert sqnr_db(x, x + 0.01 * x) == pytest.approx(40.0, abs=1e-6)
    assert sqnr_db(x, torch.zeros_like(x)) == pytest.approx(0.0, abs=1e-9)
    assert top1_agreement(x, x) == 1.0
    assert top1_agreement(x[:, 0], x[:, 0]) is None  # no class dimension


def test_gate_passes_and_report_has_every_part(report):
    out, extra = report
    parity = extra["parity"]
    assert parity["passed"] and not parity["breaches"]
    assert parity["samples"] == 270 and "test loader" in parity["inputs"]
    gated = {(c["candidate"], c["reference"]): c for c in parity["checks"] if c["gated"]}
    assert set(gated) == {("int8", "int8_reference"), ("torchscript", "int8"), ("onnx", "int8"), ("pt2", "int8")}
    for check in gated.values():
        assert check["sqnr_db"] >= 30 and check["top1_agreement"] >= 0.99, check
    info = {(c["candidate"], c["reference"]) for c in parity["checks"] if not c["gated"]}
    assert info == {("fake_quant", "trained_float"), ("int8", "trained_float"), ("int8", "fake_quant"), ("trained_float", "fp32")}

    names = [row["layer"] for row in extra["layers"]]
    assert set(QUANTIZED_LAYERS) <= set(names)
    assert names.index("net.features.0.0") < names.index("net.classifier")  # graph order
    assert len(extra["worst_layers"]) <= 3 and set(extra["worst_layers"]) <= set(names)
    for row in extra["layers"]:
        assert {"drift_sqnr_db", "fake_quant_vs_float_sqnr_db", "int8_vs_float_sqnr_db", "conversion_sqnr_db"} <= set(row)

    assert [w["layer"] for w in extra["ranges"]["weights"]] == QUANTIZED_LAYERS
    for w in extra["ranges"]["weights"]:
        assert w["dtype"] == "qint8" and w["min"] < 0 < w["max"] and 0 < w["scale_min"] <= w["scale_max"]
    acts = extra["ranges"]["activations"]
    after = [a["after"] for a in acts]
    assert after[0] == "input x" and after[-1] == "net.classifier" and "net.features.0.0" in after
    assert all(0.0 <= a["clipped_int8"] <= a["clipped_fake_quant"] <= 1.0 for a in acts)

    latency = extra["latency_detail"]["ms"]["net"]
    assert set(latency) == {"fp32", "int8", "torchscript", "onnx", "pt2"}
    assert extra["latency_ms"] == {v: latency[v]["32"] for v in ("fp32", "int8")}  # the headline: the same numbers
    assert all(set(by_batch) == {"1", "32"} and min(by_batch.values()) > 0 for by_batch in latency.values())
    sizes = extra["size_on_disk"]["net"]
    assert sizes["int8"] < 0.4 * sizes["fp32"]
    assert all(sizes[f] == (out / extra["exports"]["net"][f]["path"]).stat().st_size for f in ("torchscript", "onnx", "pt2"))

    text = markdown_sections(extra)
    for heading in ("## Exported artifacts", "## Parity", "## Per-layer SQNR", "## Weight ranges", "## Activation ranges", "## Size on disk and latency"):
        assert heading in text
    assert all(f"`{w}`" in text for w in extra["worst_layers"])
    json.dumps(extra, allow_nan=False)  # plain JSON: no NaN / Infinity


def test_plots_are_pngs_with_the_expected_layers(report):
    out, extra = report
    assert set(extra["plots"]) >= {"per_layer_sqnr", "latency"}
    layers_png = out / extra["plots"]["per_layer_sqnr"]
    check_png(layers_png)
    assert png_contents(layers_png) == [row["layer"] for row in extra["layers"]]
    latency_png = out / extra["plots"]["latency"]
    check_png(latency_png)
    assert png_contents(latency_png) == ["float", "int8", "torchscript", "onnx", "pt2"]


def test_scale_evolution_plot_from_csv_metrics(tmp_path):
    from qlightning.run import plots

    rows = ["epoch,step,qat/fake_quant,qat/observe,qat/bn_frozen,qat/scale/net.activation_post_process_1,train/loss"]
    for step in range(0, 60, 5):
        rows.append(f"{step // 20},{step},{float(step >= 20)},{float(step < 40)},{float(step >= 40)},{0.05 / (1 + step / 30):.5f},0.5")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "metrics.csv").write_text("\n".join(rows) + "\n")
    made = plots.render({}, tmp_path)
    assert set(made) == {"scale_evolution"}
    path = tmp_path / made["scale_evolution"]
    check_png(path)
    assert png_contents(path) == ["bn_frozen", "fake_quant", "observe", "net.activation_post_process_1"]
    # with the report's activation ranges the legend names the module the observer follows
    named = plots.render({"ranges": {"activations": [{"after": "net.features.0.0", "observer": "net.activation_post_process_1"}]}}, tmp_path)
    assert png_contents(tmp_path / named["scale_evolution"])[-1] == "after net.features.0.0"


@pytest.fixture
def corrupted_scale(qat_run):
    """The int8 model's input scale / 10: a broken conversion (inputs saturate, every layer is off)."""
    model = qat_run[0]
    scale = model.net.features_0_0_input_scale_0
    original = scale.clone()
    scale.mul_(0.1)
    yield
    scale.copy_(original)


def test_broken_conversion_trips_the_gate(qat_run, corrupted_scale, tmp_path):
    model, dm, qat = qat_run
    with pytest.raises(ParityError) as info:
        export_and_check(qat, model, dm, tmp_path, *configs(formats=("pt2",), report=False), base_report={"modules": ["net"]})
    message = str(info.value)
    assert "net: int8 vs int8_reference: SQNR" in message and "parity.min_sqnr_db" in message
    assert "net: pt2 vs int8" in message  # the artifact (built from the QAT model) no longer matches int8
    worst = next(line for line in message.splitlines() if "worst layers (int8 vs its float-simulated reference)" in line)
    assert "net.features.0.0" in worst
    assert "first layer where int8 departs from its float-simulated reference (graph order): net.features.0.0" in message
    written = json.loads((tmp_path / "report.json").read_text())  # the run directory explains the failure
    assert written["parity"]["passed"] is False and written["modules"] == ["net"]
    assert len(written["parity"]["breaches"]) == 2


def test_breach_names_the_broken_layer_and_can_warn(qat_run, tmp_path):
    model, dm, qat = qat_run
    conv = model.net.get_submodule("features.1.0")
    original = conv.scale
    conv.scale = original * 0.1  # the output (requantization) scale of one layer: its outputs saturate
    try:
        with pytest.warns(UserWarning, match="parity gate: 1 breach"):
            extra = export_and_check(qat, model, dm, tmp_path, *configs(formats=(), report=False, on_breach="warn"))
    finally:
        conv.scale = original
    assert extra["parity"]["passed"] is False
    conversion = {row["layer"]: row["conversion_sqnr_db"] for row in extra["layers"]}
    # the untouched layer before the broken one: its int8 outputs are the fake-quant ones bit for bit on AVX2 and Xeon
    # CPUs (>= 100 dB); on an AMD EPYC with AVX-512 (stop 52) a few differ by one step (78.7 dB)
    assert conversion["net.features.0.0"] >= 60
    assert conversion["net.features.1.0"] < 30
    assert "(graph order): net.features.1.0" in extra["parity"]["message"]


def test_clipping_artifact_is_caught(qat_run, tmp_path, monkeypatch):
    """A .pt2 whose activations fill 0..255 (the q/dq widened without the clamp) while int8 clamps to the
    trained [0, 127], as every artifact did before convert clamped: the gate sees it."""
    model, dm, qat = qat_run
    from qlightning.engines.fx.reference import full_range_activations
    from qlightning.quantize import qdq

    monkeypatch.setattr(qdq, "explicit_activation_clamps", full_range_activations)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        extra = export_and_check(qat, model, dm, tmp_path, *configs(formats=("pt2",), report=False, on_breach="warn"))
    failed = {(c["candidate"], c["reference"]) for c in extra["parity"]["checks"] if c["gated"] and not c["passed"]}
    assert ("pt2", "int8") in failed


def test_report_written_before_the_run_ends_has_no_made_up_wall_time():
    """A failing gate writes report.md before the run's wall time exists: the sentence is left out, not 'nan'."""
    from qlightning.run.report import to_markdown

    report = {
        "modules": ["net"], "engine": "fx", "backend": "x86",
        "metrics": {"fp32": {"acc": 0.98}, "int8": {"acc": 0.97}},
        "size_bytes": {"fp32": 4096, "int8": 1024},
        "latency_ms": {"fp32": 2.0, "int8": 1.0}, "latency_batch_size": 32, "latency_threads": 2,
    }
    assert "| fp32 | 0.9800 |" in to_markdown(report)  # an older report.json without labels: the keys
    assert "nan" not in to_markdown(report) and "Wall time" not in to_markdown(report)
    assert "Wall time of the run: 12.5 s." in to_markdown({**report, "wall_s": 12.5})


# ---------------------------------------------------------------------------------------------- what the report means (issue 16)


@pytest.fixture(scope="module")
def full_report(qat_run, report):
    """report.json as `qlightning train` writes it: the evaluation of every variant, then exports and gate."""
    from qlightning.run.report import build_report, evaluation_trainer

    model, dm, qat = qat_run
    return {**build_report(qat, model, dm, evaluation_trainer), **report[1]}


def test_float_rows_say_what_they_are(full_report, capsys):
    """The 'fp32' row is the snapshot at fake-quant start (after 1 float epoch), labelled so everywhere;
    the QAT-trained weights with fake-quant off are their own row."""
    from qlightning.run.report import print_table, to_markdown

    labels, metrics = full_report["labels"], full_report["metrics"]
    assert labels["fp32"] == f"float snapshot (at fake-quant start, step {full_report['float_snapshot_step']})"
    assert full_report["float_snapshot_step"] > 0
    assert labels["trained_float"] == "float, QAT-trained weights (fake-quant off)"
    assert metrics["trained_float"] != metrics["fp32"]  # other weights
    text = to_markdown(full_report)
    table = text.split("\n\n")[2]
    assert "| fp32 |" not in table and f"| {labels['fp32']} |" in table and f"| {labels['trained_float']} |" in table
    assert "Not a float baseline" in text
    print_table(full_report)
    out = capsys.readouterr().out
    assert "float snapshot" in out and "QAT-trained" in out and "not a float baseline" in out


def test_per_layer_quantization_error_is_against_the_same_weights(qat_run, full_report):
    """The quantization column is int8 against the final weights run in float (fake-quant off), on the same
    inputs; drift (trained float against the snapshot) is a column of its own."""
    from qlightning.core.inputs import source_of
    from qlightning.run.parity import capture_heldout, per_layer_sqnr
    from qlightning.run.report import evaluation_trainer

    model, dm, qat = qat_run
    same_weights = qat.session.variants(model)["trained_float"]["net"]
    batches = [tuple(i.args) for i in capture_heldout(model, dm, ["net"], 2, evaluation_trainer)["net"]]
    expected = per_layer_sqnr("net", {"int8": source_of(model.net), "float": same_weights}, batches, (("db", "int8", "float"),))
    layers = {row["layer"]: row for row in full_report["layers"]}
    for row in expected:
        assert layers[row["layer"]]["int8_vs_float_sqnr_db"] == pytest.approx(row["db"], abs=0.01), row
    assert any(abs(r["drift_sqnr_db"] - r["int8_vs_float_sqnr_db"]) > 3 for r in layers.values())
    worst = full_report["worst_layers"]
    assert all(layers[w]["int8_vs_float_sqnr_db"] < 20 for w in worst) and len(worst) <= 3
    ranked = sorted(layers, key=lambda n: layers[n]["int8_vs_float_sqnr_db"])
    assert worst == [n for n in ranked[:3] if layers[n]["int8_vs_float_sqnr_db"] < 20]
    assert "below 20 dB" in full_report["worst_layers_rule"]
    assert all(0.0 <= w["clipped"] <= 1.0 for w in full_report["ranges"]["weights"])


def test_clipping_is_counted_after_the_fused_relu(full_report):
    acts = {a["after"]: a for a in full_report["ranges"]["activations"]}
    first = acts["net.features.0.0"]  # conv-bn-relu: the fake-quant after it applies the ReLU (FX fast path)
    assert first["activation_applied"] and first["observed"][0] >= 0.0
    assert first["clipped_fake_quant"] < 0.05, first  # ReLU's negatives are not clipping
    assert acts["net.classifier"]["observer"].startswith("net.activation_post_process_")


def test_latency_is_one_measurement_shown_alike(full_report):
    from qlightning.run.report import to_markdown

    detail = full_report["latency_detail"]["ms"]["net"]
    assert full_report["latency_ms"] == {"fp32": detail["fp32"]["32"], "int8": detail["int8"]["32"]}
    text = to_markdown(full_report)
    ratio = detail["fp32"]["32"] / detail["int8"]["32"]
    assert (f"{ratio:.2f}x faster at batch 32" if ratio >= 1 else f"{1 / ratio:.2f}x slower at batch 32") in text
    assert f"{detail['int8']['32']:.3f}" in text.split("## Size on disk and latency")[1]


def test_report_markdown_explains_columns_and_clipping(full_report):
    from qlightning.run.report import to_markdown

    text = to_markdown(full_report)
    layers = text.split("## Per-layer SQNR")[1].split("##")[0]
    assert "quantization: int8 vs float, same weights (dB)" in layers and "drift: trained float vs snapshot (dB)" in layers
    assert "Flagged (" in layers or "No layer flagged (" in layers
    acts = text.split("## Activation ranges")[1].split("##")[0]
    assert "(+ fused ReLU)" in acts and "a fused ReLU's negatives are removed by the ReLU, not clipped" in acts
    assert "observer_freeze" in acts


def test_report_command_is_read_only_unless_write(full_report, tmp_path, capsys):
    from qlightning.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "report.json").write_text(json.dumps({k: v for k, v in full_report.items() if k != "plots"}, indent=2, sort_keys=True))
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in run.iterdir()}
    assert main(["report", str(run)]) == 0
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in run.iterdir()} == before  # nothing new, nothing changed
    out = capsys.readouterr().out
    assert "nothing written" in out and "float snapshot" in out
    assert main(["report", str(run), "--write"]) == 0
    assert (run / "report.md").read_text().startswith("# qlightning report")
    assert json.loads((run / "report.json").read_text())["plots"]  # the plots it made are listed


def test_sweep_table_names_the_float_snapshot(tmp_path):
    from qlightning.cli.sweep import comparison_table

    report = {
        "labels": {"fp32": "float snapshot (at fake-quant start, step 20)"},
        "metrics": {"fp32": {"accuracy": 0.46}, "int8": {"accuracy": 0.99}},
        "size_bytes": {"fp32": 4096, "int8": 1024}, "latency_ms": {"int8": 1.0},
    }
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "report.json").write_text(json.dumps(report))
    table = comparison_table(tmp_path)
    assert "| float snapshot accuracy |" in table and "fp32" not in table and "| nan |" in table
