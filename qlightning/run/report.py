"""Float vs fake-quant vs int8: quality on the test set, size on disk, latency.

"fp32" is the float model the QAT phase started from (a snapshot taken when fake-quant first
turns on, kept in checkpoints); "fake_quant" is what training and validation saw; "int8" is the
converted model.
"""

from __future__ import annotations

import io
import json
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import lightning.pytorch as pl
import torch
from torch import nn

from qlightning.core.inputs import Inputs, tile_inputs
from qlightning.core.metrics import median_latency_ms
from qlightning.core.quiet import quiet
from qlightning.core.session import QuantSession, session_of, set_submodule

VARIANTS = ("fp32", "ptq", "fake_quant", "int8")


def state_dict_bytes(module: nn.Module, skip: Iterable[str] = ()) -> int:
    """Serialized size of a module's state dict, leaving out the keys in ``skip``."""
    skip = set(skip)
    buffer = io.BytesIO()
    torch.save({k: v for k, v in module.state_dict().items() if k not in skip}, buffer)
    return buffer.getbuffer().nbytes


def evaluation_trainer(limit_test_batches: Any = None) -> pl.Trainer:
    """A bare CPU Trainer for the report's and the parity gate's ``trainer.test`` runs."""
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
    """Temporarily put other versions of submodules into the LightningModule."""
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
    """Run ``trainer.test`` once per variant; returns metrics per variant and real test inputs per target."""
    metrics: dict[str, dict[str, float]] = {}
    seen: dict[str, Inputs] = {}
    for variant, modules in versions.items():
        handles = []
        if not seen:
            for name, module in modules.items():
                def grab(mod: nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
                    seen.setdefault(name, Inputs(tuple(a.detach() if torch.is_tensor(a) else a for a in args), dict(kwargs)))
                handles.append(module.register_forward_pre_hook(grab, with_kwargs=True))
        try:
            with swapped(pl_module, modules), quiet_lightning():
                results = trainer_factory().test(pl_module, datamodule=datamodule, verbose=False)
        finally:
            for handle in handles:
                handle.remove()
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
    session = session_of(session)
    versions = session.variants(pl_module)
    metrics, seen = evaluate(trainer_factory, pl_module, datamodule, versions)
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        latency = {variant: 0.0 for variant in ("fp32", "ptq", "int8") if variant in versions}
        for name in session.targets:
            inputs = seen.get(name) or session.inputs[name]
            batch = tile_inputs(inputs, batch_size)
            for variant in latency:
                latency[variant] += median_latency_ms(versions[variant][name], batch, repeats)
    finally:
        torch.set_num_threads(old_threads)
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
        "fidelity": dict(session.fidelity_results),
        "notices": list(session.notices),
        "modules": list(session.targets),
        "engine": session.engine.name,
        "lowering": dict(session.lowering_choices),
        "backend": session.backend,
        "metrics": metrics,
        "size_bytes": size,
        "latency_ms": {k: round(v, 4) for k, v in latency.items()},
        "latency_batch_size": batch_size,
        "latency_threads": threads or old_threads,
    }


def to_markdown(report: dict[str, Any]) -> str:
    metric_names = sorted({k for m in report["metrics"].values() for k in m})
    lines = [
        f"# qlightning report",
        "",
        f"Quantized modules: {', '.join(report['modules'])} · engine {report['engine']} · backend {report['backend']}",
        "",
        "| | " + " | ".join(metric_names) + " | size (KiB) | latency (ms, batch "
        + f"{report['latency_batch_size']}, {report['latency_threads']} threads) |",
        "|---|" + "---|" * (len(metric_names) + 2),
    ]
    for variant in (v for v in VARIANTS if v in report["metrics"]):
        values = report["metrics"].get(variant, {})
        cells = [f"{values[m]:.4f}" if m in values else "" for m in metric_names]
        size = report["size_bytes"].get(variant)
        lat = report["latency_ms"].get(variant)
        cells.append(f"{size / 1024:.1f}" if size is not None else "(as fp32)")
        cells.append(f"{lat:.3f}" if lat is not None else "(as fp32)")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    fp32, int8 = report["size_bytes"]["fp32"], report["size_bytes"]["int8"]
    lat = report["latency_ms"]
    lines += [
        "",
        f"int8 is {fp32 / int8:.2f}x smaller and {lat['fp32'] / lat['int8']:.2f}x faster than fp32 "
        f"(median of repeats)."
        # a failing parity gate writes the report before the run's end, so there is no wall time yet
        + (f" Wall time of the run: {report['wall_s']:.1f} s." if "wall_s" in report else ""),
        "",
        f"fp32 = {report.get('fp32_is', 'the float model')}; fake_quant = what training and validation saw."
        + (" ptq = post-training quantization of the float weights at fake-quant start (a baseline)."
           if "ptq" in report["metrics"] else ""),
    ]

    return "\n".join(lines) + "\n" + markdown_sections(report)


