"""Float vs fake-quant vs int8: quality on the test set, size on disk, latency.

The variants (keys of ``metrics``; ``labels`` holds what each is, in words, and every table prints
those labels, not the keys):

* ``fp32``: for QAT, the *float snapshot*: the weights when fake-quant first turned on (the end of
  the float warm-up, kept in checkpoints), run in float. It is not a float baseline: after a short
  warm-up it is far below the trained model. For PTQ, the float model that was converted.
* ``trained_float`` (QAT with a snapshot): the final, QAT-trained weights run with fake-quant off.
  The same weights as ``fake_quant`` and ``int8``, so the gap to them is what quantization costs;
  these weights were trained for quantization (not a float model trained as long).
* ``ptq``: post-training quantization of the snapshot (a baseline, when asked for).
* ``fake_quant``: what training and validation saw; ``int8``: the converted model.
"""

from __future__ import annotations

import io
import json
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import lightning.pytorch as pl
import torch
from torch import nn

from qlightning.core.inputs import Inputs, input_hooks
from qlightning.core.quiet import quiet
from qlightning.core.session import QuantSession, session_of, set_submodule

VARIANTS = ("fp32", "trained_float", "ptq", "fake_quant", "int8")

#: the rule that names a layer among the worst (stated in report.md)
WORST_LAYERS_MAX = 3
WORST_LAYERS_BELOW_DB = 20.0
WORST_LAYERS_RULE = (
    f"the up to {WORST_LAYERS_MAX} layers with the lowest int8-vs-float SQNR (same weights) that are below "
    f"{WORST_LAYERS_BELOW_DB:g} dB"
)
#: a share of clipped weights or activations above this is flagged (bold) in report.md
CLIPPED_HIGH = 0.05


def variant_labels(session: QuantSession, versions: Iterable[str]) -> dict[str, str]:
    """What each variant of the report is, in words (the row names of every table and plot).

    Args:
        session: the quantization session the variants come from.
        versions: the variants' keys (fp32, ptq, fake_quant, int8, ...).
    """
    session = session_of(session)
    if session.kind == "ptq":
        fp32 = "float (the model before conversion)"
    elif session.float_snapshot is not None:
        step = "" if session.float_snapshot_step is None else f", step {session.float_snapshot_step}"
        fp32 = f"float snapshot (at fake-quant start{step})"
    else:
        fp32 = "float (final weights, fake-quant off)"
    labels = {
        "fp32": fp32,
        "trained_float": "float, QAT-trained weights (fake-quant off)",
        "ptq": "PTQ of the float snapshot",
        "fake_quant": "fake-quant (training, validation)",
        "int8": "int8 (converted)",
    }
    return {k: v for k, v in labels.items() if k in set(versions)}


def label(report: dict[str, Any], variant: str) -> str:
    """The label of ``variant`` in ``report`` (older reports without ``labels``: the key itself).

    Args:
        report: a report (report.json's content).
        variant: a variant's key.
    """
    return (report.get("labels") or {}).get(variant, variant)


def flag_worst_layers(layers: Sequence[dict[str, Any]], column: str = "int8_vs_float_sqnr_db") -> list[str]:
    """The layers that are genuinely bad, by :data:`WORST_LAYERS_RULE` (lowest first).

    Args:
        layers: per-layer rows of the report.
        column: the SQNR column to judge by.
    """
    rows = sorted((row[column], row["layer"]) for row in layers if row.get(column) is not None)
    return [name for value, name in rows[:WORST_LAYERS_MAX] if value < WORST_LAYERS_BELOW_DB]


def state_dict_bytes(module: nn.Module, skip: Iterable[str] = ()) -> int:
    """Serialized size of a module's state dict, leaving out the keys in ``skip``.

    Args:
        module: the module to measure.
        skip: state dict keys left out.
    """
    skip = set(skip)
    buffer = io.BytesIO()
    torch.save({k: v for k, v in module.state_dict().items() if k not in skip}, buffer)
    return buffer.getbuffer().nbytes


