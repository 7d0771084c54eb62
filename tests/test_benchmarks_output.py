"""Benchmarks write a new results file unless asked; the README's table is generated from the committed one.

No benchmark runs here: ``run_table`` is replaced by the committed quick results.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import benchmarks.__main__ as bench
from benchmarks import readme

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def results_dir(tmp_path, monkeypatch):
    """A results folder holding copies of the committed files, and a ``run_table`` that measures nothing."""
    committed = ROOT / "benchmarks" / "results"
    for name in ("quick.json", "quick.md", "latest.json", "latest.md"):
        (tmp_path / name).write_bytes((committed / name).read_bytes())
    canned = json.loads((committed / "quick.json").read_text())
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    monkeypatch.setattr(bench, "run_table", lambda args: canned)
    threads = torch.get_num_threads()
    yield tmp_path
    torch.set_num_threads(threads)  # main() sets the benchmark's thread count for the whole process


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.iterdir()}


def test_quick_run_writes_a_new_file_and_keeps_the_committed_ones(results_dir, capsys):
    before = snapshot(results_dir)
    bench.main(["--quick"])
    after = snapshot(results_dir)
    assert {k: after[k] for k in before} == before  # committed files: same bytes, same mtime
    new = sorted(set(after) - set(before))
    assert len(new) == 2 and all(n.startswith("quick-") for n in new), new
    assert {Path(n).suffix for n in new} == {".json", ".md"}
    assert json.loads((results_dir / next(n for n in new if n.endswith(".json"))).read_text())["machine"]["quick"]


def test_existing_output_is_refused_unless_overwrite(results_dir, tmp_path):
    before = snapshot(results_dir)
    with pytest.raises(SystemExit, match="--overwrite"):
        bench.main(["--quick", "--out", str(results_dir / "quick")])
    assert snapshot(results_dir) == before
    bench.main(["--quick", "--overwrite"])  # asked: replaces results/quick.{md,json}
    assert snapshot(results_dir)["quick.json"][1] != before["quick.json"][1]
    assert snapshot(results_dir)["latest.json"] == before["latest.json"]
    out = tmp_path / "elsewhere" / "run1"
    bench.main(["--quick", "--output", str(out)])
    assert out.with_suffix(".json").is_file() and out.with_suffix(".md").is_file()


def test_readme_table_is_generated_from_the_committed_results():
    text = (ROOT / "README.md").read_text()
    results = json.loads(readme.RESULTS_FILE.read_text())
    compiled = json.loads(readme.COMPILE_FILE.read_text())
    steps = json.loads(readme.STEPS_FILE.read_text())
    peers = json.loads(readme.PEERS_FILE.read_text())
    sources = ("benchmarks/results/latest.json, benchmarks/results/compile.json, benchmarks/results/steps.json and "
               "benchmarks/results/peers.json")
    assert readme.readme_block(text) == readme.block(results, sources, compiled, steps, peers), (
        f"README's benchmarks table differs from {sources}: run `python -m benchmarks readme --write`"
    )


def test_readme_table_marks_missing_figures(tmp_path):
    results = json.loads(readme.RESULTS_FILE.read_text())
    full_row = next(row for row in readme.table(results).splitlines() if row.startswith("| QAT train step / float step: torch.ao FX |"))
    del results["models"][readme.COLUMNS[-1][0]]  # the last column's model
    del results["scaling"]
    table = readme.table(results)
    assert full_row.rsplit("|", 2)[0] + "| n/a |" in table  # the other models' figures kept, the missing one marked
    assert "prepare + convert" not in table
    readme_file = tmp_path / "README.md"
    readme_file.write_text("intro\n\n" + readme.block({"models": {}}, "x.json") + "\n\nafter\n")
    readme.main(readme.RESULTS_FILE, write=True, readme=readme_file)
    assert readme_file.read_text().startswith("intro\n\n") and readme_file.read_text().endswith("\n\nafter\n")
    assert readme.readme_block(readme_file.read_text()) == readme.block(
        json.loads(readme.RESULTS_FILE.read_text()),
        "benchmarks/results/latest.json, benchmarks/results/compile.json, benchmarks/results/steps.json and "
        "benchmarks/results/peers.json",
        json.loads(readme.COMPILE_FILE.read_text()), json.loads(readme.STEPS_FILE.read_text()),
        json.loads(readme.PEERS_FILE.read_text()))
    compiled = json.loads(readme.COMPILE_FILE.read_text())
    del compiled["models"]["transformer"]
    cold = [" + ".join(f"{compiled['models'][m]['first_two_steps_s'][k]:.0f}" for k in
                       ("qlightning FX compiled", "qlightning FX compiled, frozen")) + " s" for m in ("digits_cnn", "resnet18_like")]
    assert f"| ... its compiles, observing + frozen graphs (cold cache) | {cold[0]} | {cold[1]} | n/a |" in readme.table(results, compiled)


def test_readme_steps_rows_come_from_the_steps_file_and_mark_a_missing_model():
    results = json.loads(readme.RESULTS_FILE.read_text())
    steps = json.loads(readme.STEPS_FILE.read_text())
    batches = list(steps["models"]["digits_cnn"]["batches"])
    label = "| ... qlightning FX, observers and BatchNorm frozen |"
    row = next(r for r in readme.table(results, None, steps).splitlines() if r.startswith(label))
    expected = " / ".join(f"{steps['models']['digits_cnn']['batches'][b]['over_float']['qlightning FX, frozen']:.2f}x" for b in batches)
    assert row.startswith(f"{label} {expected} |"), row
    del steps["models"]["mobilenet_v2_like"]
    row = next(r for r in readme.table(results, None, steps).splitlines() if r.startswith(label))
    assert row.endswith("| n/a |") and row.count(" / ") == 3 * (len(batches) - 1), row
    assert label not in readme.table(results)  # no steps file: no rows


def test_peers_harness_times_every_variant_or_names_why_not(monkeypatch):
    """``python -m benchmarks peers`` on the digits CNN, 2 repeats: every installed peer gets a ratio and a description
    of what its step does, a missing one says how to install it, and a peer that fails on a model is recorded, not
    raised (a builder that raises stands in for a peer that cannot take the model)."""
    from benchmarks import peers
    from benchmarks.models import model_spec

    def cannot(model, x, calib):
        raise RuntimeError("cannot trace this model\nsecond line")

    monkeypatch.setitem(peers.BUILDERS, "Brevitas", cannot)
    monkeypatch.setattr(peers, "version", lambda peer: None if peer == "NNCF" else "1.0")
    monkeypatch.setitem(peers.BUILDERS, "ModelOpt", lambda model, x, calib: model)  # no fake-quant at all
    figures = peers.peer_step_ratios(model_spec("digits_cnn"), repeats=2, clock="cpu")
    assert figures["errors"]["NNCF"].startswith("not installed (pip install nncf")
    assert figures["errors"]["Brevitas"] == "RuntimeError: cannot trace this model"
    assert set(figures["over_float"]) == {"torch.ao FX", "qlightning FX", "qlightning FX, frozen",
                                          "torchao PT2E by hand", "ModelOpt"}
    assert all(ratio > 0 for ratio in figures["over_float"].values())
    described = figures["described"]
    assert described["ModelOpt"] == {"quantizer_tensors_moved": [], "quantizer_parameters_trained": []}  # float itself
    for name in ("torch.ao FX", "qlightning FX", "torchao PT2E by hand"):
        assert {"min_val", "max_val"} <= set(described[name]["quantizer_tensors_moved"]), name  # observers move
    assert described["qlightning FX, frozen"]["quantizer_tensors_moved"] == []


def test_readme_peers_rows_come_from_the_peers_file():
    results = json.loads(readme.RESULTS_FILE.read_text())
    peers = json.loads(readme.PEERS_FILE.read_text())
    digits = peers["models"]["digits_cnn"]
    row = next(r for r in readme.table(results, None, None, peers).splitlines() if r.startswith("| ... NNCF |"))
    assert row.startswith(f"| ... NNCF | {digits['over_float']['NNCF']:.2f}x |"), row
    digits["errors"]["NNCF"] = "RuntimeError: x"
    row = next(r for r in readme.table(results, None, None, peers).splitlines() if r.startswith("| ... NNCF |"))
    assert row.startswith("| ... NNCF | fails |"), row
    assert "NNCF" not in readme.table(results)  # no peers file: no rows
