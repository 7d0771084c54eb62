"""`qlightning report RUN_DIR`: render report.md and the PNG plots again from report.json."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence


def render(run_dir: Path) -> dict[str, Any]:
    """Rewrite ``report.md`` and ``plots/*.png`` of a run directory from its ``report.json``; returns the report."""
    from qlightning.run import plots
    from qlightning.run.report import SECTION_MARK, markdown_sections

    path = run_dir / "report.json"
    report = json.loads(path.read_text())
    report["plots"] = plots.render(report, run_dir)
    if "metrics" in report and "size_bytes" in report and "latency_ms" in report:
        from qlightning.run.report import to_markdown

        text = to_markdown(report)
        if SECTION_MARK not in text:
            text += markdown_sections(report)
    else:
        title = f"# qlightning export of {report['checkpoint']}" if "checkpoint" in report else "# qlightning report"
        text = title + "\n" + markdown_sections(report)
    (run_dir / "report.md").write_text(text)
    path.write_text(json.dumps(report, indent=2, sort_keys=True))
    return report


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="qlightning report", description="Render report.md and the PNG plots of a run directory again from its report.json."
    )
    parser.add_argument("run_dir", help="a run directory (outputs/<date>/<time>) or a `qlightning export` directory")
    args = parser.parse_args(list(argv))
    run_dir = Path(args.run_dir)
    if not (run_dir / "report.json").is_file():
        print(f"qlightning report: no report.json in {run_dir}", file=sys.stderr)
        return 2
    try:
        report = render(run_dir)
    except (ValueError, KeyError, TypeError) as exc:
        print(f"qlightning report: could not render {run_dir / 'report.json'}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if "metrics" in report and "size_bytes" in report and "latency_ms" in report:
        from qlightning.run.report import print_table

        print_table(report)
    parity = report.get("parity") or {}
    if parity.get("checks"):
        print(f"parity: {'passed' if parity.get('passed') else 'FAILED'} ({len(parity['checks'])} checks)")
    if report.get("worst_layers"):
        print("worst layers (int8 vs fp32): " + ", ".join(report["worst_layers"]))
    print(f"wrote {run_dir / 'report.md'}")
    for name, rel in report.get("plots", {}).items():
        print(f"wrote {run_dir / rel}  ({name})")
    return 0
