"""Measurement study for the default QAT schedule of qlightning.QuantizationAwareTraining (issue 14, item 1).

Every run trains a digits classifier (`ClassifierModule(net)`, `modules=["net"]`) on one thread and
appends one JSON line to the results file: float runs (no callback) and QAT runs with a schedule given
as fractions (a, b) of the total optimizer steps: fake-quant from step round(a*T), observers and
BatchNorm frozen from step round(b*T). The baseline is today's default (fake-quant from step 0, never
frozen). Runs already in the results file are skipped, so the script can be stopped and rerun.

    python defaults_study.py --quick                         # smoke test, a few seconds per run
    python defaults_study.py --stage prune                   # cheap slice, all candidates
    python defaults_study.py --stage full --candidates base,c25_75,c33_80
    python defaults_study.py --stage slices --candidates base,c25_75
    python defaults_study.py --report > tables.md            # tables from results.jsonl
"""

from __future__ import annotations

import argparse
import copy
import contextlib
import json
import logging
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402
from torch import nn  # noqa: E402

from qlightning import QuantizationAwareTraining  # noqa: E402
from qlightning.examples.digits import ClassifierModule, DigitsCNN, DigitsDataModule, ResidualDepthwiseCNN  # noqa: E402
from qlightning.examples.digits import RowTransformer as RowTransformer_  # noqa: E402

logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
warnings.filterwarnings("ignore")

HERE = Path(__file__).resolve().parent

# ----------------------------------------------------------------------------- architectures


# the study's nets live in the package (tests/test_default_schedule.py checks the chosen default on them)
ResidualDWNet, RowTransformer = ResidualDepthwiseCNN, RowTransformer_


ARCHS = {"cnn": lambda: DigitsCNN(), "resdw": lambda: ResidualDWNet(), "tfm": lambda: RowTransformer()}

# ----------------------------------------------------------------------------- module / schedules


class StudyModule(ClassifierModule):
    """ClassifierModule with a choice of optimizer and LR schedule (constant or cosine to 0 per step)."""

    def __init__(self, net: nn.Module, opt: str, lr: float, sched: str) -> None:
        super().__init__(net, lr=lr)
        self.opt, self.sched = opt, sched
        self.example_input_array = torch.zeros(1, 1, 8, 8)

    def configure_optimizers(self) -> Any:
        params = self.parameters()
        if self.opt == "sgd":
            optimizer = torch.optim.SGD(params, lr=self.lr, momentum=0.9)
        elif self.opt == "adam":
            optimizer = torch.optim.Adam(params, lr=self.lr)
        elif self.opt == "adamw":
            optimizer = torch.optim.AdamW(params, lr=self.lr, weight_decay=0.01)
        else:
            raise ValueError(self.opt)
        if self.sched == "const":
            return optimizer
        total = max(1, int(self.trainer.estimated_stepping_batches))
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# name -> (a, b, c): fake-quant from fraction a of the steps, observers frozen from fraction b,
# BatchNorm statistics frozen from fraction c (None: never)
CANDIDATES: dict[str, tuple[float, float | None, float | None]] = {
    "base": (0.0, None, None),  # today's default
    # observers and BN frozen together (the torch.ao recipe)
    "c25_75": (0.25, 0.75, 0.75),
    "c33_80": (0.33, 0.80, 0.80),
    "c50_85": (0.50, 0.85, 0.85),
    "c20_90": (0.20, 0.90, 0.90),
    "c00_75": (0.0, 0.75, 0.75),  # ablation: freeze without warm-up
    "c25_00": (0.25, None, None),  # ablation: warm-up without freeze
    # observers frozen, BN never frozen (BN freeze diverges at a constant high LR: diag_bn.py)
    "o25_75": (0.25, 0.75, None),
    "o25_90": (0.25, 0.90, None),
    "o50_85": (0.50, 0.85, None),
    "o10_80": (0.10, 0.80, None),
    # fake-quant from half the run, nothing frozen (after the convert fixes of notes/fidelity.md)
    "n50_00": (0.50, None, None),
    # o50_85 (the shipped default) with every Linear weight on its current range instead of torch.ao's average
    # (average_ranges_outside_conv_bn skips Linear modules): the Transformer cells' question, notes/defaults.md
    "o50_85_lc": (0.50, 0.85, None),
}
LINEAR_CURRENT = {"o50_85_lc"}
#: the control: the float run again, every parameter nudged by one part in a million at the step where the
#: default schedule starts fake-quant (no quantization at all). Its gap to the float run is how far the last
#: iterate moves from an imperceptible change half-way, the resolution of "int8 within 1 point of float".
FLOAT_NUDGED = "float_nudged"


