"""`qlightning export CHECKPOINT`: rebuild the int8 model of a QAT checkpoint and write its artifacts.

The model and data classes come from the run config stored in the checkpoint (callback state
``provenance.config``, written by ``qlightning train``), or from ``--config`` (a run's
``config.yaml``). Class paths are checked against the allowlist; a checkpoint cannot widen it (its
stored ``trusted_modules`` are ignored; use ``--trust`` or ``QLIGHTNING_TRUSTED_MODULES``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from qlightning.core.quiet import quiet

FORMATS = ("torchscript", "onnx", "pt2")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qlightning export",
        description="Write the int8 model of a QAT checkpoint as TorchScript / ONNX (QDQ) / torch.export .pt2, "
        "each with a JSON manifest, and run the parity gate on the test loader.",
    )
    p.add_argument("checkpoint", help="a checkpoint written by a QAT run (e.g. outputs/<date>/<time>/checkpoints/last.ckpt)")
    p.add_argument("--formats", default=None, help=f"comma-separated subset of {','.join(FORMATS)} (default: the run's export.formats)")
    p.add_argument("--out", default=None, help="output directory (default: <run dir>/export)")
    p.add_argument("--config", default=None, help="run config YAML when the checkpoint holds none (a run's config.yaml)")
    p.add_argument("--trust", action="append", default=[], metavar="PREFIX", help="extra module prefix _target_ may name")
    p.add_argument("--no-parity", action="store_true", help="skip the parity gate")
    p.add_argument("--on-breach", choices=("fail", "warn"), default=None, help="what a parity breach does (default: the run's)")
    p.add_argument("--min-sqnr-db", type=float, default=None)
    p.add_argument("--batches", type=int, default=None, help="held-out test batches for the gate")
    p.add_argument("--no-report", action="store_true", help="skip per-layer SQNR, latency and plots")
    return p


def run_config(checkpoint: Path, state: dict[str, Any], config: Optional[str]) -> Any:
    """The run config: ``--config``, else the checkpoint's provenance, else ``<run dir>/config.yaml``.

    Args:
        checkpoint: the checkpoint's path.
        state: the checkpoint's QAT state.
        config: ``--config``, or ``None``.
    """
    from omegaconf import OmegaConf

    from qlightning.errors import ConfigError

    if config:
        return OmegaConf.load(config)
    stored = (state.get("provenance") or {}).get("config")
    if stored:
        return OmegaConf.create(stored)
    for candidate in (checkpoint.parent / "config.yaml", checkpoint.parent.parent / "config.yaml"):
        if candidate.is_file():
            return OmegaConf.load(candidate)
    raise ConfigError(
        f"checkpoint={str(checkpoint)!r}: it holds no run config (not written by `qlightning train`) and no config.yaml "
        "was found next to it; pass --config PATH (a YAML with model/data/quant like a run's config.yaml)"
    )


def default_out(checkpoint: Path) -> Path:
    """``<run dir>/export`` of the run the checkpoint belongs to.

    Args:
        checkpoint: the checkpoint's path.
    """
    run_dir = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent
    return run_dir / "export"


def main(argv: Sequence[str]) -> int:
    """``qlightning export``: restore a checkpoint, write the int8 exports and check them; returns the exit code.

    Args:
        argv: the command's arguments.
    """
    args = _parser().parse_args(list(argv))
    import torch
    from omegaconf import OmegaConf

    from qlightning.errors import ConfigError, QLightningError

    checkpoint = Path(args.checkpoint)
    if not checkpoint.is_file():
        print(f"qlightning export: no such checkpoint: {checkpoint}", file=sys.stderr)
        return 2
    try:
        from qlightning.config.schema import section
        from qlightning.run.artifacts import export_and_check
        from qlightning.run.report import markdown_sections
        from qlightning.callbacks.checkpoint import qat_state, restore
        from qlightning.config.build import build_callback, check_targets, instantiate_checked
        from qlightning.config.schema import TrainConfig

        ckpt = torch.load(checkpoint, map_location="cpu", weights_only=True)
        state = qat_state(ckpt)
        cfg = run_config(checkpoint, state, args.config)
        try:
            cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg)
        except Exception as exc:
            raise ConfigError(f"run config: does not match the schema: {exc}") from None
        cfg.trusted_modules = list(args.trust)  # never from the checkpoint
        problems = check_targets(cfg)
        if problems:
            raise ConfigError(problems)
        if args.formats is not None:
            chosen = [f.strip() for f in args.formats.split(",") if f.strip()]
            bad = [f for f in chosen if f not in FORMATS]
            if bad:
                raise ConfigError(f"--formats: unknown format(s) {bad}; valid: {list(FORMATS)}")
            cfg.export.formats = chosen
        if args.no_parity:
            cfg.parity.enabled = False
        if args.on_breach:
            cfg.parity.on_breach = args.on_breach
        if args.min_sqnr_db is not None:
            cfg.parity.min_sqnr_db = args.min_sqnr_db
        if args.batches is not None:
            cfg.parity.batches = args.batches
        if args.no_report:
            cfg.report.enabled = False

        callback = build_callback(cfg)
        model = instantiate_checked(cfg.model, "model")
        datamodule = instantiate_checked(cfg.data, "data")
        with quiet(messages=(".*does not have many workers.*",)):
            restore(model, checkpoint, convert=True, callback=callback)
            out = Path(args.out) if args.out else default_out(checkpoint)
            base = {
                "checkpoint": str(checkpoint),
                "modules": list(callback.targets),
                "engine": callback.engine.name,
                "backend": callback.backend,
            }
            try:
                extra = export_and_check(
                    callback, model, datamodule, out,
                    section(cfg, "export"), section(cfg, "parity"), section(cfg, "report"),
                    base_report=base,
                )
            except QLightningError as exc:
                if type(exc).__name__ == "ParityError":
                    print(f"qlightning export: {exc}", file=sys.stderr)
                    return 1
                raise
        report = {**base, **extra}
        (out / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True, default=str))
        (out / "report.md").write_text(f"# qlightning export of {checkpoint}\n" + markdown_sections(report))
    except ConfigError as exc:
        print(f"qlightning export: configuration error\n{exc}", file=sys.stderr)
        return 2
    except QLightningError as exc:
        print(f"qlightning export: {exc}", file=sys.stderr)
        return 1
    failed = 0
    for module, by_format in report.get("exports", {}).items():
        for fmt, art in by_format.items():
            if art.get("error"):
                failed += 1
                print(f"{module:12s} {fmt:12s} FAILED: {art['error'][:300]}")
            else:
                print(f"{module:12s} {fmt:12s} {out / art['path']}  ({art['size_bytes'] / 1024:.1f} KiB; manifest {art['manifest']})")
    parity = report.get("parity", {})
    for check in parity.get("checks", []):
        if check.get("gated"):
            top1 = check.get("top1_agreement")
            print(
                f"parity {check['module']}: {check['candidate']:>14s} vs {check['reference']:<14s} "
                f"SQNR {check['sqnr_db'] if check['sqnr_db'] is not None else float('nan'):6.1f} dB"
                + (f", top-1 agreement {top1:.4f}" if top1 is not None else "")
                + ("" if check.get("passed") else "  BREACH")
            )
    print(f"report: {out / 'report.md'}")
    return 1 if failed else 0