def evaluation_trainer(limit_test_batches: Any = None) -> pl.Trainer:
    """A bare CPU Trainer for the report's and the parity gate's ``trainer.test`` runs.

    Args:
        limit_test_batches: the Trainer's ``limit_test_batches`` (``None``: all).
    """
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_test_batches=limit_test_batches,
    )


def quiet_lightning() -> Any:
    """Silence Lightning's per-Trainer banners (GPU/TPU available, tips) for the report's evaluations."""
    return quiet(loggers=("lightning.pytorch.utilities.rank_zero",), level=logging.WARNING)


@contextmanager
def swapped(pl_module: pl.LightningModule, modules: dict[str, nn.Module]) -> Iterator[None]:
    """Temporarily put other versions of submodules into the LightningModule.

    Args:
        pl_module: the LightningModule.
        modules: ``{submodule name: module}`` to put in meanwhile.
    """
    originals = {name: pl_module.get_submodule(name) for name in modules}
    try:
        for name, module in modules.items():
            set_submodule(pl_module, name, module)
        yield
    finally:
        for name, module in originals.items():
            set_submodule(pl_module, name, module)


def evaluate(
    trainer_factory: Callable[[], pl.Trainer],
    pl_module: pl.LightningModule,
    datamodule: Any,
    versions: dict[str, dict[str, nn.Module]],
) -> tuple[dict[str, dict[str, float]], dict[str, Inputs]]:
    """Run ``trainer.test`` once per variant; returns metrics per variant and real test inputs per target.

    Args:
        trainer_factory: makes the Trainer of each ``trainer.test`` run.
        pl_module: the LightningModule.
        datamodule: the data whose test loader is used.
        versions: ``{variant: {submodule name: module}}``.
    """
    metrics: dict[str, dict[str, float]] = {}
    seen: dict[str, Inputs] = {}
    def grab(name: str, inputs: Inputs) -> None:
        seen.setdefault(name, Inputs(tuple(a.detach() if torch.is_tensor(a) else a for a in inputs.args), inputs.kwargs))

    for variant, modules in versions.items():
        with input_hooks(modules if not seen else {}, grab), swapped(pl_module, modules), quiet_lightning():
            results = trainer_factory().test(pl_module, datamodule=datamodule, verbose=False)
        logged = results[0] if results else {}
        metrics[variant] = {key.split("/", 1)[-1].removeprefix("test_"): float(value) for key, value in logged.items()}
    return metrics, seen


def build_report(
    session: QuantSession,
    pl_module: pl.LightningModule,
    datamodule: Any,
    trainer_factory: Callable[[], pl.Trainer],
    batch_size: int = 32,
    repeats: int = 30,
    threads: Optional[int] = None,
) -> dict[str, Any]:
    """Test metrics of every variant, sizes and the variants' labels.

    Latency is not measured here: :func:`qlightning.run.artifacts.export_and_check` measures every
    model once (blocks of calls taken in turn), and fills ``latency_ms`` (the headline) from that measurement.
    ``batch_size``, ``repeats`` and ``threads`` are recorded as the settings of that measurement.

    Args:
        session: the quantization session (or a callback holding one).
        pl_module: the LightningModule.
        datamodule: the data whose test loader is used.
        trainer_factory: makes the Trainer of each ``trainer.test`` run.
        batch_size: the latency measurement's batch, recorded.
        repeats: the latency measurement's repeats, recorded.
        threads: the latency measurement's threads, recorded.
    """
    session = session_of(session)
    versions = session.variants(pl_module)
    metrics, _ = evaluate(trainer_factory, pl_module, datamodule, versions)
    # fp32 size: the float weights alone, without the observer / fake-quant state QAT added
    size = {
        "fp32": sum(
            state_dict_bytes(m, skip=(n for n, _ in session.engine.quant_state(m))) for m in versions["fp32"].values()
        ),
        "int8": sum(state_dict_bytes(m) for m in versions["int8"].values()),
    }
    if "ptq" in versions:
        size["ptq"] = sum(state_dict_bytes(m) for m in versions["ptq"].values())
    return {
        "fp32_is": session.fp32_is,
        "labels": variant_labels(session, versions),
        "float_snapshot_step": session.float_snapshot_step,
        "fidelity": dict(session.fidelity_results),
        "notices": list(session.notices),
        "engine_notes": list(session.engine_notes),
        "modules": list(session.targets),
        "engine": session.engine.name,
        "lowering": dict(session.lowering_choices),
        "compiled_training": session.compile_choice,  # engine_options.compile: what was decided and why
        "backend": session.backend,
        "metrics": metrics,
        "size_bytes": size,
        "latency_ms": {},
        "latency_batch_size": batch_size,
        "latency_repeats": repeats,
        "latency_threads": threads or torch.get_num_threads(),
    }


