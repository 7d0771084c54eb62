"""PNG plots of the report: per-layer SQNR bars, QAT scales/phases over steps, latency per artifact.

matplotlib's object API with the Agg canvas only: no pyplot, no global backend switch, no display.
Labels are module names and the report's variant labels (not observer names or report keys), every
bar carries its value, and legends sit outside the axes (saved with a tight bounding box).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Optional

PLOTS_DIR = "plots"
COLUMNS = {
    "int8_vs_float_sqnr_db": "quantization: int8 vs float, same weights",
    "fake_quant_vs_float_sqnr_db": "quantization: fake-quant vs float, same weights",
    "drift_sqnr_db": "drift (not quantization): trained float vs snapshot",
    "conversion_sqnr_db": "int8 vs float-simulated int8",
}
COLORS = {"int8_vs_float_sqnr_db": "#1f77b4", "fake_quant_vs_float_sqnr_db": "#7fb3de", "drift_sqnr_db": "#aaaaaa"}


def _save(fig: Any, path: Path, contents: list[str]) -> Path:
    """Write a PNG whose text chunk ``Contents`` lists what it shows (layers, series), for tools and tests."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(str(path), format="png", bbox_inches="tight",  # keeps the legends outside the axes in the image
                metadata={"Software": "qlightning", "Contents": json.dumps(contents)})
    return path


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def per_layer_sqnr(
    layers: list[dict[str, Any]], path: Path, worst: Optional[list[str]] = None, rule: str = ""
) -> Optional[Path]:
    """Grouped horizontal bars per layer (graph order): quantization error against the same weights in
    float, and training drift (trained float against the snapshot) apart from it.

    The conversion column (int8 vs its float simulation, ~50 dB up to the 200 dB cap) is left to the
    table of report.md. Layers in ``worst`` (the report's flagged layers, by ``rule``) are in red.

    Args:
        layers: the report's per-layer rows (``{"layer": name, column: dB, ...}``).
        path: the PNG file to write.
        worst: layer names to mark in red.
        rule: how the worst layers were flagged, in words (for the title).

    Returns:
        ``path``, or ``None`` (nothing written) when no row has an SQNR column to plot.
    """
    if not layers:
        return None
    names = [row["layer"] for row in layers]
    columns = [c for c in ("int8_vs_float_sqnr_db", "fake_quant_vs_float_sqnr_db", "drift_sqnr_db")
               if any(row.get(c) is not None for row in layers)]
    if not columns:
        return None
    worst = list(worst or [])
    fig = _figure(9, max(3.0, 0.6 * len(names) + 1.5))
    ax = fig.add_subplot(1, 1, 1)
    height = 0.8 / len(columns)
    for i, column in enumerate(columns):
        values = [row.get(column) for row in layers]
        ys = [j + (i - (len(columns) - 1) / 2) * height for j in range(len(names))]
        bars = ax.barh(ys, [v if v is not None else 0.0 for v in values], height=height, label=COLUMNS[column],
                       color=COLORS.get(column))
        for bar, v in zip(bars, values):
            if v is not None:
                ax.annotate(f"{v:.1f}", (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                            xytext=(3 if v >= 0 else -3, 0), textcoords="offset points", va="center",
                            ha="left" if v >= 0 else "right", fontsize=7)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=8)
    for tick in ax.get_yticklabels():
        if tick.get_text() in worst:
            tick.set_color("#c0392b")
            tick.set_fontweight("bold")
    ax.invert_yaxis()
    ax.axvline(0, color="black", linewidth=0.6)
    ax.set_xlabel("SQNR (dB), higher is better")
    flagged = f"flagged in red: {rule}" if worst else f"no layer flagged ({rule})" if rule else ""
    ax.set_title("Per-layer SQNR on held-out batches" + (f"\n{flagged}" if flagged else ""), fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    ax.margins(x=0.15)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    return _save(fig, path, names)


def find_metrics_csv(run_dir: Path) -> Optional[Path]:
    """The CSV logger's ``metrics.csv`` under the run directory, if any.

    Args:
        run_dir: the run folder, searched recursively (the first path in sorted order is returned).
    """
    found = sorted(Path(run_dir).glob("**/metrics.csv"))
    return found[0] if found else None


def read_qat_series(metrics_csv: Path) -> dict[str, list[tuple[float, float]]]:
    """``{column: [(step, value), ...]}`` for every ``qat/*`` column of a Lightning CSV log.

    Args:
        metrics_csv: the CSV file; rows without a step and empty or non-numeric values are skipped.
    """
    series: dict[str, list[tuple[float, float]]] = {}
    with open(metrics_csv, newline="") as fh:
        for row in csv.DictReader(fh):
            step = row.get("step")
            if step in (None, ""):
                continue
            for key, value in row.items():
                if key and key.startswith("qat/") and value not in (None, ""):
                    try:
                        series.setdefault(key, []).append((float(step), float(value)))
                    except ValueError:
                        continue
    return series


def scale_evolution(metrics_csv: Optional[Path], path: Path, names: Optional[dict[str, str]] = None) -> Optional[Path]:
    """Scales logged as ``qat/scale/*`` (if the callback logs them) and the QAT phase flags, over steps.

    ``names`` maps an observer (``net.activation_post_process_0``) to what it quantizes (``after
    net.features.0.0``): the legend shows that; an observer not in it keeps its own name.

    Args:
        metrics_csv: the run's CSV log (see :func:`find_metrics_csv`); ``None`` or a missing file plots nothing.
        path: the PNG file to write.
        names: ``{observer: legend label}``.

    Returns:
        ``path``, or ``None`` when there is no ``qat/*`` series to plot.
    """
    if metrics_csv is None or not Path(metrics_csv).is_file():
        return None
    series = read_qat_series(Path(metrics_csv))
    if not series:
        return None
    names = names or {}
    scales = {k: v for k, v in series.items() if k.startswith("qat/scale")}
    flags = {k: v for k, v in series.items() if not k.startswith("qat/scale")}
    panels = [p for p in (scales, flags) if p]
    fig = _figure(9, 3.2 * len(panels) + 0.5)
    for i, panel in enumerate(panels):
        ax = fig.add_subplot(len(panels), 1, i + 1)
        for offset, (key, points) in enumerate(sorted(panel.items())):
            xs, ys = zip(*points)
            if panel is flags:  # stacked step lines, so the 0/1 flags do not hide each other
                ax.step(xs, [y + 1.5 * offset for y in ys], where="post", label=key.removeprefix("qat/"))
            else:
                observer = key.removeprefix("qat/scale/")
                ax.plot(xs, ys, label=names.get(observer, observer))
        if panel is flags:
            ax.set_yticks([])
            ax.set_title("QAT phase over training steps (each flag: low = off, high = on)")
        else:
            ax.set_ylabel("scale")
            ax.set_yscale("log")
            ax.set_title("Activation quantization scales over training steps")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    shown = [key.removeprefix("qat/") for key in sorted(flags)]
    shown += [names.get(k.removeprefix("qat/scale/"), k.removeprefix("qat/scale/")) for k in sorted(scales)]
    return _save(fig, path, shown)


def observer_names(report: dict[str, Any]) -> dict[str, str]:
    """``{observer: "after <module>"}`` from the report's activation ranges (the scale plot's legend).

    Args:
        report: the report dict; its ``ranges.activations`` entries with an ``observer`` are used.
    """
    return {a["observer"]: f"after {a['after']}" if not a["after"].startswith("input ") else a["after"]
            for a in (report.get("ranges") or {}).get("activations") or [] if a.get("observer")}


def latency(latency_ms: dict[str, dict[str, dict[str, float]]], path: Path) -> Optional[Path]:
    """Median latency of float, int8 and each artifact, one panel per batch size (log scale), values on bars.

    A panel is log-scaled only when its largest value is over 20 times its smallest.

    Args:
        latency_ms: ``{module: {variant: {batch size: ms}}}`` (the report's ``latency_detail.ms``); with
            more than one module, bars are labelled ``module:variant``.
        path: the PNG file to write.

    Returns:
        ``path``, or ``None`` when there is nothing to plot.
    """
    def shown(variant: str) -> str:
        return "float" if variant == "fp32" else variant

    rows = [(f"{m}:{shown(v)}" if len(latency_ms) > 1 else shown(v), by_batch)
            for m, variants in latency_ms.items() for v, by_batch in variants.items()]
    batches = sorted({b for _, by_batch in rows for b in by_batch}, key=lambda b: int(b))
    if not rows or not batches:
        return None
    fig = _figure(4.2 * len(batches), 3.6)
    for i, batch in enumerate(batches):
        ax = fig.add_subplot(1, len(batches), i + 1)
        names = [n for n, by_batch in rows if by_batch.get(batch) is not None]
        values = [by_batch[batch] for _, by_batch in rows if by_batch.get(batch) is not None]
        bars = ax.bar(range(len(names)), values, color=["#888888" if n.endswith("float") else "#1f77b4" for n in names])
        for bar, v in zip(bars, values):
            ax.annotate(f"{v:.3g}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), xytext=(0, 2),
                        textcoords="offset points", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("ms (median)")
        if values and min(values) > 0 and max(values) / min(values) > 20:
            ax.set_yscale("log")
        ax.margins(y=0.15)
        ax.set_title(f"batch {batch}")
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return _save(fig, path, [name for name, _ in rows])


def render(report: dict[str, Any], run_dir: Path) -> dict[str, str]:
    """Every plot the report has data for, under ``<run_dir>/plots``; returns ``{name: relative path}``.

    Args:
        report: the report dict (``layers``, ``worst_layers``, ``worst_layers_rule``, ``ranges``,
            ``latency_detail``).
        run_dir: the run folder; paths are relative to it, and its ``metrics.csv`` feeds the scale plot.
    """
    run_dir = Path(run_dir)
    out = run_dir / PLOTS_DIR
    made: dict[str, Optional[Path]] = {
        "per_layer_sqnr": per_layer_sqnr(report.get("layers") or [], out / "per_layer_sqnr.png", report.get("worst_layers"),
                                         report.get("worst_layers_rule", "")),
        "scale_evolution": scale_evolution(find_metrics_csv(run_dir), out / "scale_evolution.png", observer_names(report)),
        "latency": latency((report.get("latency_detail") or {}).get("ms") or {}, out / "latency.png"),
    }
    return {k: str(v.relative_to(run_dir)) for k, v in made.items() if v is not None}
