"""Run the zoo and write ``benchmarks/results/zoo.jsonl`` and the README's zoo table.

    .venv214/bin/python -m tests.zoo.table            # run every model x engine (latency too), write both
    .venv214/bin/python -m tests.zoo.table --render   # only re-render the README table from the jsonl
    .venv214/bin/python -m tests.zoo.table --only resnet18:pt2e,shufflenet_v2_x0_5:fx   # rerun some rows

The README block between ``<!-- zoo-table:start -->`` and ``<!-- zoo-table:end -->`` is
``render(load())``; ``tests/zoo/test_table.py`` checks it is.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "zoo.jsonl"
README = ROOT / "README.md"
START, END = "<!-- zoo-table:start -->", "<!-- zoo-table:end -->"


def load(path: Path = RESULTS) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _num(value: Optional[float], fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def _ms(a: Optional[float], b: Optional[float]) -> str:
    if a is None or b is None:
        return ""
    return f"{a:.1f} / {b:.1f} ({a / b:.2f}x)"


def _auto(row: dict[str, Any]) -> str:
    if not row.get("auto_runtime"):
        return ""
    return f"{row['auto_runtime']}: {_ms(row.get('float_ms_auto_b32'), row.get('auto_ms_b32'))}"


def outcome(row: dict[str, Any]) -> str:
    from tests.zoo.harness import KNOWN, NOTES, ROUTES

    key = (row["model"], row["engine"])
    known = KNOWN.get(key, {})
    note = known.get("note", "") if row["status"] != "works" else NOTES.get(key) or ROUTES.get(key, {}).get("note", "")
    if row["status"] == "works":
        text = "works"
        if row.get("options"):
            text = "needs config: " + ", ".join(f"`{k}={v}`" for k, v in sorted(row["options"].items()))
    elif row["status"] == "refused":
        text = "refused"
    else:
        text = row["status"]
    return f"{text}: {note}" if note else text


def render(rows: list[dict[str, Any]]) -> str:
    from tests.zoo.harness import ENGINES, MODELS

    order = {(m, e): i for i, (m, e) in enumerate((m, e) for m in MODELS for e in ENGINES)}
    rows = sorted(rows, key=lambda r: order.get((r["model"], r["engine"]), len(order)))
    torch_versions = sorted({r.get("torch", "") for r in rows})
    lines = [
        f"Measured with torch {', '.join(torch_versions)} on 2 CPU cores (`python -m tests.zoo.table`; "
        "fidelity: int8 vs fake-quant on 128 held digits after a fit of 48 steps of 32 (ViTs and the Hugging Face transformers: "
        "144-192) with the callback's default schedule (float for the first half, observers frozen for the last 15 %), "
        "the fake-quant model at >= 25 % digits accuracy; "
        "latency: eager float vs the int8 module as converted, no lowering, wall-clock median ms of 15 calls, float and int8 "
        "interleaved; `lowering=auto`: the runtime the callback's lowering keeps at batch 32 (each candidate checked against "
        "the fake-quant model on the 128 held digits in batches of 32, timed), float and it timed in blocks of calls taken "
        "in turn, 15 each; blank: not measured).",
        "",
        "| model | engine | outcome | SQNR dB | top-1 agreement | int8 digits acc. | float / int8 ms, batch 1 (int8 speed-up) | float / int8 ms, batch 32 (int8 speed-up) | `lowering=auto`, batch 32: runtime kept, float / its ms (speed-up) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['engine']} | {outcome(r)} | {_num(r.get('sqnr_db'), '.1f')} | "
            f"{_num(r.get('top1_agreement'), '.3f')} | {_num(r.get('int8_accuracy'), '.2f')} | "
            f"{_ms(r.get('float_ms_b1'), r.get('int8_ms_b1'))} | "
            f"{_ms(r.get('float_ms_b32'), r.get('int8_ms_b32'))} | {_auto(r)} |"
        )
    return "\n".join(lines)


def readme_block(text: str) -> Optional[str]:
    if START not in text or END not in text:
        return None
    return text.split(START, 1)[1].split(END, 1)[0].strip("\n")


def write_readme(table: str, path: Path = README) -> None:
    text = path.read_text()
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    path.write_text(f"{head}{START}\n{table}\n{END}{tail}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--render", action="store_true", help="only re-render the README table from the jsonl")
    parser.add_argument("--only", default="", help="comma-separated model:engine rows to rerun (others kept)")
    args = parser.parse_args(argv)
    if not args.render:
        import torch

        from tests.zoo.harness import ENGINES, MODELS, run_case

        torch.set_num_threads(2)
        wanted = [tuple(c.split(":")) for c in args.only.split(",") if c] or [(m, e) for m in MODELS for e in ENGINES]
        kept = [r for r in load() if (r["model"], r["engine"]) not in wanted] if args.only else []
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        rows = list(kept)
        for model, engine in wanted:
            result = dataclasses.asdict(run_case(model, engine, latency=True))
            print(json.dumps({k: v for k, v in result.items() if k != "warnings"}), flush=True)
            rows.append(result)
            RESULTS.write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_readme(render(load()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