def write(report: dict[str, Any], run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True))
    (run_dir / "report.md").write_text(to_markdown(report))


def print_table(report: dict[str, Any]) -> None:
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
        size = report["size_bytes"].get(variant)
        lat = report["latency_ms"].get(variant)
        table.add_row(
            variant,
            *[f"{values[m]:.4f}" if m in values else "" for m in metric_names],
            f"{size / 1024:.1f}" if size is not None else "",
            f"{lat:.3f}" if lat is not None else "",
        )
    Console().print(table)


# ---------------------------------------------------------------------------------------------- markdown: exports, parity, per-layer SQNR, ranges, latency, plots

SECTION_MARK = "## Exported artifacts"


def _fmt(value: Any, spec: str = ".1f", none: str = "") -> str:
    if value is None:
        return none
    return format(value, spec)


def markdown_sections(report: dict[str, Any]) -> str:
    """The report.md sections of exports, parity, per-layer SQNR, ranges, sizes and latency."""
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
                f"| {c['module']} | {c['candidate']} | {c['reference']} | {_fmt(c.get('sqnr_db'))} | "
                f"{_fmt(c.get('top1_agreement'), '.4f')} | {'yes' if c.get('gated') else 'no'} | {result} |"
            )
        lines += [
            "",
            "int8_reference = the same quantized graph simulated in float (decomposed reference model): int8 against "
            "it checks conversion and lowering; each artifact is checked against int8.",
        ]
        lines += [f"Not checked: {what}: {why}." for what, why in (parity.get("not_checked") or {}).items()]
    layers = report.get("layers") or []
    if layers:
        worst = report.get("worst_layers") or []
        lines += ["", "## Per-layer SQNR", ""]
        if worst:
            lines += [f"Five worst layers (int8 vs fp32): {', '.join(f'`{w}`' for w in worst)}.", ""]
        lines += ["| layer | fake-quant vs fp32 (dB) | int8 vs fp32 (dB) | int8 vs reference (dB) |", "|---|---|---|---|"]
        for row in layers:
            lines.append(
                f"| {row['layer']} | {_fmt(row.get('fake_quant_sqnr_db'))} | {_fmt(row.get('int8_sqnr_db'))} | "
                f"{_fmt(row.get('conversion_sqnr_db'))} |"
            )
    ranges = report.get("ranges") or {}
    if ranges.get("weights"):
        lines += ["", "## Weight ranges", "", "| layer | shape | dtype | scheme | float range | scale range |", "|---|---|---|---|---|---|"]
        for w in ranges["weights"]:
            lines.append(
                f"| {w['layer']} | {w['shape']} | {w['dtype']} | {w['qscheme']} | [{w['min']:.4g}, {w['max']:.4g}] | "
                f"[{w['scale_min']:.3g}, {w['scale_max']:.3g}] |"
            )
    if ranges.get("activations"):
        lines += [
            "",
            "## Activation ranges",
            "",
            "| after | scale | zero point | fake-quant range | observed (held-out, QAT model) | clipped by fake-quant | clipped by int8 |",
            "|---|---|---|---|---|---|---|",
        ]
        for a in ranges["activations"]:
            observed = a.get("observed")
            lines.append(
                f"| {a['after']} | {a['scale']:.4g} | {a['zero_point']} | [{a['range'][0]:.4g}, {a['range'][1]:.4g}] | "
                + (f"[{observed[0]:.4g}, {observed[1]:.4g}]" if observed else "")
                + f" | {_fmt(a.get('clipped_fake_quant'), '.2%')} | {_fmt(a.get('clipped_int8'), '.2%')} |"
            )
    sizes = report.get("size_on_disk") or {}
    latency = report.get("latency_detail") or {}
    if sizes or latency.get("ms"):
        batches = [str(b) for b in latency.get("batch_sizes", [])]
        lines += [
            "",
            "## Size on disk and latency",
            "",
            f"Median of {latency.get('repeats')} runs, {latency.get('threads')} thread(s).",
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
                label = f"{variant} (eager; size of the state dict)" if variant in ("fp32", "int8") else f"{variant} file"
                lines.append(f"| {module} | {label} | {_fmt(size / 1024 if size else None)} | " + " | ".join(cells) + " |")
    plots = report.get("plots") or {}
    if plots:
        lines += ["", "## Plots", ""] + [f"![{name}]({path})" for name, path in plots.items()]
    return ("\n".join(lines) + "\n") if lines else ""
