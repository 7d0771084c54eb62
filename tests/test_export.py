"""Exports of `qlightning train` and `qlightning export`: every artifact reloaded in a fresh process and run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from qlightning.run.parity import sqnr_db, top1_agreement

FORMATS = ("torchscript", "onnx", "pt2")
FILES = {"torchscript": "int8_net.pt", "onnx": "int8_net.onnx", "pt2": "int8_net.pt2"}


def qlightning(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qlightning.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "HYDRA_FULL_ERROR": "1"},
    )


@pytest.fixture(scope="module")
def run_dir(digits_fast_run) -> Path:
    """The shared 4-epoch `qlightning train recipe=digits_fast` run with the default export formats (conftest)."""
    return digits_fast_run


@pytest.fixture(scope="module")
def int8_reference(run_dir):
    """Digits images and the int8 model's outputs on them (the model rebuilt from the checkpoint)."""
    from sklearn.datasets import load_digits

    from qlightning import restore
    from qlightning.examples import DigitsClassifier

    model = restore(DigitsClassifier(), run_dir / "checkpoints" / "last.ckpt")
    images = torch.tensor(load_digits().images / 16.0, dtype=torch.float32).unsqueeze(1)
    with torch.no_grad():
        return images, model.net(images)


def test_default_job_writes_every_artifact_with_a_manifest(run_dir):
    report = json.loads((run_dir / "report.json").read_text())
    assert set(report["exports"]["net"]) == set(FORMATS)
    for fmt, name in FILES.items():
        art = report["exports"]["net"][fmt]
        assert art["error"] is None and art["path"] == name
        assert (run_dir / name).stat().st_size == art["size_bytes"] > 0
        manifest = json.loads((run_dir / f"{name}.json").read_text())
        assert manifest["format"] == fmt and manifest["file"] == name and manifest["backend"] == "x86"
        assert manifest["inputs"] == [{"name": "x", "shape": ["batch", 1, 8, 8], "dtype": "float32"}]
        assert manifest["outputs"] == [{"name": "output", "shape": ["batch", 10], "dtype": "float32"}]
        assert len(manifest["qparams"]["activations"]) == 8 and len(manifest["qparams"]["weights"]) == 4
        assert {w["layer"] for w in manifest["qparams"]["weights"]} == {"features.0.0", "features.1.0", "features.3.0", "classifier"}
        assert manifest["provenance"]["recipe"]["name"] == "digits_fast"
        assert manifest["provenance"]["trained_with"]["torch"] == manifest["provenance"]["exported_with"]["torch"] == torch.__version__
        assert manifest["provenance"]["quant"]["backend"] == "x86"
    assert report["parity"]["passed"] is True
    assert {Path(p).name for p in report["plots"].values()} >= {"per_layer_sqnr.png", "scale_evolution.png", "latency.png"}
    assert all((run_dir / p).is_file() for p in report["plots"].values())


FRESH = textwrap.dedent(
    """
    import sys, torch
    fmt, path, inputs, out = sys.argv[1:]
    x = torch.load(inputs)
    if fmt == "pt2":
        m = torch.export.load(path).module()
        run = lambda t: m(t)
    elif fmt == "torchscript":
        m = torch.jit.load(path)
        run = lambda t: m(t)
    else:
        import onnxruntime as ort
        s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        name = s.get_inputs()[0].name
        run = lambda t: torch.from_numpy(s.run(None, {name: t.numpy()})[0])
    with torch.no_grad():
        full, one = run(x), run(x[:1])  # dynamic batch: every image at once, then a single one
    loaded = sorted(m for m in sys.modules if m.startswith(("qlightning", "torch.ao.quantization.fx._decomposed")))
    torch.save({"full": full, "one": one, "modules": loaded}, out)
    """
)