def _size_cell(report: dict[str, Any], variant: str, none: str = "") -> str:
    size = report["size_bytes"].get(variant)
    if size is not None:
        return f"{size / 1024:.1f}"
    return none if variant in ("trained_float", "fake_quant") else ""


def _latency_cell(report: dict[str, Any], variant: str, none: str = "") -> str:
    lat = (report.get("latency_ms") or {}).get(variant)
    if lat is not None:
        return f"{lat:.3f}"
    return none if variant == "trained_float" else ""  # fake-quant latency is not measured


def headline(report: dict[str, Any]) -> str:
    """One sentence: how much smaller and faster int8 is than float, from the one latency measurement.

    Args:
        report: a report (report.json's content).
    """
    size, lat = report["size_bytes"], report.get("latency_ms") or {}
    parts = []
    if size.get("fp32") and size.get("int8"):
        parts.append(f"{size['fp32'] / size['int8']:.2f}x smaller (state dict)")
    if lat.get("fp32") and lat.get("int8"):
        ratio = lat["fp32"] / lat["int8"]
        speed = f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"
        parts.append(
            f"{speed} at batch {report['latency_batch_size']}, "
            f"{report['latency_threads']} thread(s) (medians of one measurement, the same numbers as "
            "the latency table below)"
        )
    if not parts:
        return ""
    return "int8 is " + " and ".join(parts) + " than float (same architecture, eager)."


def to_markdown(report: dict[str, Any]) -> str:
    """report.md: the metrics of every variant, with the legend and the sections of :func:`markdown_sections`.

    Args:
        report: a report (report.json's content).
    """
    metric_names = sorted({k for m in report["metrics"].values() for k in m})
    lines = [
        f"# qlightning report",
        "",
        f"Quantized modules: {', '.join(report['modules'])} · engine {report['engine']} · backend {report['backend']}",
        "",
        "| model | " + " | ".join(metric_names) + " | size (KiB) | latency (ms, batch "
        + f"{report['latency_batch_size']}, {report['latency_threads']} threads) |",
        "|---|" + "---|" * (len(metric_names) + 2),
    ]
    for variant in (v for v in VARIANTS if v in report["metrics"]):
        values = report["metrics"].get(variant, {})
        cells = [f"{values[m]:.4f}" if m in values else "" for m in metric_names]
        cells.append(_size_cell(report, variant, "(as float)"))
        cells.append(_latency_cell(report, variant, "(as float)"))
        lines.append(f"| {label(report, variant)} | " + " | ".join(cells) + " |")
    sentence = headline(report)
    # a failing parity gate writes the report before the run's end, so there is no wall time yet
    wall = f" Wall time of the run: {report['wall_s']:.1f} s." if "wall_s" in report else ""
    lines += ["", (sentence + wall).strip(), ""]
    lines += [f"- {row}" for row in legend(report)]
    return "\n".join(lines) + "\n" + markdown_sections(report)


