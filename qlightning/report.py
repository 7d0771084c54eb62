"""Float vs fake-quant vs int8: quality on the test set, size on disk, latency.

"fp32" is the float model the QAT phase started from (a snapshot taken when fake-quant first
turns on, kept in checkpoints); "fake_quant" is what training and validation saw; "int8" is the
converted model.
"""

from __future__ import annotations

import copy
import io
import json
import logging
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import lightning.pytorch as pl
import torch
from torch import nn

from qlightning.callbacks.qat import QuantizationAwareTraining, _set_submodule
from qlightning.engines.base import Inputs
from qlightning.schedule import Phase

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


@contextmanager
def quiet_lightning() -> Iterator[None]:
    """Silence Lightning's per-Trainer banners (GPU/TPU available, tips) for the report's evaluations."""
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextmanager
def swapped(pl_module: pl.LightningModule, modules: dict[str, nn.Module]) -> Iterator[None]:
    """Temporarily put other versions of submodules into the LightningModule."""
    originals = {name: pl_module.get_submodule(name) for name in modules}
    try:
        for name, module in modules.items():
            _set_submodule(pl_module, name, module)
        yield
    finally:
        for name, module in originals.items():
            _set_submodule(pl_module, name, module)


def variants(callback: QuantizationAwareTraining, pl_module: pl.LightningModule) -> dict[str, dict[str, nn.Module]]:
    """The fp32, (ptq,) fake-quant and int8 versions of every quantized submodule."""
    int8 = {n: pl_module.get_submodule(n) for n in callback.targets}
    if not hasattr(callback, "fake_quant_modules"):  # PostTrainingQuantization: float and int8 only
        return {"fp32": {n: callback.float_modules[n] for n in callback.targets}, "int8": int8}
    fake = {name: callback.fake_quant_modules[name] for name in callback.targets}
    fp32 = {}
    for name, module in fake.items():
        fp32[name] = copy.deepcopy(module).eval()
        if callback.float_snapshot is not None:
            fp32[name].load_state_dict(callback.float_snapshot[name])
        callback.engine.set_phase(fp32[name], Phase(fake_quant=False, observe=False, bn_frozen=True))
    for module in fake.values():
        callback.engine.set_observers(module, False)
    out = {"fp32": fp32}
    ptq = getattr(callback, "ptq_modules", None) or {}
    if callback.targets and all(name in ptq for name in callback.targets):
        out["ptq"] = {name: ptq[name] for name in callback.targets}  # PTQ baseline (ptq_baseline=)
    out.update({"fake_quant": fake, "int8": int8})
    return out


def _tile(value: Any, batch: int) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        reps = -(-batch // value.shape[0])
        return value.repeat(reps, *([1] * (value.dim() - 1)))[:batch]
    if isinstance(value, (tuple, list)):
        return type(value)(_tile(v, batch) for v in value)
    if isinstance(value, dict):
        return {k: _tile(v, batch) for k, v in value.items()}
    return value


def median_latency_ms(module: nn.Module, inputs: Inputs, repeats: int, warmup: int = 5) -> float:
    """Median wall time of one forward, in milliseconds."""
    times = []
    with torch.inference_mode():
        for i in range(warmup + repeats):
            start = time.perf_counter()
            module(*inputs.args, **inputs.kwargs)
            if i >= warmup:
                times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


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
    callback: QuantizationAwareTraining,
    pl_module: pl.LightningModule,
    datamodule: Any,
    trainer_factory: Callable[[], pl.Trainer],
    batch_size: int = 32,
    repeats: int = 30,
    threads: Optional[int] = None,
) -> dict[str, Any]:
    versions = variants(callback, pl_module)
    metrics, seen = evaluate(trainer_factory, pl_module, datamodule, versions)
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        latency = {variant: 0.0 for variant in ("fp32", "ptq", "int8") if variant in versions}
        for name in callback.targets:
            inputs = seen.get(name) or callback.inputs[name]
            batch = Inputs(_tile(inputs.args, batch_size), _tile(inputs.kwargs, batch_size))
            for variant in latency:
                latency[variant] += median_latency_ms(versions[variant][name], batch, repeats)
    finally:
        torch.set_num_threads(old_threads)
    # fp32 size: the float weights alone, without the observer / fake-quant state QAT added
    size = {
        "fp32": sum(
            state_dict_bytes(m, skip=(n for n, _ in callback.engine.quant_state(m))) for m in versions["fp32"].values()
        ),
        "int8": sum(state_dict_bytes(m) for m in versions["int8"].values()),
    }
    if "ptq" in versions:
        size["ptq"] = sum(state_dict_bytes(m) for m in versions["ptq"].values())
    return {
        "fp32_is": "the float weights at fake-quant start" if getattr(callback, "float_snapshot", None) is not None
        else "the float model before conversion" if not hasattr(callback, "fake_quant_modules")
        else "the final weights with quantization switched off",
        "modules": list(callback.targets),
        "engine": callback.engine.name,
        "lowering": dict(getattr(callback, "lowering_choices", {}) or {}),
        "backend": callback.backend,
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
    from qlightning.artifacts import markdown_sections  # exports, parity, per-layer SQNR, ranges, latency, plots

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