@pytest.mark.parametrize("fmt", FORMATS)
def test_artifact_reloads_in_a_fresh_process_and_reproduces_int8(run_dir, int8_reference, tmp_path, fmt):
    images, expected = int8_reference
    torch.save(images, tmp_path / "inputs.pt")
    script = tmp_path / "fresh.py"
    script.write_text(FRESH)
    done = subprocess.run(
        [sys.executable, str(script), fmt, str(run_dir / FILES[fmt]), str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    assert got["modules"] == []  # plain torch / onnxruntime: no qlightning, no torch.ao q/dq ops needed
    assert got["full"].shape == expected.shape and got["one"].shape == (1, 10)
    assert sqnr_db(expected, got["full"]) >= 30.0
    assert top1_agreement(expected, got["full"]) >= 0.99
    assert sqnr_db(expected[:1], got["one"]) >= 30.0


def test_onnx_is_qdq_with_8_bit_weights_and_a_dynamic_batch(run_dir):
    """The weights are 8-bit initializers, stored unsigned (int8 + 128, zero point + 128: the same values)
    so that onnxruntime takes its u8u8 kernels, which do not saturate on CPUs without VNNI."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(run_dir / "int8_net.onnx"))
    ops = [n.op_type for n in model.graph.node]
    # one per activation, and x86's 0..127 (reduce_range) said explicitly: QuantizeLinear, DequantizeLinear,
    # Clip to 0..127, QuantizeLinear (the producer keeps its own quantize: onnxruntime fuses QLinearConv then)
    assert ops.count("Clip") == 8
    assert ops.count("QuantizeLinear") == 8 + 8
    assert ops.count("DequantizeLinear") == 12 + 8  # activations + the 4 weights, and one per Clip
    assert ops.count("Conv") == 3 and ("Gemm" in ops or "MatMul" in ops)
    weights = [i for i in model.graph.initializer if i.data_type == onnx.TensorProto.UINT8 and len(i.dims) >= 2]
    assert sorted(list(i.dims) for i in weights) == sorted([[16, 1, 3, 3], [32, 16, 3, 3], [64, 32, 3, 3], [10, 64]])
    assert not [i for i in model.graph.initializer if i.data_type == onnx.TensorProto.INT8 and len(i.dims) >= 2]
    zero_points = {n.input[2] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in {w.name for w in weights}}
    values = {name: numpy_helper.to_array(i) for i, name in ((i, i.name) for i in model.graph.initializer)}
    assert all((values[z] == 128).all() for z in zero_points)  # symmetric int8 weights: zero point 0 + 128
    batch = model.graph.input[0].type.tensor_type.shape.dim[0]
    assert batch.dim_param and not batch.dim_value


def test_pt2_with_quantized_decomposed_ops(run_dir, int8_reference, tmp_path):
    """export.pt2_ops=quantized_decomposed keeps the PT2E q/dq ops (for lowering); torch.ao must be imported to load it."""
    import torch.ao.quantization  # noqa: F401  registers quantized_decomposed

    from qlightning import QuantizationAwareTraining, restore
    from qlightning.engines import Inputs
    from qlightning.examples import DigitsClassifier
    from qlightning.run.export import export_module, load_artifact

    images, expected = int8_reference
    qat = QuantizationAwareTraining(modules=["net"])
    model = restore(DigitsClassifier(), run_dir / "checkpoints" / "last.ckpt", callback=qat)
    arts, _ = export_module(qat, model, "net", Inputs((images[:2],)), tmp_path, ["pt2"], pt2_ops="quantized_decomposed")
    assert arts[0].error is None, arts[0].error
    program = torch.export.load(str(arts[0].path))
    assert "quantized_decomposed.dequantize_per_channel" in str(program.graph)
    with torch.no_grad():
        assert sqnr_db(expected, load_artifact(arts[0].path, "pt2")(images)) >= 30.0


@pytest.mark.slow  # a full CLI run (quick suite under 10 minutes)
def test_export_and_report_commands(run_dir, tmp_path):
    out = qlightning("export", str(run_dir / "checkpoints" / "last.ckpt"), "--formats", "onnx,pt2", "--out", str(tmp_path / "exp"), "--no-report", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "parity net:           onnx vs int8" in out.stdout
    for name in ("int8_net.onnx", "int8_net.onnx.json", "int8_net.pt2", "int8_net.pt2.json", "report.json", "report.md"):
        assert (tmp_path / "exp" / name).is_file(), name
    exported = json.loads((tmp_path / "exp" / "report.json").read_text())
    assert exported["parity"]["passed"] and set(exported["exports"]["net"]) == {"onnx", "pt2"}

    # `qlightning report --write` renders report.md and the plots again from report.json (and the CSV log)
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("*.ckpt", "plots", "report.md"))
    again = qlightning("report", str(copy), "--write", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    text = (copy / "report.md").read_text()
    assert text.startswith("# qlightning report")
    for heading in ("## Exported artifacts", "## Parity", "## Per-layer SQNR", "## Size on disk and latency", "## Plots"):
        assert heading in text
    assert {p.name for p in (copy / "plots").iterdir()} == {"per_layer_sqnr.png", "scale_evolution.png", "latency.png"}


def test_export_command_errors(tmp_path, capsys):
    from qlightning.cli import main

    assert main(["export", str(tmp_path / "missing.ckpt")]) == 2
    assert "no such checkpoint" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2
    assert "no report.json" in capsys.readouterr().err


def test_bad_export_format_is_a_config_error(run_dir, capsys):
    from qlightning.cli import main

    assert main(["export", str(run_dir / "checkpoints" / "last.ckpt"), "--formats", "tflite"]) == 2
    assert "--formats: unknown format(s) ['tflite']; valid: ['torchscript', 'onnx', 'pt2']" in capsys.readouterr().err


def test_per_tensor_weights_export_to_onnx_and_pass_the_gate(tmp_path):
    """qnnpack's default qconfig quantizes weights per tensor: the ONNX exporter needs scalar q/dq params."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "qlightning.cli", "train", "recipe=digits_fast", "quant.backend=qnnpack",
         f"hydra.run.dir={tmp_path}/run", "trainer.enable_progress_bar=false", "report.latency_repeats=3"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["exports"]["net"]["onnx"]["error"] is None
    gated = [c for c in report["parity"]["checks"] if c["gated"]]
    assert gated and all(c["passed"] for c in gated)
