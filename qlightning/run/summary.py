"""What a run ends with: one screen on the console (where the run is, whether the int8 model is faithful,
int8 vs float) and the same final figures in every Lightning logger of the run."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Optional

# report["metrics"] variants shown beside int8, in this order (labels from report["labels"])
VARIANT_ORDER = ("fake_quant", "trained_float", "fp32", "ptq")


def verdict_lines(result: dict[str, Any]) -> list[str]:
    """The gates' verdicts in words: the fit-end fidelity gate (int8 vs fake-quant) and the export parity gate.

    Args:
        result: the run's report dict (its ``fidelity`` and ``parity`` entries); parity is shown only
            when enabled.
    """
    lines: list[str] = []
    fidelity = result.get("fidelity") or {}
    for name, check in fidelity.items():
        if check.get("error"):
            lines.append(f"fidelity {name}: not measured ({check['error']})")
            continue
        state = "passed" if check.get("passed") else "FAILED"
        figures = f"SQNR {check.get('sqnr_db')} dB"
        if check.get("top1_agreement") is not None:
            figures += f", top-1 agreement {check['top1_agreement']:.3f}"
        action = check.get("action")
        floor = check.get("noise_floor") or {}
        if floor:  # measured on a breach: how far the fake-quant model moves from itself on input noise
            figures += (f"; the fake-quant model against itself on inputs perturbed by {floor['relative_noise']:g}: "
                        f"SQNR {floor['sqnr_db']} dB"
                        + (f", top-1 agreement {floor['top1_agreement']:.3f}" if floor.get("top1_agreement") is not None else "")
                        + (" (int8 flips no more: near-ties)" if check.get("within_noise_floor") else ""))
        lines.append(f"fidelity gate {name} (int8 vs fake-quant): {state}, {figures}"
                     + (f"; {action}" if action and action != "kept int8" else ""))
    parity = result.get("parity") or {}
    if parity.get("enabled"):
        gated = [c for c in parity.get("checks", []) if c.get("gated")]
        if parity.get("passed"):
            lines.append(f"parity gate (exports vs int8): passed, {len(gated)} checks")
        else:
            lines.append(f"parity gate (exports vs int8): FAILED: {'; '.join(map(str, parity.get('breaches', [])))}")
    return lines


def headline(result: dict[str, Any]) -> Optional[str]:
    """``int8 accuracy 0.9963 · fake-quant 0.9963 · float snapshot (...) 0.9852``, each variant by its report
    label; ``None`` without int8 metrics.

    Args:
        result: the run's report dict (``metrics`` and ``labels``); the metric is ``accuracy``, ``acc``
            or ``top1``, else int8's first one.
    """
    metrics = result.get("metrics") or {}
    int8 = metrics.get("int8") or {}
    key = next((k for k in ("accuracy", "acc", "top1") if k in int8), next(iter(int8), None))
    if key is None:
        return None
    labels = {**(result.get("labels") or {}), "fake_quant": "fake-quant"}
    parts = [f"int8 {key} {int8[key]:.4f}"]
    for variant in VARIANT_ORDER:
        value = (metrics.get(variant) or {}).get(key)
        if isinstance(value, (int, float)):
            parts.append(f"{labels.get(variant, variant)} {value:.4f}")
    return " · ".join(parts)


def print_summary(result: dict[str, Any], run_dir: Path, console: Any = None) -> None:
    """The end-of-run screen after the table: the run folder, the gates' verdicts, notices, int8 vs float.

    Args:
        result: the run's report dict.
        run_dir: the run folder (printed, with whichever of report.md, report.json and train.log exist).
        console: a ``rich`` console to print on; ``None`` makes a new one.
    """
    from rich.console import Console

    console = console or Console()
    line = headline(result)
    if line:
        console.print(line, soft_wrap=True)
    for text in verdict_lines(result):
        style = "bold red" if "FAILED" in text else None
        console.print(text, style=style, soft_wrap=True)
    for notice in result.get("notices") or []:
        console.print(f"NOTICE: {notice}", style="bold yellow", soft_wrap=True)
    files = [p for p in ("report.md", "report.json", "train.log") if (run_dir / p).exists()]
    console.print(f"run folder: {run_dir}  ({', '.join(files)}, checkpoints/)", soft_wrap=True)


def report_metrics(result: dict[str, Any]) -> dict[str, float]:
    """The final figures as flat logger metrics: ``report/<variant>/<metric>``, ``report/fidelity/<module>/sqnr_db``.

    Args:
        result: the run's report dict (``metrics``, ``fidelity``, ``latency_ms``); non-numeric values are
            left out.
    """
    out: dict[str, float] = {}
    for variant, values in (result.get("metrics") or {}).items():
        for key, value in values.items():
            if isinstance(value, (int, float)):
                out[f"report/{variant}/{key}"] = float(value)
    for name, check in (result.get("fidelity") or {}).items():
        for key in ("sqnr_db", "top1_agreement"):
            if isinstance(check.get(key), (int, float)):
                out[f"report/fidelity/{name}/{key}"] = float(check[key])
        out[f"report/fidelity/{name}/passed"] = float(bool(check.get("passed")))
    for variant, ms in (result.get("latency_ms") or {}).items():
        if isinstance(ms, (int, float)):
            out[f"report/latency_ms/{variant}"] = float(ms)
    return out


def log_report(loggers: Iterable[Any], result: dict[str, Any], step: int) -> None:
    """Give every Lightning logger the final report figures (after fit: logged, then saved).

    Each logger is also finalized with ``"success"``; nothing happens when there are no figures.

    Args:
        loggers: the trainer's loggers.
        result: the run's report dict (see :func:`report_metrics`).
        step: the step the metrics are logged at.
    """
    metrics = report_metrics(result)
    if not metrics:
        return
    for logger in loggers:
        logger.log_metrics(metrics, step=step)
        logger.save()
        logger.finalize("success")
