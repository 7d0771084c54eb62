"""Median timing side by side (calls interleaved, or in blocks taken in turn), on the thread's CPU clock or the wall clock."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Mapping

CLOCKS: dict[str, Callable[[], float]] = {
    # CPU time of the calling thread: with 1 intra-op thread every kernel (ATen, oneDNN, inductor's
    # OpenMP region, onnxruntime with intra_op_num_threads=1) runs on it, and time spent preempted by
    # other processes on a shared machine is not counted. Cache / memory-bandwidth contention still is.
    "cpu": time.thread_time,
    "wall": time.perf_counter,
}


def interleaved_medians(
    fns: Mapping[str, Callable[[], Any]], repeats: int, warmup: int = 3, clock: str = "cpu"
) -> dict[str, dict[str, float]]:
    """Median (and min / quartiles) seconds per call of each function, calls interleaved round-robin.

    Interleaving makes slow drift (thermal, other load) hit every variant alike, so ratios taken from
    one call of this function are side by side.
    """
    if clock == "cpu-if-1-thread":
        import torch

        clock = "cpu" if torch.get_num_threads() == 1 else "wall"
    now = CLOCKS[clock]
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(warmup + repeats):
        for name, fn in fns.items():
            start = now()
            fn()
            elapsed = now() - start
            if i >= warmup:
                times[name].append(elapsed)
    return _stats(times)


def blocked_medians(
    fns: Mapping[str, Callable[[], Any]], repeats: int, warmup: int = 3, clock: str = "wall", rounds: int = 3
) -> dict[str, dict[str, float]]:
    """Like :func:`interleaved_medians`, with the calls in blocks of one function, the blocks taken in turn
    (:func:`qlightning.core.metrics.block_times`): for runtimes with their own thread pools (onnxruntime,
    inductor's OpenMP), whose threads spin after a call and slow the next one if it is another runtime's."""
    from qlightning.core.metrics import block_times

    return _stats(block_times(fns, repeats, warmup, rounds, clock=CLOCKS[clock]))


def _stats(times: Mapping[str, list[float]]) -> dict[str, dict[str, float]]:
    out = {}
    for k, v in times.items():
        v = sorted(v)
        q = statistics.quantiles(v, n=4) if len(v) >= 4 else [v[0], statistics.median(v), v[-1]]
        out[k] = {"median": statistics.median(v), "min": v[0], "q1": q[0], "q3": q[2], "n": len(v)}
    return out


def medians(stats: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    return {k: v["median"] for k, v in stats.items()}
