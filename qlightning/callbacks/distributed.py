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

import copy
import io
import pickle
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

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


# ---------------------------------------------------------------------------------------------- transport
#
# Converted modules travel between processes twice: from rank 0 to the other ranks after rank 0
# converted (``broadcast_object``), and from rank 0 of a spawn/fork strategy back to the main
# process (Lightning's launcher, see qlightning.callbacks.qat). torch's own pickling of an FX
# converted model fails in two places, both measured on digits (torch 2.13):
#
# * a GraphModule traced from code with ``from __future__ import annotations`` records its
#   annotations as strings, and ``GraphModule.__reduce__`` cannot format an import for a string
#   (``AttributeError: 'str' object has no attribute '__name__'``);
# * quantized conv modules (``torch.ao.nn.quantized`` ``_ConvNd`` and its fused subclasses) define
#   ``__getstate__``/``__setstate__`` but their ``__setstate__`` never runs ``nn.Module.__init__``
#   (their ``__deepcopy__`` does), so an unpickled one has no ``_modules`` and the GraphModule
#   around it fails to rebuild.
#
# ``dumps_modules`` works around both on a private pickler (no global registration): annotation
# strings are dropped from a deep copy's graphs, and modules with their own ``__setstate__`` are
# rebuilt the way their ``__deepcopy__`` does. FX-*prepared* modules still do not pickle (their
# qconfigs hold a local function); callers rebuild those by preparing.


def _rebuild_module(cls: type, state: Any) -> nn.Module:
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    module.__setstate__(state)
    return module


class _ModulePickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, nn.Module) and type(obj).__setstate__ is not nn.Module.__setstate__:
            getstate = getattr(type(obj), "__getstate__", None)
            if getstate is not None and getstate is not nn.Module.__getstate__ and getstate is not object.__getstate__:
                state = obj.__getstate__()
                if not isinstance(state, dict):  # the torch.ao quantized modules' tuple states
                    return _rebuild_module, (type(obj), state)
        return NotImplemented


def _drop_string_annotations(root: nn.Module) -> None:
    for module in root.modules():
        if isinstance(module, torch.fx.GraphModule):
            changed = False
            for node in module.graph.nodes:
                if isinstance(node.type, str):
                    node.type = None
                    changed = True
            if changed:
                module.recompile()


def dumps_modules(obj: Any) -> bytes:
    """Pickle ``obj`` (modules, tensors, plain data) so that FX-converted int8 modules survive.

    Raises what pickling raises (``AttributeError``/``TypeError``/``pickle.PicklingError``) for
    objects that cannot travel, e.g. torch.export-ed modules.
    """
    obj = copy.deepcopy(obj)  # the annotations are dropped from the copy only
    for value in _walk(obj):
        if isinstance(value, nn.Module):
            _drop_string_annotations(value)
    buffer = io.BytesIO()
    _ModulePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def loads_modules(data: bytes) -> Any:
    return pickle.loads(data)


def _walk(obj: Any) -> Iterable[Any]:
    yield obj
    if isinstance(obj, dict):
        for value in obj.values():
            yield from _walk(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _walk(value)


def broadcast_object(trainer: Any, obj: Any, src: int = 0) -> Any:
    """``obj`` of rank ``src`` on every rank, through the strategy's ``broadcast`` (``broadcast_object_list``
    over the default process group Lightning set up); ``obj`` itself when not distributed."""
    if not is_distributed(trainer):
        return obj
    return trainer.strategy.broadcast(obj, src=src)


@contextmanager
def local_metrics(module: nn.Module) -> Iterator[None]:
    """torchmetrics ``Metric``s of ``module`` compute on this process's data only, without ``all_gather``.

    After a DDP fit the default process group stays up, and a ``Metric`` syncs whenever one is
    initialised; an evaluation that only rank 0 runs (the report) would wait for the other ranks
    forever, or fail once they have left (measured under torchrun: gloo "Connection closed by peer").
    """
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics is a dependency
        yield
        return
    metrics = [m for m in module.modules() if isinstance(m, Metric)]
    saved = [(m.sync_on_compute, m._to_sync) for m in metrics]
    for m in metrics:
        m.sync_on_compute = m._to_sync = False
    try:
        yield
    finally:
        for m, (sync_on_compute, to_sync) in zip(metrics, saved):
            m.sync_on_compute, m._to_sync = sync_on_compute, to_sync


def _reduce_whole(module: nn.Module) -> Any:
    return loads_modules, (dumps_modules(module),)


def pickle_whole_for_new_processes(module: nn.Module) -> None:
    """Let ``multiprocessing`` send ``module`` (an FX int8 GraphModule) to new processes intact.

    A spawn strategy pickles the trainer and model for every process it starts (also for a
    ``validate``/``test``/``predict`` after a spawn ``fit``, when the model holds int8 modules) with
    ``multiprocessing``'s ``ForkingPickler``, which fails on these modules twice: the quantized conv
    pickling bug above, and then, sharing their tensors through file descriptors, ``bad value(s) in
    fds_to_keep`` / ``unable to resize file`` (measured). ``ForkingPickler.register`` (exact types;
    the extension point torch uses for tensors) of the module's own class (each GraphModule
    instance has its own) sends it as :func:`dumps_modules` bytes instead: no other object changes.
    """
    from multiprocessing.reduction import ForkingPickler

    ForkingPickler.register(type(module), _reduce_whole)
