"""A Hydra callback that writes one comparison table for a multirun (`qlightning train -m ...`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


def comparison_table(sweep_dir: Path) -> str:
    """Markdown table of every run's overrides, int8 and float-snapshot metrics, size and latency.

    The ``fp32`` metrics of a QAT run are the float snapshot at fake-quant start, not a float baseline.

    Args:
        sweep_dir: the multirun's directory; each ``*/report.json`` is one row, and its
            ``.hydra/overrides.yaml`` gives the overrides.
    """
    rows = []
    for report_path in sorted(sweep_dir.glob("*/report.json"), key=lambda p: (len(p.parent.name), p.parent.name)):
        report = json.loads(report_path.read_text())
        overrides_file = report_path.parent / ".hydra" / "overrides.yaml"
        overrides = overrides_file.read_text().strip().replace("\n", " ") if overrides_file.exists() else ""
        rows.append((report_path.parent.name, overrides, report))
    if not rows:
        return "no run wrote a report\n"
    metrics = sorted({k for _, _, r in rows for k in r["metrics"].get("int8", {})})
    # what the fp32 row is ("float snapshot" for QAT, "float" for PTQ), without its step (runs differ)
    fp32_name = (rows[0][2].get("labels") or {}).get("fp32", "fp32").split(" (")[0]
    head = ["run", "overrides"] + [f"int8 {m}" for m in metrics] + [f"{fp32_name} {m}" for m in metrics] + ["int8 KiB", "int8 ms", "float ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, overrides, r in rows:
        cells = [name, overrides.replace("- ", "").replace("|", "\\|")]
        cells += [f"{r['metrics'].get('int8', {}).get(m, float('nan')):.4f}" for m in metrics]
        cells += [f"{r['metrics'].get('fp32', {}).get(m, float('nan')):.4f}" for m in metrics]
        latency = r.get("latency_ms") or {}
        cells += [f"{r['size_bytes']['int8'] / 1024:.1f}", f"{latency.get('int8', float('nan')):.3f}",
                  f"{latency.get('fp32', float('nan')):.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


class CompareRuns(Callback):
    """Writes ``comparison.md`` into the sweep directory when a multirun ends."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Write :func:`comparison_table` to ``<sweep dir>/comparison.md`` and print it.

        Args:
            config: the multirun's config (``hydra.sweep.dir`` locates the runs).
            kwargs: anything else Hydra passes; unused.
        """
        sweep_dir = Path(config.hydra.sweep.dir)
        table = comparison_table(sweep_dir)
        (sweep_dir / "comparison.md").write_text(table)
        print(table)
