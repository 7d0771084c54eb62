"""Keep quantization state identical on every rank.

DDP keeps parameters equal, and (with ``broadcast_buffers=True``) copies rank 0's buffers to the
others at each forward; but each rank then updates observers and BatchNorm statistics with its
own batch, so after the last step, and at any checkpoint or conversion, the ranks differ (with
DDP's buffer broadcast off, 25 of 72 buffers after each epoch of digits, measured in
tests/test_ddp.py). We broadcast every buffer of the quantized submodules from rank 0 at those
points (validation start, epoch end, checkpoint, conversion) over the default process group that
Lightning's DDP strategy initialises.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn


def is_distributed(trainer: Any) -> bool:
    return getattr(trainer, "world_size", 1) > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()


def broadcast_buffers(trainer: Any, modules: Iterable[nn.Module], src: int = 0) -> int:
    """Copy every buffer of ``modules`` from rank ``src`` to all ranks; returns how many were sent."""
    if not is_distributed(trainer):
        return 0
    count = 0
    for module in modules:
        for buf in module.buffers():
            torch.distributed.broadcast(buf.data, src=src)
            count += 1
    return count
