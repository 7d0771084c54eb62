"""Keep quantization state identical on every rank.

DDP keeps parameters equal, and (with ``broadcast_buffers=True``) copies rank 0's buffers to the
others at each forward; but each rank then updates observers and BatchNorm statistics with its
own batch, so after the last step, and at any checkpoint or conversion, the ranks differ (with
DDP's buffer broadcast off, 25 of 72 buffers after each epoch of digits, measured in
tests/test_ddp.py). We broadcast every buffer of the quantized submodules from rank 0 at those
points (validation start, epoch end, checkpoint, conversion) over the default process group that
Lightning's DDP strategy initialises.

Converting happens once, on rank 0, and its result travels (:class:`RankZeroHandOver`): to the other
ranks through the strategy's broadcast, and, with a spawn/fork strategy, back to the main process.
"""

from __future__ import annotations

import atexit
import copy
import io
import os
import pickle
import shutil
import tempfile
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from qlightning.callbacks import lightning_compat as compat
from qlightning.core.inputs import attach_source
from qlightning.core.schedule import Phase
from qlightning.core.session import set_submodule
from qlightning.errors import QLightningError
from qlightning.quantize.lowering import ENGINE_MODULE


def is_distributed(trainer: Any) -> bool:
    """Whether ``trainer`` runs several processes over an initialised default process group.

    Args:
        trainer: the Trainer (anything with ``world_size``).
    """
    return getattr(trainer, "world_size", 1) > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()


def broadcast_buffers(trainer: Any, modules: Iterable[nn.Module], src: int = 0) -> int:
    """Copy every buffer of ``modules`` from rank ``src`` to all ranks; returns how many were sent.

    Args:
        trainer: the Trainer; nothing is sent unless :func:`is_distributed`.
        modules: the modules whose buffers to send.
        src: the rank that sends.
    """
    if not is_distributed(trainer):
        return 0
    count = 0
    for module in modules:
        for buf in module.buffers():
            torch.distributed.broadcast(buf.data, src=src)
            count += 1
    return count


_EXIT_HANDLER_REGISTERED = False


def destroy_gloo_group_at_exit(trainer: Any) -> bool:
    """Register (once per process) an ``atexit`` handler that destroys a gloo default process group.

    Lightning registers one only for NCCL (``lightning.fabric.utilities.distributed._init_dist_connection``,
    since 2.3, lightning#19931; read on 2.6.6), so a CPU run's gloo group lives until interpreter
    finalization, where gloo's worker threads can still hold finished work whose tensors need the
    GIL; the process then aborts (``terminate called without an active exception``, SIGABRT). That
    is a ``ddp_spawn`` worker (which exits through ``sys.exit``) or a ``ddp`` process ending its
    script: measured with ``trainer.test`` under ``ddp_spawn`` on digits, 4 of 40 runs without any
    qlightning callback and 1 of 30 with one (torch 2.13, lightning 2.6); pytorch/pytorch#179291
    proposed the same handler in torch and was abandoned. ``destroy_process_group`` shuts the
    backend down (joining its threads) while the interpreter is whole. ``ddp_fork`` workers leave
    through ``os._exit`` and never reach either.

    Args:
        trainer: the Trainer; nothing is registered unless :func:`is_distributed`.

    Returns:
        Whether the handler is registered in this process.
    """
    global _EXIT_HANDLER_REGISTERED
    if not _EXIT_HANDLER_REGISTERED and is_distributed(trainer):
        atexit.register(_destroy_gloo_group)
        _EXIT_HANDLER_REGISTERED = True
    return _EXIT_HANDLER_REGISTERED


def _destroy_gloo_group() -> None:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and "gloo" in str(dist.get_backend()):
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- transport
#
# Converted modules travel between processes twice: from rank 0 to the other ranks after rank 0
# converted (``broadcast_object``), and from rank 0 of a spawn/fork strategy back to the main
# process (Lightning's launcher, see RankZeroHandOver below). torch's own pickling of an FX
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

    Args:
        obj: what to pickle; a deep copy is changed, never ``obj``.
    """
    obj = copy.deepcopy(obj)  # the annotations are dropped from the copy only
    for value in _walk(obj):
        if isinstance(value, nn.Module):
            _drop_string_annotations(value)
    buffer = io.BytesIO()
    _ModulePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def loads_modules(data: bytes) -> Any:
    """What :func:`dumps_modules` pickled.

    Args:
        data: its bytes.
    """
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
    over the default process group Lightning set up); ``obj`` itself when not distributed.

    Args:
        trainer: the Trainer whose strategy broadcasts.
        obj: what rank ``src`` sends (the other ranks' value is ignored).
        src: the rank that sends.
    """
    if not is_distributed(trainer):
        return obj
    return trainer.strategy.broadcast(obj, src=src)