def legend(report: dict[str, Any]) -> list[str]:
    """What each row of the first table is, one line each.

    Args:
        report: a report (report.json's content).
    """
    metrics = report["metrics"]
    out = []
    if "fp32" in metrics:
        if "trained_float" in metrics or "snapshot" in label(report, "fp32"):
            out.append(
                f"{label(report, 'fp32')}: the weights when fake-quant first turned on (end of the float warm-up), "
                "run in float. Not a float baseline: training went on after it."
            )
        else:
            out.append(f"{label(report, 'fp32')}: {report.get('fp32_is', 'the float model')}.")
    if "trained_float" in metrics:
        out.append(
            f"{label(report, 'trained_float')}: the final weights with quantization off, the same weights as "
            "fake-quant and int8: the gap to them is what quantization costs (the weights were trained for "
            "quantization; this is not a float model trained as long)."
        )
    if "ptq" in metrics:
        out.append(f"{label(report, 'ptq')}: post-training quantization of the float snapshot (a baseline).")
    if "fake_quant" in metrics:
        out.append(f"{label(report, 'fake_quant')}: the model training and validation ran (quantization simulated).")
    return out


def write(report: dict[str, Any], run_dir: Path) -> None:
    """Write report.json and report.md into ``run_dir``.

    Args:
        report: the report.
        run_dir: the run's folder (made if missing).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True))
    (run_dir / "report.md").write_text(to_markdown(report))


def print_table(report: dict[str, Any]) -> None:
    """Print the report's metrics table to the terminal (rich).

    Args:
        report: a report (report.json's content).
    """
    from rich.console import Console
    from rich.table import Table

    metric_names = sorted({k for m in report["metrics"].values() for k in m})
    table = Table(title=f"qlightning · {report['engine']} · {report['backend']}")
    table.add_column("model")
    for m in metric_names:
        table.add_column(m, justify="right")
    table.add_column("size KiB", justify="right")
    table.add_column(f"ms/batch {report['latency_batch_size']}", justify="right")
    for variant in (v for v in VARIANTS if v in report["metrics"]):
        values = report["metrics"].get(variant, {})
        table.add_row(
            label(report, variant),
            *[f"{values[m]:.4f}" if m in values else "" for m in metric_names],
            _size_cell(report, variant),
            _latency_cell(report, variant),
        )
    console = Console()
    console.print(table)
    if "trained_float" in report["metrics"]:
        console.print(f"{label(report, 'fp32')} is not a float baseline; {label(report, 'trained_float')} has the int8 model's weights.")


# ---------------------------------------------------------------------------------------------- markdown: exports, parity, per-layer SQNR, ranges, latency, plots

SECTION_MARK = "## Exported artifacts"


def _fmt(value: Any, spec: str = ".1f", none: str = "") -> str:
    if value is None:
        return none
    return format(value, spec)


def _variant_name(report: dict[str, Any], variant: str) -> str:
    """The float row of the size/latency tables is the architecture's float cost, whichever weights it has."""
    return "float" if variant == "fp32" else label(report, variant)


#: per-layer columns: (key, header)
LAYER_COLUMNS = (
    ("int8_vs_float_sqnr_db", "quantization: int8 vs float, same weights (dB)"),
    ("fake_quant_vs_float_sqnr_db", "fake-quant vs float, same weights (dB)"),
    ("drift_sqnr_db", "drift: trained float vs snapshot (dB)"),
    ("conversion_sqnr_db", "conversion: int8 vs reference (dB)"),
)


def per_layer_lines(report: dict[str, Any]) -> list[str]:
    """The per-layer SQNR table of report.md, with what its columns measure and which layers are flagged.

    Args:
        report: a report (report.json's content).
    """
    layers = report.get("layers") or []
    columns = [(k, h) for k, h in LAYER_COLUMNS if any(row.get(k) is not None for row in layers)]
    worst = report.get("worst_layers") or []
    rule = report.get("worst_layers_rule") or WORST_LAYERS_RULE
    lines = [
        "Each layer's output on held-out batches against the same layer of a reference model on the same inputs "
        "(errors of earlier layers included). Quantization: int8 / fake-quant against the same weights run in float "
        "(fake-quant off). Drift: the trained float weights against the float snapshot at fake-quant start: how far "
        "training moved the model, not a quantization error. Conversion: int8 against the same quantized graph "
        "simulated in float (>= 30 dB expected).",
        "",
        (f"Flagged ({rule}): {', '.join(f'`{w}`' for w in worst)}." if worst
         else f"No layer flagged ({rule})."),
        "",
        "| layer | " + " | ".join(h for _, h in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for row in layers:
        name = f"**{row['layer']}**" if row["layer"] in worst else row["layer"]
        lines.append(f"| {name} | " + " | ".join(_fmt(row.get(k)) for k, _ in columns) + " |")
    return lines


def markdown_sections(report: dict[str, Any]) -> str:
    """The report.md sections of exports, parity, per-layer SQNR, ranges, sizes and latency.

    Args:
        report: a report (report.json's content).
    """
    lines: list[str] = []
    exports = report.get("exports") or {}
    if exports:
        lines += ["", SECTION_MARK, "", "| module | format | file | size (KiB) | export (s) | status |", "|---|---|---|---|---|---|"]
        for module, by_format in exports.items():
            for fmt, a in by_format.items():
                size = a.get("size_bytes")
                status = "ok" if not a.get("error") else f"failed: {a['error'][:120]}"
                lines.append(
                    f"| {module} | {fmt} | {a.get('path') or ''} | {_fmt(size / 1024 if size else None)} | "
                    f"{_fmt(a.get('export_s'), '.2f')} | {status} |"
                )
        lines += ["", "Each artifact has a manifest `<file>.json` (inputs, outputs, backend, qparams, provenance)."]
    parity = report.get("parity") or {}
    if parity.get("checks"):
        th = parity.get("thresholds", {})
        verdict = "passed" if parity.get("passed") else f"FAILED (on_breach={parity.get('on_breach')})"
        lines += [
            "",
            "## Parity",
            "",
            f"Gate {verdict}: SQNR >= {th.get('min_sqnr_db')} dB and top-1 agreement >= {th.get('min_top1_agreement')} "
            f"for the gated rows; {parity.get('samples')} samples, {parity.get('inputs')}.",
            "",
            "| module | candidate | reference | SQNR (dB) | top-1 agreement | gated | result |",
            "|---|---|---|---|---|---|---|",
        ]
        for c in parity["checks"]:
            result = ("pass" if c.get("passed") else "**FAIL**") if c.get("gated") else "info"
            if c.get("error"):
                result += f" ({c['error'][:100]})"
            lines.append(
                f"| {c['module']} | {label(report, c['candidate'])} | {label(report, c['reference'])} | {_fmt(c.get('sqnr_db'))} | "
                f"{_fmt(c.get('top1_agreement'), '.4f')} | {'yes' if c.get('gated') else 'no'} | {result} |"
            )
        drift = any(c["candidate"] == "trained_float" for c in parity["checks"])
        lines += [
            "",
            "int8_reference = the same quantized graph simulated in float (decomposed reference model): int8 against "
            "it checks conversion and lowering; each artifact is checked against int8. The other rows are information"
            + (": against the float QAT-trained weights, what quantization costs; the trained weights against the "
               "float snapshot, how far training moved them (drift, not a quantization error)." if drift else "."),
        ]
        lines += [f"Not checked: {what}: {why}." for what, why in (parity.get("not_checked") or {}).items()]
    layers = report.get("layers") or []
    if layers:
        lines += ["", "## Per-layer SQNR", ""] + per_layer_lines(report)
    ranges = report.get("ranges") or {}
    if ranges.get("weights"):
        lines += ["", "## Weight ranges", "", "| layer | shape | dtype | scheme | float range | scale range | clipped |",
                  "|---|---|---|---|---|---|---|"]
        high = []
        for w in ranges["weights"]:
            clipped = w.get("clipped")
            cell = _fmt(clipped, ".2%")
            if clipped is not None and clipped > CLIPPED_HIGH:
                cell, _ = f"**{cell}**", high.append(w["layer"])
            lines.append(
                f"| {w['layer']} | {w['shape']} | {w['dtype']} | {w['qscheme']} | [{w['min']:.4g}, {w['max']:.4g}] | "
                f"[{w['scale_min']:.3g}, {w['scale_max']:.3g}] | {cell} |"
            )
        lines += [
            "",
            "Float range: of the int8 weights (BatchNorm folded in). Clipped = share of weights at the ends of the int8 "
            "range beyond the one per channel a fitted range puts there. Above "
            f"{CLIPPED_HIGH:.0%} (in bold) the weight range the observer kept is narrower than the weights (e.g. "
            "torch.ao's default per-channel moving-average weight observer lagging while the folded weights grew, "
            "then frozen): int8 then "
            "computes a different function from the same weights in float (the per-layer quantization column), which "
            "QAT may have adapted to (compare fake-quant and int8 accuracy with the float rows); observe longer "
            "(`quant.schedule.observer_freeze` later) or choose a weight observer that follows the weights.",
        ]
        if high:
            lines += ["", f"High weight clipping in: {', '.join(f'`{h}`' for h in high)}."]
    if ranges.get("activations"):
        lines += [
            "",
            "## Activation ranges",
            "",
            "| after | scale | zero point | quantization range | observed after the op (held-out, QAT model) | "
            "clipped by fake-quant | clipped by int8 |",
            "|---|---|---|---|---|---|---|",
        ]
        high = []
        for a in ranges["activations"]:
            observed = a.get("observed")
            after = a["after"] + (" (+ fused ReLU)" if a.get("activation_applied") else "")
            clipped = a.get("clipped_fake_quant")
            cell = _fmt(clipped, ".2%")
            if clipped is not None and clipped > CLIPPED_HIGH:
                cell, _ = f"**{cell}**", high.append(a["after"])
            lines.append(
                f"| {after} | {a['scale']:.4g} | {a['zero_point']} | [{a['range'][0]:.4g}, {a['range'][1]:.4g}] | "
                + (f"[{observed[0]:.4g}, {observed[1]:.4g}]" if observed else "")
                + f" | {cell} | {_fmt(a.get('clipped_int8'), '.2%')} |"
            )
        lines += [
            "",
            "Clipped = share of the values an activation quantizer receives, after the op that feeds it (a fused "
            "ReLU's negatives are removed by the ReLU, not clipped), that lie beyond its range and saturate at its "
            "edge. Up to about 1 % is the usual price of a tight range; above "
            f"{CLIPPED_HIGH:.0%} (in bold) the range is too narrow for held-out data: let the observers run longer "
            "(`quant.schedule.observer_freeze` later) or calibrate on more batches, and for a model's output "
            "(logits) consider leaving it in float; check the int8-vs-float SQNR of that layer above.",
        ]
        if high:
            lines += ["", f"High clipping after: {', '.join(f'`{h}`' for h in high)}."]
    sizes = report.get("size_on_disk") or {}
    latency = report.get("latency_detail") or {}
    if sizes or latency.get("ms"):
        batches = [str(b) for b in latency.get("batch_sizes", [])]
        lines += [
            "",
            "## Size on disk and latency",
            "",
            f"Median of {latency.get('repeats')} runs, {latency.get('threads')} thread(s), every model's calls in "
            "blocks taken in turn in one measurement (the first table's latency column is this table's last column).",
            "",
            "| module | model | size (KiB) | " + " | ".join(f"ms, batch {b}" for b in batches) + " |",
            "|---|---|---|" + "---|" * len(batches),
        ]
        for module in sorted(set(sizes) | set(latency.get("ms", {}))):
            size_row = sizes.get(module, {})
            lat_row = latency.get("ms", {}).get(module, {})
            for variant in dict.fromkeys([*size_row, *lat_row]):
                size = size_row.get(variant)
                cells = [_fmt(lat_row.get(variant, {}).get(b), ".3f") for b in batches]
                row_name = (f"{_variant_name(report, variant)} (eager; size of the state dict)"
                            if variant in VARIANTS else f"{variant} file")
                lines.append(f"| {module} | {row_name} | {_fmt(size / 1024 if size else None)} | " + " | ".join(cells) + " |")
    plots = report.get("plots") or {}
    if plots:
        lines += ["", "## Plots", ""] + [f"![{name}]({path})" for name, path in plots.items()]
    return ("\n".join(lines) + "\n") if lines else ""