class Nudge(pl.Callback):
    """Multiplies every parameter by ``1 + 1e-6 * N(0, 1)`` (its own generator) before optimizer step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            generator = torch.Generator().manual_seed(12345)
            with torch.no_grad():
                for p in pl_module.parameters():
                    p.mul_(1 + 1e-6 * torch.randn(p.shape, generator=generator))


@contextlib.contextmanager
def linear_weights_current(on: bool) -> Iterator[None]:
    """While ``on``, the FX engine's scoping (``average_ranges_outside_conv_bn``) runs as shipped, then every Linear
    weight fake-quant gets back the averaging constant it had before (the current range)."""
    if not on:
        yield
        return
    from qlightning.engines.fx import engine

    shipped = engine.average_ranges_outside_conv_bn

    def sparing_linear_weights(module: nn.Module) -> int:
        linear = [m.weight_fake_quant.activation_post_process for m in module.modules()
                  if isinstance(m, nn.Linear) and hasattr(m, "weight_fake_quant")]
        before = [obs.averaging_constant for obs in linear]
        count = shipped(module)
        for obs, constant in zip(linear, before):
            obs.averaging_constant = constant
        return count

    engine.average_ranges_outside_conv_bn = sparing_linear_weights
    try:
        yield
    finally:
        engine.average_ranges_outside_conv_bn = shipped


def milestones(name: str, total_steps: int) -> dict[str, Any]:
    a, b, c = CANDIDATES[name]
    start = int(round(a * total_steps))
    kwargs: dict[str, Any] = {"fake_quant_start": {"step": start} if start > 0 else None}
    if b is not None:
        kwargs["observer_freeze"] = {"step": max(start + 1, int(round(b * total_steps)))}
    if c is not None:
        kwargs["bn_freeze"] = {"step": max(start + 1, int(round(c * total_steps)))}
    return kwargs


# ----------------------------------------------------------------------------- running


def make_trainer(epochs: int, callbacks: list) -> pl.Trainer:
    return pl.Trainer(
        max_epochs=epochs,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        accelerator="cpu",
        devices=1,
    )


def accuracy(net: nn.Module, dm: DigitsDataModule) -> float:
    dm.setup()
    x, y = dm.splits["test"].tensors
    net.eval()
    with torch.no_grad():
        return 100.0 * (net(x).argmax(1) == y).float().mean().item()


def steps_per_epoch(dm: DigitsDataModule) -> int:
    dm.setup()
    n = len(dm.splits["train"])
    return (n + dm.batch_size - 1) // dm.batch_size


class Runner:
    def __init__(self, out: Path, epochs: int, deadline: float) -> None:
        self.out, self.epochs, self.deadline = out, epochs, deadline
        self.done: dict[str, dict] = {}
        if out.exists():
            for line in out.read_text().splitlines():
                if line.strip():
                    rec = json.loads(line)
                    self.done[rec["key"]] = rec
        self.pretrained: dict[str, dict] = {}  # fine-tune: float pre-trained state per cell-seed

    def key(self, **kw: Any) -> str:
        return "|".join(f"{k}={kw[k]}" for k in ("arch", "opt", "lr", "sched", "mode", "seed", "schedule", "epochs"))

    def write(self, rec: dict) -> None:
        with self.out.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        self.done[rec["key"]] = rec
        acc = (f"float={rec['float_acc']:.1f}" if "float_acc" in rec
               else f"fq={rec['fq_acc']:.1f} int8={rec['int8_acc']:.1f}")
        print(f"[{time.strftime('%H:%M:%S')}] {rec['key']}: {acc}"
              f" ({rec['wall_s']:.1f}s)", flush=True)

    def _fit(self, cell: dict, state: dict | None, qat_kwargs: dict | None,
             linear_current: bool = False, extra: list | None = None) -> tuple[StudyModule, Any, float]:
        pl.seed_everything(cell["seed"] + (1000 if state is not None else 0), verbose=False)
        dm = DigitsDataModule(seed=cell["seed"])
        model = StudyModule(ARCHS[cell["arch"]](), cell["opt"], cell["lr"], cell["sched"])
        if state is not None:
            model.net.load_state_dict(state)
        cb = None
        callbacks = list(extra or [])
        if qat_kwargs is not None:
            cb = QuantizationAwareTraining(modules=["net"], backend="x86", engine="fx", convert_on_fit_end=False,
                                           keep_fake_quant=False, keep_float_snapshot=False, **qat_kwargs)
            callbacks.append(cb)
        t0 = time.perf_counter()
        with linear_weights_current(linear_current):
            make_trainer(self.epochs, callbacks).fit(model, datamodule=dm)
        return model, cb, t0

    def pretrain_state(self, cell: dict) -> dict:
        """Fine-tune mode: the float model trained from scratch for `epochs` first (cached per cell-seed)."""
        pk = self.key(**{**cell, "mode": "pretrain", "schedule": "float", "epochs": self.epochs})
        if pk in self.pretrained:
            return self.pretrained[pk]
        path = self.out.parent / "cache" / (pk.replace("|", "_").replace("=", "-") + ".pt")
        if path.exists():
            state = torch.load(path)
        else:
            model, _, t0 = self._fit(cell, None, None)
            state = {k: v.detach().clone() for k, v in model.net.state_dict().items()}
            path.parent.mkdir(exist_ok=True)
            torch.save(state, path)
            if pk not in self.done:
                self.write({"key": pk, **cell, "mode": "pretrain", "schedule": "float", "epochs": self.epochs,
                            "float_acc": accuracy(model.net, DigitsDataModule(seed=cell["seed"])),
                            "wall_s": time.perf_counter() - t0})
        self.pretrained[pk] = state
        return state

    def run(self, cell: dict, schedule: str) -> None:
        key = self.key(**cell, schedule=schedule, epochs=self.epochs)
        if key in self.done or time.time() > self.deadline:
            return
        state = self.pretrain_state(cell) if cell["mode"] == "finetune" else None
        dm = DigitsDataModule(seed=cell["seed"])
        total = steps_per_epoch(dm) * self.epochs
        rec: dict[str, Any] = {"key": key, **cell, "schedule": schedule, "epochs": self.epochs, "total_steps": total}
        if schedule == "float":
            model, _, t0 = self._fit(cell, state, None)
            rec["float_acc"] = accuracy(model.net, dm)
        elif schedule == FLOAT_NUDGED:
            start = int(round(CANDIDATES["o50_85"][0] * total))
            model, _, t0 = self._fit(cell, state, None, extra=[Nudge(start)])
            rec["fq_acc"] = rec["int8_acc"] = accuracy(model.net, dm)  # reported beside the candidates
        else:
            kwargs = milestones(schedule, total)
            rec["milestones"] = kwargs
            model, cb, t0 = self._fit(cell, state, kwargs, linear_current=schedule in LINEAR_CURRENT)
            rec["fq_acc"] = accuracy(model.net, dm)
            cb.convert(model)
            rec["int8_acc"] = accuracy(model.net, dm)
        rec["wall_s"] = time.perf_counter() - t0
        self.write(rec)


# ----------------------------------------------------------------------------- designs


def cells(archs: Iterable[str], opts_lrs: Iterable[tuple[str, float]], scheds: Iterable[str],
          modes: Iterable[str], seeds: Iterable[int]) -> list[dict]:
    out = []
    for seed in seeds:  # seed outermost: a stopped run still covers every cell with some seeds
        for arch in archs:
            for opt, lr in opts_lrs:
                for sched in scheds:
                    for mode in modes:
                        out.append(dict(arch=arch, opt=opt, lr=lr, sched=sched, mode=mode, seed=seed))
    return out


ARCH_NAMES = ("cnn", "resdw", "tfm")
OPT_LRS = (("sgd", 1e-2), ("sgd", 1e-1), ("adam", 1e-3), ("adam", 1e-2), ("adamw", 1e-3), ("adamw", 1e-2))
SLICE_OPT_LRS = (("sgd", 1e-1), ("adam", 1e-2))


def design(stage: str, seeds: list[int] | None = None, archs: Iterable[str] = ARCH_NAMES) -> list[dict]:
    if stage == "prune":  # cheap slice for pruning candidates: the high lrs (where QAT hurts most)
        return cells(archs, (("sgd", 1e-1), ("adam", 1e-2), ("adamw", 1e-2)), ["const"], ["scratch"], seeds or [0])
    if stage == "full":  # full factors on from-scratch, constant LR
        return cells(archs, OPT_LRS, ["const"], ["scratch"], seeds or [0, 1, 2])
    if stage == "slices":  # cosine (from scratch) and fine-tune (constant LR) slices
        return (cells(archs, SLICE_OPT_LRS, ["cos"], ["scratch"], seeds or [0, 1])
                + cells(archs, SLICE_OPT_LRS, ["const"], ["finetune"], seeds or [0, 1]))
    if stage == "long":  # run-length check (use with --epochs 12): the cells that miss at 6 epochs
        return cells(("resdw", "tfm"), (("adam", 1e-3), ("adam", 1e-2), ("sgd", 1e-1)), ["const"], ["scratch"], [0, 1])
    if stage == "sgd_low":  # does SGD train at lr 1e-3? (float only: --candidates "")
        return cells(ARCH_NAMES, (("sgd", 1e-3),), ["const"], ["scratch"], [0])
    raise ValueError(stage)


# ----------------------------------------------------------------------------- report


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def report(path: Path, candidates: list[str], epochs: int) -> str:
    recs = [r for r in load(path) if r["epochs"] == epochs]
    groups: dict[tuple, dict[str, dict[int, dict]]] = {}
    for r in recs:
        if r["mode"] == "pretrain":
            continue
        cell = (r["arch"], r["opt"], r["lr"], r["sched"], r["mode"])
        groups.setdefault(cell, {}).setdefault(r["schedule"], {})[r["seed"]] = r
    lines = []
    hdr = "| arch | opt | lr | sched | mode | seeds | float | " + " | ".join(
        f"{c}: fq / int8 / worst gap" for c in candidates) + " |"
    lines += [hdr, "|" + "---|" * (hdr.count("|") - 1)]
    summary = {c: {"cells": 0, "miss1": 0, "miss3": 0, "median1": 0, "worst": -1e9} for c in candidates}
    misses: list[str] = []
    for cell in sorted(groups):
        g = groups[cell]
        floats = g.get("float", {})
        if not floats:
            continue
        row = [cell[0], cell[1], f"{cell[2]:g}", cell[3], cell[4], str(len(floats)),
               f"{statistics.median(r['float_acc'] for r in floats.values()):.1f}"]
        for c in candidates:
            runs = {s: r for s, r in g.get(c, {}).items() if s in floats}
            if not runs:
                row.append("–")
                continue
            gaps = [floats[s]["float_acc"] - r["int8_acc"] for s, r in runs.items()]
            worst = max(gaps)
            if worst > 1.0:
                ws = max(runs, key=lambda k: floats[k]["float_acc"] - runs[k]["int8_acc"])
                misses.append(f"| {c} | {' / '.join(str(v) for v in cell)} | {ws} | {floats[ws]['float_acc']:.1f} | "
                              f"{runs[ws]['fq_acc']:.1f} | {runs[ws]['int8_acc']:.1f} | "
                              f"{floats[ws]['float_acc'] - runs[ws]['fq_acc']:+.1f} | "
                              f"{runs[ws]['fq_acc'] - runs[ws]['int8_acc']:+.1f} |")
            s = summary[c]
            s["cells"] += 1
            s["miss1"] += worst > 1.0
            s["miss3"] += worst > 3.0
            s["median1"] += statistics.median(gaps) > 1.0
            s["worst"] = max(s["worst"], worst)
            mark = " **" if worst > 3 else (" *" if worst > 1 else "")
            row.append(f"{statistics.median(r['fq_acc'] for r in runs.values()):.1f} / "
                       f"{statistics.median(r['int8_acc'] for r in runs.values()):.1f} / "
                       f"{worst:+.1f}{mark} (median {statistics.median(gaps):+.1f}, {len(runs)})")
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines.append("worst gap = max over seeds of (float - int8), points; * > 1 point, ** > 3 points; median: the median "
                 "over seeds of (float - int8); n = seeds")
    lines.append("")
    lines.append("| candidate | (a, b) | cells | cells > 1 pt | cells > 3 pt | cells whose median > 1 pt | worst gap |")
    lines.append("|---|---|---|---|---|---|---|")
    for c in candidates:
        s = summary[c]
        lines.append(f"| {c} | {CANDIDATES.get(c, 'float, nudged 1e-6 at 0.5')} | {s['cells']} | {s['miss1']} | {s['miss3']} | {s['median1']} | {s['worst']:+.1f} |")
    lines += ["", "Cells over 1 point, worst seed: training loss (float - fq) vs conversion loss (fq - int8)", "",
              "| candidate | cell | seed | float | fq | int8 | float - fq | fq - int8 |", "|---|---|---|---|---|---|---|---|"]
    lines += sorted(misses)
    walls = [r["wall_s"] for r in recs]
    lines.append("")
    lines.append(f"{len(recs)} runs, {sum(walls) / 60:.1f} min of training+eval wall time")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke test: 2 epochs, 3 archs, adam, 1 seed, own results file")
    p.add_argument("--stage", choices=["prune", "full", "slices", "long", "sgd_low"], default="prune")
    p.add_argument("--candidates", default="base,o25_90",
                   help=f"comma-separated names from {[*CANDIDATES, FLOAT_NUDGED]}")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--seeds", default="", help="comma-separated seeds (default: prune 0, full 0,1,2, slices 0,1)")
    p.add_argument("--archs", default=",".join(ARCH_NAMES), help=f"comma-separated subset of {ARCH_NAMES}")
    p.add_argument("--out", type=Path, default=HERE / "results" / "defaults_study.jsonl")
    p.add_argument("--max-minutes", type=float, default=1e9, help="start no new run after this many minutes")
    p.add_argument("--report", action="store_true", help="print the tables from --out and exit")
    args = p.parse_args(argv)
    cands = [c for c in args.candidates.split(",") if c]
    unknown = [c for c in cands if c not in CANDIDATES and c != FLOAT_NUDGED]
    if unknown:
        p.error(f"unknown candidates {unknown}")
    if args.report:
        print(report(args.out, cands, args.epochs))
        return
    if args.quick:
        args.epochs = 2
        args.out = HERE / "results_quick.jsonl"
        todo = cells(ARCH_NAMES, [("adam", 1e-2)], ["const"], ["scratch", "finetune"], [0])
        cands = ["base", "o25_90"]
    else:
        todo = design(args.stage, [int(x) for x in args.seeds.split(",") if x], [a for a in args.archs.split(",") if a])
    runner = Runner(args.out, args.epochs, time.time() + 60 * args.max_minutes)
    for cell in todo:
        for schedule in ["float", *cands]:
            runner.run(cell, schedule)
    if args.quick:
        print(report(args.out, cands, args.epochs))


if __name__ == "__main__":
    main(sys.argv[1:])
