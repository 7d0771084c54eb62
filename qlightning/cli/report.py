"""`qlightning report RUN_DIR`: show a run's report; with ``--write``, render report.md and the plots again.

Read-only by default: nothing in the run directory changes (report.json, report.md and the plots keep
their bytes and times). ``--write`` renders ``report.md`` and ``plots/*.png`` from ``report.json`` and
updates report.json's ``plots`` entry only when the set of plots changed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence


def _is_run_report(report: dict[str, Any]) -> bool:
    return "metrics" in report and "size_bytes" in report and "latency_ms" in report


def render(run_dir: Path) -> dict[str, Any]:
    """Rewrite ``report.md`` and ``plots/*.png`` of a run directory from its ``report.json``; returns the report.

    ``report.json`` itself is rewritten only when the plots made differ from the ones it lists.

    Args:
        run_dir: a run directory or a ``qlightning export`` directory holding ``report.json``.
    """
    from qlightning.run import plots
    from qlightning.run.report import SECTION_MARK, markdown_sections, to_markdown

    path = run_dir / "report.json"
    report = json.loads(path.read_text())
    listed = report.get("plots")
    report["plots"] = plots.render(report, run_dir)
    if _is_run_report(report):
        text = to_markdown(report)
        if SECTION_MARK not in text:
            text += markdown_sections(report)
    else:
        title = f"# qlightning export of {report['checkpoint']}" if "checkpoint" in report else "# qlightning report"
        text = title + "\n" + markdown_sections(report)
    (run_dir / "report.md").write_text(text)
    if report["plots"] != listed:
        path.write_text(json.dumps(report, indent=2, sort_keys=True))
    return report


def main(argv: Sequence[str]) -> int:
    """``qlightning report RUN_DIR [--write]``: print a run's report; with ``--write`` render it again.

    Args:
        argv: the command line after ``report``.

    Returns:
        0 on success; 1 if report.json cannot be rendered; 2 if the directory has no report.json.
    """
    parser = argparse.ArgumentParser(
        prog="qlightning report",
        description="Show the report of a run directory (read-only); --write renders report.md and the PNG plots again.",
    )
    parser.add_argument("run_dir", help="a run directory (outputs/<date>/<time>) or a `qlightning export` directory")
    parser.add_argument("--write", action="store_true",
                        help="render report.md and plots/*.png again from report.json (default: change nothing)")
    args = parser.parse_args(list(argv))
    run_dir = Path(args.run_dir)
    if not (run_dir / "report.json").is_file():
        print(f"qlightning report: no report.json in {run_dir}", file=sys.stderr)
        return 2
    try:
        report = render(run_dir) if args.write else json.loads((run_dir / "report.json").read_text())
    except (ValueError, KeyError, TypeError) as exc:
        print(f"qlightning report: could not render {run_dir / 'report.json'}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if _is_run_report(report):
        from qlightning.run.report import print_table

        print_table(report)
    parity = report.get("parity") or {}
    if parity.get("checks"):
        print(f"parity: {'passed' if parity.get('passed') else 'FAILED'} ({len(parity['checks'])} checks)")
    if report.get("worst_layers"):
        print("worst layers (int8 vs its own weights in float): " + ", ".join(report["worst_layers"]))
    if not args.write:
        print(f"read {run_dir / 'report.json'} (nothing written; --write renders report.md and the plots again)")
        return 0
    print(f"wrote {run_dir / 'report.md'}")
    for name, rel in report.get("plots", {}).items():
        print(f"wrote {run_dir / rel}  ({name})")
    return 0