@contextmanager
def local_metrics(module: nn.Module) -> Iterator[None]:
    """torchmetrics ``Metric``s of ``module`` compute on this process's data only, without ``all_gather``.

    After a DDP fit the default process group stays up, and a ``Metric`` syncs whenever one is
    initialised; an evaluation that only rank 0 runs (the report) would wait for the other ranks
    forever, or fail once they have left (measured under torchrun: gloo "Connection closed by peer").

    Args:
        module: the module whose metrics stay local while the block runs.
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

    Args:
        module: the GraphModule to send as a whole.
    """
    from multiprocessing.reduction import ForkingPickler

    ForkingPickler.register(type(module), _reduce_whole)


# ---------------------------------------------------------------------------------------------- hand-over


class RankZeroHandOver:
    """Rank 0 converts and hands its result on: to the other ranks under DDP, and to the main process of a
    spawn/fork strategy (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``).

    A part of :class:`~qlightning.callbacks.qat.QuantizationAwareTraining` (its only user), kept apart
    from the Lightning hooks: it uses the callback's ``session``, ``engine``, ``spec``, ``targets``,
    ``convert`` and ``_gate``.
    """

    # ------------------------------------------------------------------ conversion on rank 0 only

    def _convert_on_rank_zero(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Under DDP: rank 0 converts (and, for ``lowering != "fx"``, times the runtimes and chooses);
        the other ranks receive its int8 modules and choice through the strategy's ``broadcast``.

        The buffers were just broadcast from rank 0, so every rank holds the model rank 0 converts.
        A module that does not pickle (e.g. PT2E's exported graphs) is converted on each rank
        instead, and rank 0's int8 state_dict is then loaded into it strictly.
        """
        message: Optional[dict[str, Any]] = None
        if trainer.is_global_zero:
            try:
                self.convert(pl_module)
                self._gate(pl_module)
                message = self._conversion_message(pl_module)
            except BaseException as exc:
                # tell the other ranks (waiting in the broadcast below) before raising here
                broadcast_object(trainer, {"error": f"{type(exc).__name__}: {exc}"})
                raise
        message = broadcast_object(trainer, message)
        if trainer.is_global_zero:
            return
        if "error" in message:
            raise QLightningError(f"QuantizationAwareTraining: rank 0 failed to convert to int8: {message['error']}")
        self._receive_conversion(pl_module, message)

    def _conversion_message(self, pl_module: "pl.LightningModule") -> dict[str, Any]:
        message: dict[str, Any] = {"int8": {}, "int8_state": {}, "lowered": {}, "lowering_choices": self.lowering_choices}
        for name in self.targets:
            int8 = self.int8_modules[name]
            try:
                message["int8"][name] = dumps_modules(int8)
            except Exception:  # converted on every rank, then loaded with rank 0's values
                buffer = io.BytesIO()
                torch.save(int8.state_dict(), buffer)
                message["int8_state"][name] = buffer.getvalue()
            lowered = pl_module.get_submodule(name)
            if lowered is not int8:
                try:
                    message["lowered"][name] = dumps_modules(lowered)
                except Exception:
                    message["lowered"][name] = None  # rebuilt from the choice on each rank
        return message

    def _receive_conversion(self, pl_module: "pl.LightningModule", message: dict[str, Any]) -> None:
        for name in self.targets:
            prepared = self.session.detach_fake_quant(pl_module, name)
            if name in message["int8"]:
                int8 = loads_modules(message["int8"][name])
            else:
                int8 = self.engine.convert(prepared, self.spec)
                state = torch.load(io.BytesIO(message["int8_state"][name]), weights_only=False)
                int8.load_state_dict(state, strict=True)
            self.int8_modules[name] = int8
            module = int8
            set_submodule(pl_module, name, int8)
            choice = message["lowering_choices"].get(name)
            if choice is not None:
                self.lowering_choices[name] = choice
                module = self._lowered_from(pl_module, name, int8, choice["name"], message["lowered"].get(name))
            set_submodule(pl_module, name, module)
        self.converted = True

    def _lowered_from(
        self, pl_module: "pl.LightningModule", name: str, int8: nn.Module, runtime: str, data: Optional[bytes]
    ) -> nn.Module:
        """The runtime rank 0 chose for ``name``: its pickled module, or built again (not timed) here."""
        if data is not None and runtime != ENGINE_MODULE:
            return attach_source(loads_modules(data), int8)
        return self.session.rebuild_lowered(name, int8, runtime, self.lowering_batch_size)

    # ------------------------------------------------------------------ spawn/fork strategies

    def _send_to_main_process(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Rank 0 of ``ddp_spawn``/``ddp_fork``: hand the QAT result to Lightning's launcher for the main process.

        Lightning returns rank 0's final ``state_dict`` to the main process and loads it with
        ``strict=False`` into a model that was never prepared nor converted (this is a copy of the
        callback; the main process has its own). The launcher's ``get_extra_results`` is the
        documented channel for extra results: this process's launcher (and only it) gets a wrapper
        that adds ours; the main process's side is :func:`install_main_process_recovery`.
        """
        # A file, like Lightning's own weights: the launcher joins the processes before it reads its
        # queue, so a payload larger than a pipe's buffer (64 KiB) would block rank 0 forever (measured).
        path = os.path.join(tempfile.mkdtemp(prefix="qlightning-"), "qat.pkl")
        with open(path, "wb") as f:
            f.write(self._main_process_payload(pl_module))
        compat.add_extra_result(trainer, _EXTRA_KEY, self.state_key, path)

    def _main_process_payload(self, pl_module: "pl.LightningModule") -> bytes:
        if self.converted:
            fake_quant = {name: m.state_dict() for name, m in self.fake_quant_modules.items()}
        else:
            fake_quant = {name: pl_module.get_submodule(name).state_dict() for name in self.targets}
        lowered: dict[str, Optional[bytes]] = {}
        for name in self.lowering_choices:
            module = pl_module.get_submodule(name)
            try:
                lowered[name] = None if module is self.int8_modules.get(name) else dumps_modules(module)
            except Exception:
                lowered[name] = None
        ptq: dict[str, bytes] = {}
        for name, module in self.ptq_modules.items():
            try:
                ptq[name] = dumps_modules(module)
            except Exception as exc:
                rank_zero_warn(f"[qlightning] the PTQ baseline of {name!r} does not reach the main process: {exc}")
        return dumps_modules(
            {
                "targets": list(self.targets),
                "converted": self.converted,
                "phase": None if self.phase is None else vars(self.phase).copy(),
                "provenance": self.provenance,
                "float_snapshot": self.float_snapshot,
                "float_snapshot_step": self.session.float_snapshot_step,
                "inputs": self.inputs,
                "fake_quant_state": fake_quant,
                "keep_fake_quant": self.keep_fake_quant and self.converted,
                "int8": {name: self.int8_modules[name] for name in self.targets} if self.converted else {},
                "lowered": lowered,
                "lowering_choices": self.lowering_choices,
                "ptq_modules": ptq,
                "state_keys": list(pl_module.state_dict().keys()),
            }
        )

    def _restore_in_main_process(self, pl_module: "pl.LightningModule", payload: bytes) -> list[str]:
        """The main process: rebuild what rank 0 ended with. Returns the state_dict keys rank 0 had.

        The fake-quant model is prepared again here from this process's float submodule (with rank 0's
        example inputs) and loaded strictly with rank 0's state: PT2E's exported modules do not pickle,
        and a pickled FX one would lose the engine's training paths (instance methods; see
        engines/fast_fq.py). The int8 modules are rank 0's own, unpickled.
        """
        data = loads_modules(payload)
        self.targets = data["targets"]
        self.inputs = data["inputs"]
        self.phase = Phase(**data["phase"]) if data["phase"] else None
        self.provenance = data["provenance"]
        self.float_snapshot = data["float_snapshot"]
        self.session.float_snapshot_step = data.get("float_snapshot_step")
        for name in self.targets:
            try:
                float_module = pl_module.get_submodule(name)
            except AttributeError as exc:
                raise QLightningError(
                    f"QuantizationAwareTraining: {name!r} is not a submodule of the main process's model (built in "
                    "configure_model?), so rank 0's QAT result cannot be put back there; use strategy='ddp'"
                ) from exc
            if self.ptq_batches:
                self.session.float_refs[name] = float_module
            prepared = self.engine.prepare(copy.deepcopy(float_module), self.inputs[name], self.spec)
            prepared.load_state_dict(data["fake_quant_state"][name], strict=True)
            if self.phase is not None:
                self.engine.set_phase(prepared, self.phase)
            self.engine.set_observers(prepared, False)
            if not data["converted"]:
                set_submodule(pl_module, name, prepared)
                continue
            if data["keep_fake_quant"]:
                self.fake_quant_modules[name] = prepared.eval()
            int8 = data["int8"][name]
            self.int8_modules[name] = int8
            module = int8
            set_submodule(pl_module, name, int8)
            if name in data["lowering_choices"]:
                self.lowering_choices[name] = data["lowering_choices"][name]
                module = self._lowered_from(pl_module, name, int8, self.lowering_choices[name]["name"], data["lowered"].get(name))
            set_submodule(pl_module, name, module)
        self.ptq_modules = {name: loads_modules(b) for name, b in data["ptq_modules"].items()}
        self.prepared = True
        self.converted = data["converted"]
        # the same Trainer may validate/test/predict next, spawning processes that receive this model
        for name in self.targets:
            for module in {id(m): m for m in (pl_module.get_submodule(name), self.int8_modules.get(name)) if m is not None}.values():
                if isinstance(module, torch.fx.GraphModule):
                    pickle_whole_for_new_processes(module)
        return data["state_keys"]


#: key of the QAT results in the extra results Lightning's multiprocessing launcher returns
_EXTRA_KEY = "qlightning_qat"


def install_main_process_recovery() -> None:
    """Let ``ddp_spawn``/``ddp_fork``/``ddp_notebook`` give the main process the converted model.

    After the processes join, Lightning loads rank 0's final ``state_dict`` into the main process's
    model, which was never prepared nor converted: the int8 weights would not fit it, or be skipped
    silently. Before that, each ``QuantizationAwareTraining`` of the trainer rebuilds rank 0's modules
    from what rank 0 sent (see ``_send_to_main_process``), so the state_dict fits exactly; after it,
    the keys are checked. See :func:`qlightning.callbacks.lightning_compat.install_main_process_recovery`.
    """
    compat.install_main_process_recovery(_rebuild_rank_zero_modules, _check_main_process_keys)


def _rebuild_rank_zero_modules(trainer: "pl.Trainer", extra: dict[str, Any], fitted: bool) -> dict[str, list[str]]:
    callbacks = [c for c in trainer.callbacks if isinstance(c, RankZeroHandOver)]
    sent = extra.get(_EXTRA_KEY, {})
    expected: dict[str, list[str]] = {}
    if fitted:  # a fit: rank 0's weights come back
        for callback in callbacks:
            if callback.state_key not in sent:
                raise QLightningError(
                    "QuantizationAwareTraining: rank 0 did not send its QAT state back to the main process "
                    "(the fit did not reach on_fit_end), so the main process's model cannot receive its "
                    "weights; resume from the last checkpoint with strategy='ddp'"
                )
            path = sent[callback.state_key]
            with open(path, "rb") as f:
                payload = f.read()
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
            expected[callback.state_key] = callback._restore_in_main_process(trainer.lightning_module, payload)
    return expected


def _check_main_process_keys(trainer: "pl.Trainer", expected: dict[str, list[str]]) -> None:
    for keys in expected.values():
        held = list(trainer.lightning_module.state_dict().keys())
        if set(held) != set(keys):
            raise QLightningError(
                "QuantizationAwareTraining: the main process's model does not have rank 0's structure after "
                f"the spawn strategy returned: missing {sorted(set(keys) - set(held))[:8]}, "
                f"unexpected {sorted(set(held) - set(keys))[:8]}"
            )
