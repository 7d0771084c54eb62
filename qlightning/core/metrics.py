"""The one implementation of each fidelity and speed metric: SQNR, top-1 agreement, latency.

Every layer (lowering choice, parity gate, report, equalization, benchmarks) reads these, so a
figure means the same thing wherever it is printed.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Iterable, Mapping, Optional

import torch

from qlightning.core.inputs import Inputs

MAX_SQNR_DB = 200.0  # identical outputs; keeps report.json plain JSON (no Infinity)


def sqnr_db(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``candidate`` against ``reference``, in dB.

    ``10 log10(|ref|^2 / |ref - cand|^2)``, clamped to ``[-200, 200]``: 200 for identical tensors,
    -200 for a shape mismatch, non-finite noise or a zero reference.

    Args:
        reference: the tensor taken as the signal (e.g. the fake-quant model's output).
        candidate: its approximation (e.g. the int8 model's output); quantized tensors are dequantized.
    """
    if getattr(reference, "is_quantized", False):
        reference = reference.dequantize()
    if getattr(candidate, "is_quantized", False):
        candidate = candidate.dequantize()
    ref = reference.detach().double().flatten()
    cand = candidate.detach().double().flatten()
    if ref.shape != cand.shape:
        return -MAX_SQNR_DB
    return ratio_db(float(ref.pow(2).sum()), float((ref - cand).pow(2).sum()))


def summed_sqnr_db(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """:func:`sqnr_db` over many ``(reference, candidate)`` tensor pairs: signal and noise summed over all of them.

    A pair whose shapes differ makes the whole comparison -200 dB, as in :func:`sqnr_db`.

    Args:
        pairs: ``(reference, candidate)`` tensors, e.g. each output of each held batch.
    """
    signal = noise = 0.0
    for reference, candidate in pairs:
        if reference.shape != candidate.shape:
            return -MAX_SQNR_DB
        ref, cand = reference.detach().double(), candidate.detach().double()
        signal += float(ref.pow(2).sum())
        noise += float((ref - cand).pow(2).sum())
    return ratio_db(signal, noise)


def ratio_db(signal: float, noise: float) -> float:
    """``10 log10(signal / noise)`` with :func:`sqnr_db`'s edge cases (for sums accumulated elsewhere).

    Args:
        signal: summed squared reference values; ``<= 0`` gives -200 (unless the noise is 0 too).
        noise: summed squared differences; non-finite gives -200, ``<= 0`` gives 200.

    Returns:
        The ratio in dB, clamped to ``[-200, 200]``.
    """
    if not math.isfinite(noise) or not math.isfinite(signal):
        return -MAX_SQNR_DB
    if noise <= 0.0:
        return MAX_SQNR_DB
    if signal <= 0.0:
        return -MAX_SQNR_DB
    return max(-MAX_SQNR_DB, min(MAX_SQNR_DB, 10.0 * math.log10(signal / noise)))


def top1_agreement(reference: torch.Tensor, candidate: torch.Tensor) -> Optional[float]:
    """Share of rows whose argmax over the last dim agrees; ``None`` when there is no class dimension.

    Args:
        reference: ``[..., classes]`` scores of the reference model.
        candidate: scores of the same shape from the model under test.
    """
    if reference.dim() < 2 or reference.shape[-1] < 2 or reference.shape != candidate.shape:
        return None
    return float((reference.argmax(-1) == candidate.argmax(-1)).double().mean())


def block_times(
    fns: Mapping[str, Callable[[], Any]], repeats: int, warmup: int = 5, rounds: int = 3,
    clock: Optional[Callable[[], float]] = None, settle_s: float = 0.05,
) -> dict[str, list[float]]:
    """Seconds of each timed call of each function: consecutive calls of one function in blocks, the
    blocks of all functions taken in turn ``rounds`` times, so drift hits all alike.

    Not call by call: a runtime's worker threads spin-wait for a while after each call (onnxruntime's pool,
    GNU OpenMP's), and on a small machine they slow whatever runs next; alternating onnxruntime and PyTorch
    calls on 2 cores read a float ResNet-18 at 98 ms against 26 ms in blocks (torch 2.14.1). One runtime at
    a time is how a deployed model runs. Blocks alone were not enough: right after onnxruntime's block, inductor's
    mobilenet_v2 FX module read 10.5-11.1 ms in three runs of ``lowering=auto`` (4.8 ms without onnxruntime
    among the candidates), and auto kept the 7 ms FX module; each block now starts after a pause.

    Args:
        fns: ``{name: zero-argument callable}`` to time side by side.
        repeats: timed calls of each.
        warmup: untimed calls of each before its first block (one before each later block: the pool wakes).
        rounds: how many blocks each function's timed calls are split into.
        clock: the clock read around each call, in seconds (``None``: ``time.perf_counter``).
        settle_s: seconds to wait before each block, while the previous runtime's threads stop spinning.
    """
    clock = clock or time.perf_counter
    times: dict[str, list[float]] = {k: [] for k in fns}
    rounds = max(1, min(rounds, repeats))
    for r in range(rounds):
        block = repeats // rounds + (1 if r < repeats % rounds else 0)
        for name, fn in fns.items():
            time.sleep(settle_s)  # the previous runtime's worker threads stop spinning before this one's block
            for i in range(-(warmup if r == 0 else min(warmup, 1)), block):
                start = clock()
                fn()
                if i >= 0:
                    times[name].append(clock() - start)
    return times


def median_ms(fns: Mapping[str, Callable[[], Any]], repeats: int, warmup: int = 5, rounds: int = 3) -> dict[str, float]:
    """Median wall time per call of each function, in ms, under inference mode (:func:`block_times`).

    Args:
        fns: ``{name: zero-argument callable}`` to time side by side.
        repeats: timed calls of each.
        warmup: untimed calls of each before its first block (one before each later block: the pool wakes).
        rounds: how many blocks each function's timed calls are split into.
    """
    with torch.inference_mode():
        times = block_times(fns, repeats, warmup, rounds)
    return {k: statistics.median(v) * 1e3 for k, v in times.items() if v}


def median_latency_ms(module: Callable[..., Any], inputs: Inputs, repeats: int, warmup: int = 5) -> float:
    """Median wall time of one forward of ``module`` on ``inputs``, in ms (:func:`median_ms` of one).

    Args:
        module: a module or any callable taking the inputs.
        inputs: positional and keyword inputs of one call.
        repeats: timed calls.
        warmup: untimed calls first.
    """
    return median_ms({"m": lambda: module(*inputs.args, **inputs.kwargs)}, repeats, warmup)["m"]
