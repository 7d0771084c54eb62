"""The PT2E engine: ``torch.export`` + torchao ``prepare_qat_pt2e`` / ``prepare_pt2e`` and ``convert_pt2e``.

torchao is optional: importing this module never imports it; constructing :class:`Pt2eEngine`
without torchao raises :class:`~qlightning.errors.EngineUnavailableError`.

Three things differ from torchao's own helpers, on purpose:

* ``train()`` / ``eval()``: an exported graph has no modules that know their mode, so the mode
  lives in the arguments of the ``aten.dropout`` / ``aten.batch_norm`` nodes. torchao's
  ``move_exported_model_to_train/eval`` rewrite them by pattern matching with ``ignore_literals``,
  which resets every dropout probability to 0.5 (and re-exports the patterns on every call). Here
  the prepared module's class gets a ``train()`` that flips the ``train``/``training`` flag of
  those nodes in place, so each dropout keeps its own ``p`` and each BatchNorm its momentum and
  eps. The class survives ``copy.deepcopy`` (``GraphModule.__deepcopy__`` keeps the type).
* BatchNorm freezing: the batch_norm nodes run with ``training=False`` (normalize with the
  running statistics, do not update them) while the rest of the model trains, exactly what
  ``freeze_bn_stats`` does for torch.ao's fused ConvBn modules; the ``num_batches_tracked += 1``
  nodes are neutralized too.
* ``convert``: torchao's ``_fold_conv_bn_qat`` exports 96 small patterns with dynamo (4 conv
  kinds x 12 variants x match/replacement), ~0.2 s each, whatever the model: ~20-30 s per
  ``convert_pt2e``. The fold here builds only the variants that occur in the graph (conv kind,
  per-channel or not, bias or not, BatchNorm training flag) and caches them per process; when a
  QAT conv-bn pattern is left unfolded it falls back to torchao's full fold. Likewise prepare
  runs torchao's conv-bn fuse only for the conv kinds in the graph (12 pattern exports -> 3).
* Dead code: the exported graph is dead-code-eliminated before annotation (an unused
  ``nn.Linear`` -> ``nn.Tanh``, e.g. BERT's pooler, makes ``X86InductorQuantizer`` fail with
  ``IndexError`` at ``partition.output_nodes[0]``), and the converted graph drops the fp32 weights
  and folded BatchNorm tensors ``convert_pt2e`` leaves beside the int8 ``_frozen_param*``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import itertools
import weakref
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn

from qlightning.engines.base import (
    Inputs, QuantEngine, QuantSpec, ZeroCenteredWeightRange, current_range_weight_ctr,
    keeps_last_observation, lean_float_phase, refuse_zero_gammas, register_plain_flag_setters, set_flag,
    settle_fake_quant_state, trained_qparams, x86_u8s8_pair_sums, zero_gammas,
)
from qlightning.engines.names import plain, resolve_reference
from qlightning.engines.traceable import (
    compile_training_forward, folded_variance, frozen_batch_norm_bias, hardtanh, make_traceable, relu,
    restore_fake_quants, uncompile, weight_out_of_fold,
)
from qlightning.core.quiet import quiet
from qlightning.errors import ConfigError, EngineUnavailableError, TraceError
from qlightning.core.schedule import Phase

#: the named qconfigs the pt2e engine takes: keyword arguments of get_default_x86_inductor_quantization_config
_X86_VARIANTS = {"default": {}, "dynamic": {"is_dynamic": True}, "reduce_range": {"reduce_range": True}}
_AUTO = "auto"  # what a spec gets without a qconfig_mapping.global: see auto_variant


def auto_variant() -> str:
    """The x86 variant ``auto`` stands for on this CPU: ``reduce_range`` (activations over 0..127) where the u8 x s8
    kernels' int16 pair sums saturate (:func:`~qlightning.engines.base.x86_u8s8_pair_sums`: no VNNI), else
    ``default`` (X86InductorQuantizer's 8-bit activations, for the VNNI CPUs it was written for). torch.ao's own x86
    QAT qconfig (the FX engine's) reduces the range on every CPU."""
    return "reduce_range" if x86_u8s8_pair_sums() == "int16" else "default"


_STATE_KEY = "qlightning_pt2e"  # in GraphModule.meta (deep-copied with the module)

# Keys that only the FX engine understands: (QuantSpec attribute or option, config key to name).
_FX_ONLY = (
    ("prepare_custom_config", "prepare_custom_config"),
    ("convert_custom_config", "convert_custom_config"),
    ("backend_config", "backend_config"),
)


def _quiet_torchao_import() -> Any:
    """Silence what importing torchao says on every CPU machine (nothing a user can act on): torchao logs a
    warning for every optional CUDA kernel library it cannot load on a CPU build and registers an Enum as a
    pytree constant, which torch's pytree logs as deprecated; it imports torch.utils.mkldnn, whose
    ``@torch.jit.script_method`` warns (torch 2.13)."""
    return quiet(messages=(r".*torch\.jit\.script_method.*deprecated",), loggers=("torchao", "torch.utils._pytree"))


def load_torchao() -> SimpleNamespace:
    """Import the torchao PT2E pieces the engine needs, or explain how to get them."""
    try:
        with _quiet_torchao_import():
            from torchao.quantization.pt2e import quantize_pt2e as quantize_pt2e_module
            from torchao.quantization.pt2e.fake_quantize import FakeQuantizeBase
            from torchao.quantization.pt2e.observer import ObserverBase
            from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e, prepare_qat_pt2e
            from torchao.quantization.pt2e.quantizer import Quantizer
            from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
                X86InductorQuantizer,
                get_default_x86_inductor_quantization_config,
            )
    except ImportError as exc:
        raise EngineUnavailableError(
            f"engine='pt2e' needs torchao with PT2E quantization (torchao.quantization.pt2e), "
            f"which could not be imported ({exc}). Install it with `pip install torchao` (a version "
            f"matching torch {torch.__version__}), or use engine='fx'."
        ) from exc
    # Quantizers written against torch.ao (older torchao / user code) use torch.ao's classes.
    fake_quant_types: tuple[type, ...] = (FakeQuantizeBase,)
    observer_types: tuple[type, ...] = (ObserverBase,)
    try:
        with quiet(all_warnings=True):
            from torch.ao.quantization.fake_quantize import FakeQuantizeBase as AoFakeQuantizeBase
            from torch.ao.quantization.observer import ObserverBase as AoObserverBase
        fake_quant_types += (AoFakeQuantizeBase,)
        observer_types += (AoObserverBase,)
    except ImportError:  # pragma: no cover - torch without torch.ao.quantization
        pass

    def x86_config(is_qat: bool = False, **kwargs: Any) -> Any:
        # QAT weights: the current weights' range, centred on zero (ZeroCenteredWeightRange says why)
        config = get_default_x86_inductor_quantization_config(is_qat=is_qat, **kwargs)
        return _tracking_current_weights(config) if is_qat else config

    return SimpleNamespace(
        quantize_pt2e_module=quantize_pt2e_module,
        convert_pt2e=convert_pt2e,
        prepare_pt2e=prepare_pt2e,
        prepare_qat_pt2e=prepare_qat_pt2e,
        Quantizer=Quantizer,
        X86InductorQuantizer=X86InductorQuantizer,
        x86_config=x86_config,
        get_default_x86_inductor_quantization_config=get_default_x86_inductor_quantization_config,
        fake_quant_types=fake_quant_types,
        observer_types=observer_types,
    )


#: aten average pools and means that X86InductorQuantizer quantizes on their input's observer
_AVERAGE_POOL_OPS = ("adaptive_avg_pool2d.default", "avg_pool2d.default", "mean.dim")


def observe_pool_outputs(model: torch.fx.GraphModule) -> int:
    """Give every annotated average pool / mean of ``model`` an output observer of its own instead of the
    ``SharedQuantizationSpec`` with its input that ``X86InductorQuantizer`` annotates (engine option
    ``pool_observers``, the FX engine's :func:`~qlightning.engines.fx.ao.with_pool_observers`); returns how many.

    Why (zoo, efficientnet_b0 x PT2E at 32x32): on the input's grid a mean of a 2x2 map ties exactly 25 % of the
    time, and inductor's int8 kernels round those ties otherwise than the eager q/dq graph: 26.6 dB, top-1
    agreement 0.984 against the fake-quant model, so ``lowering=auto`` refused inductor's 6.5x float speed.

    Args:
        model: the exported graph after the quantizer's ``annotate`` (annotations changed in place).
    """
    count = 0
    for node in model.graph.nodes:
        annotation = node.meta.get("quantization_annotation")
        if (node.op != "call_function" or annotation is None or not node.args
                or not any(str(node.target).endswith(op) for op in _AVERAGE_POOL_OPS)):
            continue
        shared_with = getattr(annotation.output_qspec, "edge_or_node", None)
        own = annotation.input_qspec_map.get(node.args[0])
        if shared_with == (node.args[0], node) and own is not None:
            annotation.output_qspec = own  # the same kind of observer, a new instance at prepare
            count += 1
    return count


@functools.lru_cache(maxsize=None)
def _pool_observing_quantizer(base: type) -> type:
    """A torchao ``Quantizer`` (``base``) that runs another quantizer and then :func:`observe_pool_outputs` (made here,
    once: torchao is imported only when the engine is used)."""

    class PoolObservingQuantizer(base):  # type: ignore[misc, valid-type]
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def transform_for_annotation(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
            return self.inner.transform_for_annotation(model)

        def annotate(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
            model = self.inner.annotate(model)
            observe_pool_outputs(model)
            return model

        def validate(self, model: torch.fx.GraphModule) -> None:
            self.inner.validate(model)

    return PoolObservingQuantizer


@functools.lru_cache(maxsize=None)
def _zero_centered_fake_quantize(base: type) -> type:
    """torchao's ``FusedMovingAvgObsFakeQuantize`` (``base``) with :class:`ZeroCenteredWeightRange`: made here,
    not at import, because importing this module never imports torchao."""
    return type("ZeroCenteredFusedFakeQuantize", (ZeroCenteredWeightRange, base), {"__module__": __name__})


def _tracking_current_weights(config: Any) -> Any:
    """A QAT ``QuantizationConfig`` whose fused weight fake-quant takes the current weights' range at each step
    (``averaging_constant=1``) centred on zero (:class:`ZeroCenteredWeightRange`, which says why); as the FX
    engine's defaults (``qlightning.engines.fx.weights``). Other weight specs are returned as they are."""
    spec = config.weight
    ctr = getattr(spec, "observer_or_fake_quant_ctr", None)
    base = getattr(getattr(ctr, "p", None), "func", None)
    tracked = current_range_weight_ctr(ctr, _zero_centered_fake_quantize(base)) if isinstance(base, type) else None
    if tracked is None:
        return config
    return dataclasses.replace(config, weight=dataclasses.replace(spec, observer_or_fake_quant_ctr=tracked))


# --------------------------------------------------------------------------- train / eval of graphs

_aten = torch.ops.aten
# ops whose (input, p, train) arguments carry the mode
_DROPOUT_OPS = {
    getattr(_aten, name).default
    for name in (
        "dropout",
        "dropout_",
        "feature_dropout",
        "feature_dropout_",
        "alpha_dropout",
        "alpha_dropout_",
        "feature_alpha_dropout",
        "feature_alpha_dropout_",
    )
    if hasattr(_aten, name)
}
# ops whose (input, weight, bias, running_mean, running_var, training, momentum, eps, ...) carry the mode
_BATCH_NORM_OPS = {_aten.batch_norm.default, _aten._native_batch_norm_legit.default}
# the layers whose output a QAT conv-bn fold divides by the BatchNorm's scale (torchao's _qat_conv_bn_pattern)
_FOLDED_LAYERS = {
    getattr(packet, overload)
    for packet in (getattr(_aten, n) for n in ("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                                                "conv_transpose3d") if hasattr(_aten, n))
    for overload in packet.overloads()
}


def _set_arg(node: torch.fx.Node, index: int, name: str, value: Any) -> bool:
    """Set positional argument ``index`` (or keyword ``name``) of ``node``; return whether it changed."""
    if len(node.args) > index:
        if node.args[index] == value and type(node.args[index]) is type(value):
            return False
        args = list(node.args)
        args[index] = value
        node.args = tuple(args)
        return True
    if name in node.kwargs:
        if node.kwargs[name] == value and type(node.kwargs[name]) is type(value):
            return False
        node.kwargs = {**node.kwargs, name: value}
        return True
    return False


def _is_bn_counter(node: torch.fx.Node) -> bool:
    """``num_batches_tracked.add_(1)``: the statistics counter of a training BatchNorm."""
    return (
        node.op == "call_function"
        and node.target == _aten.add_.Tensor
        and isinstance(node.args[0], torch.fx.Node)
        and node.args[0].op == "get_attr"
        and str(node.args[0].target).endswith("num_batches_tracked")
    )


def _graph_state(gm: torch.fx.GraphModule) -> dict[str, Any]:
    return gm.meta.setdefault(_STATE_KEY, {"bn_frozen": False})


@dataclasses.dataclass(frozen=True)
class _PhaseParts:
    """What a phase switches in one prepared module (:meth:`Pt2eEngine._phase_parts`)."""

    quant_modules: tuple[tuple[str, nn.Module], ...]  # top-level fake-quants and plain observers, by name
    learnable: frozenset[int]  # ids of those that learn their scale / zero point (LearnableFakeQuantize)
    graphs: tuple[torch.fx.GraphModule, ...]  # the exported graphs whose dropout / BatchNorm nodes switch
    weight_fake_quants: frozenset[int]  # ids of the modules called on parameters and buffers alone (weights)


def _fed_by_parameters_alone(graphs: tuple[torch.fx.GraphModule, ...]) -> frozenset[int]:
    """ids of the modules ``graphs`` call on values computed from parameters and buffers alone, no graph input
    in their ancestry: the weights' fake-quants (a conv-bn's on ``w * gamma / std``). A nested graph's inputs
    count as data, so a fake-quant there is never taken for a weight's."""
    found: set[int] = set()
    for gm in graphs:
        data: set[torch.fx.Node] = set()
        for node in gm.graph.nodes:
            if node.op == "placeholder" or any(arg in data for arg in node.all_input_nodes):
                data.add(node)
            elif node.op == "call_module":
                found.add(id(gm.get_submodule(node.target)))
    return frozenset(found)


# per graph module: its generated code and the graph modules in it (itself included), found again only
# after a recompile
_NESTED_GRAPHS: weakref.WeakKeyDictionary[torch.fx.GraphModule, tuple[str, tuple[torch.fx.GraphModule, ...]]] = (
    weakref.WeakKeyDictionary())
# per graph module: the generated code it last had from _rewrite_modes and the modes set in it. The
# callback applies a phase at every training batch and walking every node cost more than the switch;
# the code string is regenerated by every recompile (ours after a change, torchao's graph rewrites),
# so a graph rewritten since is walked again.
_MODES_SET: weakref.WeakKeyDictionary[torch.fx.GraphModule, tuple[str, bool, bool]] = weakref.WeakKeyDictionary()


def _rewrite_modes(gm: torch.fx.GraphModule, training: bool) -> None:
    """Put dropout and BatchNorm nodes of ``gm`` (and nested graphs) in train or eval mode, in place."""
    bn_training = training and not _graph_state(gm)["bn_frozen"]
    found = _NESTED_GRAPHS.get(gm)
    if found is None or found[0] is not gm.code:
        found = _NESTED_GRAPHS[gm] = (gm.code, tuple(m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)))
    for sub in found[1]:
        done = _MODES_SET.get(sub)
        if done is not None and done[0] is sub.code and done[1:] == (bool(training), bool(bn_training)):
            continue
        changed = False
        for node in sub.graph.nodes:
            if node.op != "call_function":
                continue
            if node.target in _DROPOUT_OPS:
                changed |= _set_arg(node, 2, "train", bool(training))
            elif node.target in _BATCH_NORM_OPS or node.target is _folded_batch_norm:
                changed |= _set_arg(node, 5, "training", bool(bn_training))
            elif _is_bn_counter(node):
                changed |= _set_arg(node, 1, "other", 1 if bn_training else 0)
        if changed:
            sub.recompile()
        _MODES_SET[sub] = (sub.code, bool(training), bool(bn_training))


#: the suffix of a snapshot buffer of a BatchNorm's running variance (non-persistent: not in ``state_dict``)
_FOLDED_VARIANCE = "_qlightning_folded"


def _folds_from_snapshots(module: nn.Module) -> list[tuple[str, str]]:
    """Route the reads of a BatchNorm's running variance other than the batch_norm node's own (the conv-bn QAT
    fold's ``sqrt(running_var + eps)``) through :func:`~qlightning.engines.traceable.folded_variance` and a
    snapshot buffer, in every graph of ``module``; return the ``(running_var, snapshot)`` buffer paths for the
    compiled caller to refresh. Undone by :func:`_unfold_snapshots` (torchao's convert matches the fold with one
    placeholder for both reads).

    Args:
        module: the prepared module.
    """
    pairs = []
    for path, gm in module.named_modules():
        if not isinstance(gm, torch.fx.GraphModule):
            continue
        prefix, changed = f"{path}." if path else "", False
        for bn in list(gm.graph.nodes):
            if bn.op != "call_function" or bn.target not in _BATCH_NORM_OPS:
                continue
            var = bn.args[4]
            if not isinstance(var, torch.fx.Node) or var.op != "get_attr":
                continue
            readers = [u for u in var.users if u.target not in _BATCH_NORM_OPS and u.target is not folded_variance]
            name = f"{str(var.target).replace('.', '_')}{_FOLDED_VARIANCE}"
            if not readers or name in gm._buffers:
                continue
            gm.register_buffer(name, gm.get_buffer(str(var.target)).detach().clone(), persistent=False)
            with gm.graph.inserting_after(var):
                snapshot = gm.graph.get_attr(name)
            with gm.graph.inserting_after(snapshot):
                read = gm.graph.call_function(folded_variance, (var, snapshot))
            for user in readers:
                user.replace_input_with(var, read)
            pairs.append((f"{prefix}{var.target}", f"{prefix}{name}"))
            changed = True
        if changed:
            gm.recompile()
    return pairs


def _rewrite_graphs(module: nn.Module, rewrite: Callable[[torch.fx.GraphModule], bool]) -> None:
    """Apply ``rewrite`` to every GraphModule in ``module``; recompile those it says it changed."""
    for gm in module.modules():
        if isinstance(gm, torch.fx.GraphModule) and rewrite(gm):
            gm.recompile()


def _unfold_snapshots(module: nn.Module) -> None:
    """Undo :func:`_folds_from_snapshots`: every fold reads ``running_var`` again; the snapshot buffers are gone."""

    def unfold(gm: torch.fx.GraphModule) -> bool:
        changed = False
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target is folded_variance:
                var, snapshot = node.args
                node.replace_all_uses_with(var)
                gm.graph.erase_node(node)
                if not snapshot.users:
                    gm.graph.erase_node(snapshot)
                    gm._buffers.pop(str(snapshot.target), None)
                changed = True
        return changed

    _rewrite_graphs(module, unfold)


def _aten_hardtanh(x: torch.Tensor, min_val: float = -1.0, max_val: float = 1.0) -> torch.Tensor:
    """``aten.hardtanh(x, min_val, max_val)`` (its defaults) through :func:`~qlightning.engines.traceable.hardtanh`."""
    return hardtanh(x, min_val, max_val)


#: the exported graph's ReLU / ReLU6 ops and their float-mask forms, whose backward saves no bool mask
_FLOAT_MASK_OPS = {
    **{getattr(_aten, n).default: relu for n in ("relu", "relu_") if hasattr(_aten, n)},
    **{getattr(_aten, n).default: _aten_hardtanh for n in ("hardtanh", "hardtanh_") if hasattr(_aten, n)},
}
#: a node's (target, kwargs) before a compiled-path rewrite (:func:`_retarget`), put back by :func:`_restore_targets`
_ORIGINAL_TARGET = "qlightning_original_target"


def _retarget(node: torch.fx.Node, target: Callable, kwargs: dict[str, Any] | None = None) -> None:
    node.meta[_ORIGINAL_TARGET] = (node.target, node.kwargs)
    node.target = target
    if kwargs is not None:
        node.kwargs = kwargs


def _restore_targets(module: nn.Module) -> None:
    """Undo :func:`_float_mask_relus`, :func:`_fold_frozen_batch_norms` and :func:`_train_zero_gammas`: the aten ops
    and torchao's fold again (torchao's convert matches them)."""

    def to_aten(gm: torch.fx.GraphModule) -> bool:
        nodes = [n for n in gm.graph.nodes if _ORIGINAL_TARGET in n.meta]
        for node in nodes:
            node.target, node.kwargs = node.meta.pop(_ORIGINAL_TARGET)
        inserted = [n for n in gm.graph.nodes if n.meta.get(_INSERTED)]
        for node in inserted:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
        return bool(nodes or inserted)

    _rewrite_graphs(module, to_aten)


def _float_mask_relus(module: nn.Module) -> None:
    """Point every ``aten.relu`` / ``aten.hardtanh`` node of ``module``'s graphs at its float-mask form (the same
    values, the gradient through a float mask). Their aten backwards take a bool mask, which inductor's min-cut
    partition saves from the forward where a ReLU's output has several users (a residual block's ReLU feeds its
    fake-quant and the skip add) and its C++ code stores an element at a time: the ResNet-18-like net's compiled
    observing step took 1.21x the float step against the FX engine's 1.05x (notes/perf.md section 37). Undone by
    :func:`_restore_targets`.

    Args:
        module: the prepared module.
    """

    def to_float_masks(gm: torch.fx.GraphModule) -> bool:
        nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _FLOAT_MASK_OPS]
        for node in nodes:
            _retarget(node, _FLOAT_MASK_OPS[node.target])
        return bool(nodes)

    _rewrite_graphs(module, to_float_masks)


def _folded_batch_norm(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, running_mean: torch.Tensor,
                       running_var: torch.Tensor, training: bool, momentum: float, eps: float, cudnn_enabled: bool, *,
                       layer_output: torch.Tensor, scale_factor: torch.Tensor,
                       layer_bias: Optional[torch.Tensor] = None, layer: Optional[str] = None,
                       layer_args: Optional[tuple[Any, ...]] = None, layer_weight: Optional[torch.Tensor] = None,
                       ) -> torch.Tensor:
    """``aten.batch_norm`` of a QAT conv-bn fold's ``input = layer_output / scale_factor [+ layer_bias]``, with
    ``layer_output = layer(*layer_args)``, ``layer_args = (x, fq(w * s), zero bias, ...)``.

    BatchNorm training, the division is on the weight, ``layer(x, fq(w * s) / s, ...)``, as the FX engine's fold
    (where ``layer`` names an ``aten`` convolution; a channel of gamma 0 takes ``layer_weight``, ``w`` itself:
    :func:`~qlightning.engines.traceable.weight_out_of_fold`); with ``training=False`` (BatchNorm frozen) the fold is whole:
    ``layer_output + (layer_bias - mean) * s + beta``, ``s = gamma / running_std`` (``scale_factor``, shaped per
    output channel; :func:`~qlightning.engines.traceable.frozen_batch_norm_bias`). The same function up to float
    rounding, without torchao's output-sized division (and, frozen, its BatchNorm); the unused division and
    convolution are dropped by the compiler."""
    if not training:
        folded = frozen_batch_norm_bias(bias, running_mean, scale_factor.reshape(-1),
                                        None if layer_bias is None else layer_bias.reshape(-1))
        return layer_output + folded.reshape(scale_factor.shape)
    if layer is not None and layer_args is not None:
        x, scaled_weight, *rest = layer_args
        per_output_channel = scale_factor.reshape([-1] + [1] * (scaled_weight.dim() - 1))
        divided = (scaled_weight / per_output_channel if layer_weight is None  # a channel of gamma 0: the weight itself
                   else weight_out_of_fold(scaled_weight, per_output_channel, layer_weight))
        input = getattr(_aten, layer)(x, divided, *rest)
        if layer_bias is not None:
            input = input + layer_bias
    return _aten.batch_norm.default(input, weight, bias, running_mean, running_var, training, momentum, eps,
                                    cudnn_enabled)


#: the convolutions whose output channels are their weight's first dimension (a transposed one's are not)
_WEIGHT_DIVIDED_LAYERS = {
    overload: name for name in ("conv1d", "conv2d", "conv3d") if hasattr(_aten, name)
    for overload in (getattr(getattr(_aten, name), o) for o in getattr(_aten, name).overloads())
}


def _fold_frozen_batch_norms(module: nn.Module) -> None:
    """Point every ``aten.batch_norm`` node fed by a QAT conv-bn fold (``div(conv, s) [+ bias]``, torchao's
    ``_qat_conv_bn_pattern``) at :func:`_folded_batch_norm`, given the fold's parts: compiled, torchao's fold
    divides the full conv output and, with the BatchNorm frozen, still runs the BatchNorm over it, a fused pass
    forward and reductions backward each (notes/perf.md sections 38-40). Undone by :func:`_restore_targets`.

    Args:
        module: the prepared module.
    """

    def fold(gm: torch.fx.GraphModule) -> bool:
        changed = False
        for node in list(gm.graph.nodes):
            fold_parts = _fold_parts(node)
            if fold_parts is None:
                continue
            layer_output = fold_parts["layer"]
            parts: dict[str, Any] = {"layer_output": layer_output, "scale_factor": fold_parts["divisor"],
                                     "layer_bias": fold_parts["layer_bias"]}
            if layer_output.target in _WEIGHT_DIVIDED_LAYERS and not layer_output.kwargs and len(layer_output.users) == 1:
                parts.update(layer=_WEIGHT_DIVIDED_LAYERS[layer_output.target], layer_args=tuple(layer_output.args))
                if fold_parts["weight"] is not None:
                    parts["layer_weight"] = fold_parts["weight"]
            _retarget(node, _folded_batch_norm, parts)
            changed = True
        return changed

    _rewrite_graphs(module, fold)


def _own_weight_where_zero(folded: torch.Tensor, scale_factor: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The fold's fake-quantized ``w * s`` (``folded``), or the layer's own ``weight`` in an output channel whose ``s``
    (``scale_factor``, shaped over the weight) is 0."""
    return torch.where(scale_factor == 0, weight, folded)


def _one_where_zero(scale_factor: torch.Tensor) -> torch.Tensor:
    """``scale_factor`` with its zeros replaced by 1: the fold's divisor of a channel that convolved its own weight."""
    return torch.where(scale_factor == 0, torch.ones_like(scale_factor), scale_factor)


#: a node :func:`_train_zero_gammas` inserted in front of a fold's own (its first argument), which
#: :func:`_restore_targets` puts back (a mark, not the nodes: ``deepcopy`` copies a node's meta shallowly)
_INSERTED = "qlightning_inserted"


def _fold_parts(bn: torch.fx.Node) -> Optional[dict[str, Optional[torch.fx.Node]]]:
    """The nodes of the QAT conv-bn fold (torchao's ``_qat_conv_bn_pattern``) feeding the ``aten.batch_norm`` node
    ``bn``, ``batch_norm(div(layer(x, fq(mul(w, s_w)), 0), s) [+ reshape(b)])`` with an affine BatchNorm, or ``None``
    where ``bn`` is not fed by one: ``div``, ``layer``, ``divisor`` (``s``), ``layer_bias`` (``reshape(b)`` or
    ``None``), and ``folded``, ``weight``, ``weight_scale`` (``fq(...)``, ``w``, ``s_w``; ``None`` where the layer's
    weight is not a fake-quant of such a product)."""
    if (bn.op != "call_function" or bn.target is not _aten.batch_norm.default or bn.kwargs or len(bn.args) < 3
            or bn.args[1] is None or bn.args[2] is None):  # an affine BatchNorm, as torchao's fold
        return None
    source, layer_bias = bn.args[0], None
    if (isinstance(source, torch.fx.Node) and source.target is _aten.add.Tensor and len(source.users) == 1
            and isinstance(source.args[0], torch.fx.Node) and isinstance(source.args[1], torch.fx.Node)
            and source.args[1].target in (_aten.reshape.default, _aten.view.default)):  # the conv's bias
        source, layer_bias = source.args
    if (not isinstance(source, torch.fx.Node) or source.target is not _aten.div.Tensor
            or not all(isinstance(a, torch.fx.Node) for a in source.args)):
        return None
    layer, divisor = source.args
    if layer.target not in _FOLDED_LAYERS:
        return None
    parts: dict[str, Optional[torch.fx.Node]] = {"div": source, "layer": layer, "divisor": divisor,
                                                 "layer_bias": layer_bias, "folded": None, "weight": None,
                                                 "weight_scale": None}
    folded = layer.args[1] if len(layer.args) > 1 else None
    product = folded.args[0] if isinstance(folded, torch.fx.Node) and folded.op == "call_module" and folded.args else None
    if (isinstance(product, torch.fx.Node) and product.target is _aten.mul.Tensor
            and all(isinstance(a, torch.fx.Node) for a in product.args)):
        parts.update(folded=folded, weight=product.args[0], weight_scale=product.args[1])
    return parts


def _train_zero_gammas(module: nn.Module) -> list[str]:
    """Let each QAT conv-bn fold whose BatchNorm has a gamma of exactly 0 (timm's ``zero_init_last``, torchvision's
    ``zero_init_residual``) train: that channel convolves the layer's own weight and divides by 1.

    torchao's fold is ``bn(conv(x, fq(w * s)) / s)``, ``0 / 0`` where gamma is 0: NaN from the first step. A
    training BatchNorm's output in a channel of gamma 0 is its beta whatever the conv computes, so the forward is
    unchanged, and gamma's gradient is the float model's (the normalized conv output), so it trains from 0; once
    it has moved, the channel folds as torchao's. Only folds with such a gamma now are rewritten (two small ops on
    the weight and the divisor). Undone by :func:`_restore_targets` (torchao's convert matches its own pattern);
    the compiled path's fold does the same in :func:`_folded_batch_norm`.

    Args:
        module: the prepared module.

    Returns:
        The BatchNorms (:func:`~qlightning.engines.base.zero_gammas`) with such a gamma that a division feeds but
        that are not in the fold's pattern as this function knows it: left as they are, NaN.
    """
    missed: list[tuple[str, torch.Tensor]] = []

    def rewrite(gm: torch.fx.GraphModule) -> bool:
        changed = False
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target is not _aten.batch_norm.default or len(node.args) < 2:
                continue
            gamma = _get_attr_value(gm, node.args[1])
            if not isinstance(gamma, torch.Tensor) or bool(gamma.all()):
                continue
            parts = _fold_parts(node)
            if parts is None or parts["weight"] is None:
                source = node.args[0]
                if isinstance(source, torch.fx.Node) and source.target is _aten.add.Tensor:
                    source = source.args[0]
                if isinstance(source, torch.fx.Node) and source.target is _aten.div.Tensor:
                    name = str(node.args[1].target).removesuffix(".weight")
                    missed.append((name, gamma))
                continue
            layer, div = parts["layer"], parts["div"]
            with gm.graph.inserting_before(layer):
                weight = gm.graph.call_function(_own_weight_where_zero, (parts["folded"], parts["weight_scale"], parts["weight"]))
            with gm.graph.inserting_before(div):
                divisor = gm.graph.call_function(_one_where_zero, (parts["divisor"],))
            for inserted in (weight, divisor):
                inserted.meta[_INSERTED] = True
            layer.args = (layer.args[0], weight, *layer.args[2:])
            div.args = (div.args[0], divisor)
            changed = True
        return changed

    _rewrite_graphs(module, rewrite)
    return zero_gammas(missed)


def _get_attr_value(gm: torch.fx.GraphModule, node: Any) -> Any:
    """The tensor a ``get_attr`` node reads, else ``None``."""
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    value: Any = gm
    for part in str(node.target).split("."):
        value = getattr(value, part, None)
    return value


class _ExportedTrainEval:
    """Mixin for exported GraphModules: ``train()``/``eval()`` switch dropout and BatchNorm nodes."""

    def train(self, mode: bool = True) -> nn.Module:  # type: ignore[override]
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        _rewrite_modes(self, mode)  # type: ignore[arg-type]
        return nn.Module.train(self, mode)  # type: ignore[arg-type]

    def eval(self) -> nn.Module:  # type: ignore[override]
        return self.train(False)


_TRAIN_EVAL_CLASSES: dict[type, type] = {}


def _install_train_eval(gm: torch.fx.GraphModule, training: bool) -> torch.fx.GraphModule:
    """Give ``gm`` a class whose ``train()/eval()`` work (export and torchao make them raise)."""
    for attr in ("train", "eval"):  # instance overrides set by ExportedProgram.module() / convert_pt2e
        gm.__dict__.pop(attr, None)
    if not isinstance(gm, _ExportedTrainEval):
        # GraphModule gives every instance its own class "GraphModuleImpl" (holding forward and
        # __call__) under the user-visible class; put ours between them and rebuild the instance
        # class the same way, so deepcopy (GraphModule.__new__) keeps it.
        base = next(c for c in type(gm).__mro__ if c.__qualname__.split(".")[-1] != "GraphModuleImpl")
        if base not in _TRAIN_EVAL_CLASSES:
            _TRAIN_EVAL_CLASSES[base] = type(f"Pt2e{base.__name__.lstrip('_')}", (_ExportedTrainEval, base), {})
        gm.__class__ = type("GraphModuleImpl", (_TRAIN_EVAL_CLASSES[base],), {})
        gm.recompile()
    _graph_state(gm)
    gm.train(training)
    return gm


# --------------------------------------------------------------------------- observers

def _observer_passthrough(x: Any, *args: Any, **kwargs: Any) -> Any:
    """Forward of a switched-off plain observer (PTQ): the input, unobserved."""
    return x


def _set_plain_observer(observer: nn.Module, enabled: bool) -> None:
    if enabled:
        observer.__dict__.pop("forward", None)
    else:
        observer.forward = _observer_passthrough  # type: ignore[method-assign]


# --------------------------------------------------------------------------- fast conv-bn fold

_PATTERN_CACHE: dict[tuple[Any, ...], torch.fx.GraphModule] = {}


def _conv_variants(m: torch.fx.GraphModule) -> set[tuple[Callable, bool, bool, bool, bool]]:
    """The (conv_fn, per_channel, has_bias, bias_quantized, bn_training) variants present in ``m``.

    Read from each convolution whose weight is dequantized (after torchao's reference Q/DQ
    decomposition); a variant missed here leaves an unfolded pattern, which the caller detects.
    """
    import torch.nn.functional as F

    conv_fns = {
        _aten.conv1d.default: F.conv1d,
        _aten.conv2d.default: F.conv2d,
        _aten.conv_transpose1d.default: F.conv_transpose1d,
        _aten.conv_transpose2d.input: F.conv_transpose2d,
    }
    qd = torch.ops.quantized_decomposed
    dq_per_channel = {qd.dequantize_per_channel.default}
    dq_per_tensor = {qd.dequantize_per_tensor.default, qd.dequantize_per_tensor.tensor}
    dq_ops = dq_per_channel | dq_per_tensor
    bn_nodes = [n for n in m.graph.nodes if n.op == "call_function" and n.target in _BATCH_NORM_OPS]
    bn_modes = {bool(n.args[5]) for n in bn_nodes if len(n.args) > 5} or {True, False}
    variants: set[tuple[Callable, bool, bool, bool, bool]] = set()
    for node in m.graph.nodes:
        if node.op != "call_function" or node.target not in conv_fns:
            continue
        weight = node.args[1] if len(node.args) > 1 else None
        if not isinstance(weight, torch.fx.Node) or weight.target not in dq_ops:
            continue  # weight not quantized: no quantized QAT pattern can match here
        per_channel = weight.target in dq_per_channel
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        has_bias = bias is not None
        bias_quantized = isinstance(bias, torch.fx.Node) and bias.target in dq_ops
        for bn_training in bn_modes:
            variants.add((conv_fns[node.target], per_channel, has_bias, bias_quantized, bn_training))
    return variants


def _unfolded_qat_conv_bn(m: torch.fx.GraphModule) -> bool:
    """Whether a quantized QAT conv-bn pattern (conv(dq(w)) -> div [-> add bias] -> batch_norm) is left.

    Convolutions whose weight is not quantized (e.g. conv1d under X86InductorQuantizer, which
    annotates conv2d and linear only) are not folded by torchao either and do not count.
    """
    from torchao.quantization.pt2e.utils import _is_conv_or_conv_transpose_node

    qd = torch.ops.quantized_decomposed
    dq_ops = {qd.dequantize_per_channel.default, qd.dequantize_per_tensor.default, qd.dequantize_per_tensor.tensor}
    for node in m.graph.nodes:
        if node.op != "call_function" or node.target not in _BATCH_NORM_OPS:
            continue
        x = node.args[0]
        if isinstance(x, torch.fx.Node) and x.target == _aten.add.Tensor:
            x = x.args[0]
        if isinstance(x, torch.fx.Node) and x.target == _aten.div.Tensor:
            x = x.args[0]
            if (
                isinstance(x, torch.fx.Node)
                and _is_conv_or_conv_transpose_node(x)
                and isinstance(x.args[1], torch.fx.Node)
                and x.args[1].target in dq_ops
            ):
                return True
    return False


def _fast_fold_conv_bn_qat(m: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """torchao's ``_fold_conv_bn_qat`` restricted to the pattern variants that occur in ``m``.

    Same steps as torchao 0.18 ``qat_utils._fold_conv_bn_qat_helper``, only the loop over the 96
    (conv kind x variant) patterns is cut to those present and the exported patterns are cached.
    Where torchao's private helpers are not there (another torchao version), torchao's own fold runs.
    """
    import torch.nn.functional as F
    from torch.fx.subgraph_rewriter import replace_pattern_with_filters
    from torchao.quantization.pt2e import qat_utils as qu

    try:
        from torchao.quantization.pt2e.utils import _get_aten_graph_module_for_pattern, fold_bn_weights_into_conv_node

        h = SimpleNamespace(
            **{
                name: getattr(qu, name)
                for name in (
                    "_is_bn_node",
                    "_duplicate_dequantize_node",
                    "_remove_extra_dequantize",
                    "_get_quantized_conv_bn_example_inputs_kwargs",
                    "_get_quantized_qat_conv_bn_pattern",
                    "_get_folded_quantized_qat_conv_bn_pattern",
                    "_get_conv_bn_pattern_nodes",
                    "_copy_over_q_dq_args",
                    "_filter_nodes_map",
                    "_is_conv_or_conv_transpose_node",
                    "_copy_over_literal_conv_args",
                )
            }
        )
    except (ImportError, AttributeError):  # pragma: no cover - depends on the torchao version
        return qu._fold_conv_bn_qat(m)

    if not any(h._is_bn_node(n) for n in m.graph.nodes):
        return m
    m.graph.eliminate_dead_code()
    m.recompile()
    h._duplicate_dequantize_node(m)
    variants = _conv_variants(m)
    # x, conv_weight, bn_weight, bn_bias, bn_running_mean, bn_running_var (as torchao's fold)
    inputs_1d = (torch.randn(1, 1, 3), torch.randn(1, 1, 1), *(torch.randn(1) for _ in range(4)))
    inputs_2d = (torch.randn(1, 1, 3, 3), torch.randn(1, 1, 1, 1), *(torch.randn(1) for _ in range(4)))
    example_inputs = {
        F.conv1d: inputs_1d,
        F.conv2d: inputs_2d,
        F.conv_transpose1d: inputs_1d,
        F.conv_transpose2d: inputs_2d,
    }
    is_cuda = any(t.device.type == "cuda" for t in itertools.chain(m.parameters(), m.buffers()))

    replacements = []
    for conv_fn, *flags in sorted(variants, key=lambda v: (v[0].__name__, v[1:])):
        per_channel, has_bias, bias_quantized, bn_training = flags
        kwargs = h._get_quantized_conv_bn_example_inputs_kwargs(per_channel, has_bias, bias_quantized, is_cuda)
        patterns = {}
        for kind, make in (
            ("match", h._get_quantized_qat_conv_bn_pattern),
            ("replacement", h._get_folded_quantized_qat_conv_bn_pattern),
        ):
            key = (kind, conv_fn.__name__, tuple(flags), is_cuda)
            if key not in _PATTERN_CACHE:
                pattern = make(per_channel, has_bias, bias_quantized, conv_fn, bn_training)
                _PATTERN_CACHE[key] = _get_aten_graph_module_for_pattern(
                    pattern, example_inputs[conv_fn], is_cuda, **kwargs
                )
            patterns[kind] = copy.deepcopy(_PATTERN_CACHE[key])
        replacements.extend(
            replace_pattern_with_filters(m, patterns["match"], patterns["replacement"], ignore_literals=True)
        )
    m.recompile()
    h._remove_extra_dequantize(m)

    for r in replacements:
        node_map = h._get_conv_bn_pattern_nodes(r)
        for original_node, replacement_node in node_map.values():
            replacement_node.meta = original_node.meta
        h._copy_over_q_dq_args(*node_map["conv_weight_q"])
        h._copy_over_q_dq_args(*node_map["conv_weight_dq"])
        if "conv_bias_q" in node_map:
            h._copy_over_q_dq_args(*node_map["conv_bias_q"])
            h._copy_over_q_dq_args(*node_map["conv_bias_dq"])
        conv_node = node_map["conv"][1]
        conv_bias = node_map["conv_bias"][1] if "conv_bias" in node_map else None
        # torchao folds with the folded pattern's BatchNorm, written with F.batch_norm's eps (1e-5); the model's
        # eps is on the matched node (kept at prepare, _keeping_batch_norm_literals): fold with that one
        _copy_batch_norm_eps(*node_map["bn"])
        fold_bn_weights_into_conv_node(conv_node, node_map["conv_weight"][1], conv_bias, node_map["bn"][1], m)
        for original_node in h._filter_nodes_map(r.nodes_map).values():
            if h._is_conv_or_conv_transpose_node(original_node):
                h._copy_over_literal_conv_args(original_node, conv_node)

    for node in list(m.graph.nodes):
        if _is_bn_counter(node) and not node.users:
            m.graph.erase_node(node)
    m.graph.eliminate_dead_code()
    m.recompile()
    # torchao's fold drops the folded BatchNorm attributes as a side effect of its later pattern
    # replacements (subgraph_rewriter deletes unused submodules); do it explicitly.
    m.delete_all_unused_submodules()
    if _unfolded_qat_conv_bn(m):  # a variant this analysis missed: let torchao try all of them
        m = qu._fold_conv_bn_qat(m)
    return m


def _batch_norm_eps_index(node: torch.fx.Node) -> int:
    """Where ``eps`` is among a BatchNorm node's arguments (the inference op has no ``training``)."""
    return 6 if "no_training" in str(node.target) else 7


def _copy_batch_norm_eps(source: torch.fx.Node, target: torch.fx.Node) -> None:
    """Give BatchNorm node ``target`` the ``eps`` of BatchNorm node ``source``."""
    index = _batch_norm_eps_index(source)
    if len(source.args) > index:
        _set_arg(target, _batch_norm_eps_index(target), "eps", source.args[index])


def _batch_norm_literals(m: torch.fx.GraphModule) -> dict[str, tuple[Any, Any]]:
    """``{running_var buffer: (momentum, eps)}`` of every BatchNorm node of ``m``."""
    literals = {}
    for node in m.graph.nodes:
        if node.op == "call_function" and node.target in _BATCH_NORM_OPS and len(node.args) > 7:
            running_var = node.args[4]
            if isinstance(running_var, torch.fx.Node) and running_var.op == "get_attr":
                literals[str(running_var.target)] = (node.args[6], node.args[_batch_norm_eps_index(node)])
    return literals


def _keeping_batch_norm_literals(fuse: Callable[[torch.fx.GraphModule], torch.fx.GraphModule],
                                 keep_eps: bool = True) -> Callable:
    """``fuse`` (torchao's ``_fuse_conv_bn_qat`` or the fast one) followed by putting back each BatchNorm's momentum
    and eps.

    torchao 0.18 replaces every conv-BN with a QAT pattern written with ``F.batch_norm``'s defaults: momentum 0.1
    and eps 1e-5, in the BatchNorm and in the ``sqrt(running_var + eps)`` of the weight scaling (``qat_utils``:
    "TODO: do this for literal args for batchnorm as well"). A model built with other values changed silently:
    torchvision's mobilenet_v3 (eps 1e-3, momentum 0.01) and any ``momentum`` a user sets. Measured on
    mobilenet_v2 with momentum 0.5, 48 steps from scratch: eval-mode accuracy 12 % under PT2E against 89 % under
    FX, whose running statistics followed the weights.

    ``keep_eps=False`` puts back the momentum only: torchao's own fold (``fast_fold=False``) folds with eps 1e-5
    whatever the graph says, so training must use that eps too for int8 to match it.
    """

    def fuse_keeping_literals(m: torch.fx.GraphModule) -> torch.fx.GraphModule:
        literals = _batch_norm_literals(m)
        m = fuse(m)
        changed = False
        for node in m.graph.nodes:
            if node.op != "call_function":
                continue
            if node.target in _BATCH_NORM_OPS and len(node.args) > 7:
                kept = literals.get(str(getattr(node.args[4], "target", "")))
                if kept is not None:
                    changed |= _set_arg(node, 6, "momentum", kept[0])
                    if keep_eps:
                        changed |= _set_arg(node, _batch_norm_eps_index(node), "eps", kept[1])
            elif keep_eps and node.target == _aten.add.Tensor and isinstance(node.args[0], torch.fx.Node) \
                    and node.args[0].op == "get_attr" and not isinstance(node.args[1], torch.fx.Node):
                # the pattern's running_std = sqrt(running_var + eps)
                kept = literals.get(str(node.args[0].target))
                if kept is not None:
                    changed |= _set_arg(node, 1, "other", kept[1])
        if changed:
            m.recompile()
        return m

    return fuse_keeping_literals


def _fast_fuse_conv_bn_qat(m: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """torchao's ``_fuse_conv_bn_qat`` (prepare time), run only for the conv kinds present in ``m``.

    torchao runs its helper for conv1d, conv2d, conv_transpose1d and conv_transpose2d, exporting 3
    patterns for each (12 dynamo exports, ~1 s) whatever the model holds; a helper for a conv kind
    that is not in the graph cannot match anything.
    """
    import torch.nn.functional as F
    from torchao.quantization.pt2e import qat_utils as qu

    helper = getattr(qu, "_fuse_conv_bn_qat_helper", None)
    if helper is None or not hasattr(qu, "_is_bn_node"):  # pragma: no cover - another torchao version
        return qu._fuse_conv_bn_qat(m)
    if not any(qu._is_bn_node(n) for n in m.graph.nodes):
        return m
    packets = {getattr(n.target, "overloadpacket", None) for n in m.graph.nodes if n.op == "call_function"}
    # x, conv_weight, conv_bias, bn_weight, bn_bias, bn_running_mean, bn_running_var (as torchao's fuse)
    inputs_1d = (torch.randn(1, 1, 3), torch.randn(1, 1, 1), *(torch.randn(1) for _ in range(5)))
    inputs_2d = (torch.randn(1, 1, 3, 3), torch.randn(1, 1, 1, 1), *(torch.randn(1) for _ in range(5)))
    kinds = (
        (_aten.conv1d, F.conv1d, inputs_1d),
        (_aten.conv2d, F.conv2d, inputs_2d),
        (_aten.conv_transpose1d, F.conv_transpose1d, inputs_1d),
        (_aten.conv_transpose2d, F.conv_transpose2d, inputs_2d),
    )
    for is_cuda in [True, False] if torch.cuda.is_available() else [False]:
        for packet, conv_fn, inputs in kinds:
            if packet in packets:
                m = helper(m, conv_fn, inputs, is_cuda=is_cuda)
    return m


def _eliminate_dead_code(gm: torch.fx.GraphModule) -> int:
    """Remove the computations whose results nothing uses (in place); return how many nodes went.

    ``torch.export`` keeps side-effect-free nodes whose outputs are unused, e.g. the pooler
    (``dense`` -> ``tanh``) of a Hugging Face ``BertModel`` whose caller only reads
    ``last_hidden_state``. ``X86InductorQuantizer``'s linear+unary annotation then meets a ``tanh``
    partition with no output node and fails with ``IndexError: list index out of range``
    (``partition.output_nodes[0]``); quantizing dead code is pointless anyway. Mutating ops (the
    BatchNorm counters, in-place updates) are impure and stay.
    """
    before = len(gm.graph.nodes)
    if gm.graph.eliminate_dead_code():
        gm.recompile()
    return before - len(gm.graph.nodes)


@contextlib.contextmanager
def _stochastic_depth_as_dropout(module: nn.Module, enabled: bool = True) -> Iterator[list[str]]:
    """While exporting, run torchvision's ``StochasticDepth`` as ``x * dropout(ones)``; yield the module names.

    ``torchvision.ops.stochastic_depth`` draws its noise with ``bernoulli_`` when ``training`` is true:
    exported in train mode (QAT), those draws stay in the graph, so ``eval()`` kept dropping residual
    branches at random (efficientnet_b0: int8 vs fake-quant compared two random draws). The same
    noise as ``dropout`` of a ones tensor of shape [N, 1, ...] ("row") or [1, ...] ("batch") is an
    ``aten.dropout`` node, which ``train()`` / ``eval()`` switch (:func:`_rewrite_modes`). Only the
    instance's ``forward`` is overridden, and restored after the export.
    """
    import sys

    ops = sys.modules.get("torchvision.ops.stochastic_depth")
    cls = getattr(ops, "StochasticDepth", None) if ops is not None else None
    found = [(n, m) for n, m in module.named_modules() if enabled and isinstance(cls, type) and isinstance(m, cls)]

    def as_dropout(m: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        def forward(x: torch.Tensor) -> torch.Tensor:
            if not m.training or m.p == 0.0:
                return x
            shape = [x.shape[0]] + [1] * (x.dim() - 1) if m.mode == "row" else [1] * x.dim()
            return x * nn.functional.dropout(torch.ones(shape, dtype=x.dtype, device=x.device), m.p, True)

        return forward

    for _, m in found:
        m.forward = as_dropout(m)  # type: ignore[method-assign]
    try:
        yield [n for n, _ in found]
    finally:
        for _, m in found:
            m.__dict__.pop("forward", None)


def _split_call_sites(gm: torch.fx.GraphModule, source: nn.Module) -> list[str]:
    """Give each call of a stateless module called at several sites its own partition; return their names.

    torch.export records the call sites of one module as ``nn_module_stack`` keys ``L__self__relu``,
    ``L__self__relu@1``, ... but with the same module name in each, and ``get_source_partitions``
    (what ``X86InductorQuantizer`` annotates by) groups a leaf module's nodes by that name: a
    torchvision ``BasicBlock``, which calls one ``self.relu`` twice, became one ReLU partition with
    two outputs and ``prepare_qat_pt2e`` failed with "Input partition has more than one output node"
    (pytorch/ao#4478). Renaming the innermost entry of the second and later calls to ``relu@1``, ...
    is what giving each call site its own copy of the module would do, without touching the model;
    the outer entries (``layer1.0``) keep their names, so module-name qconfigs of a parent still
    match. Only modules without parameters or buffers of their own are split (a reused stateful
    module shares its weights between its sites).
    """
    split: set[str] = set()
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if not stack:
            continue
        key, value = list(stack.items())[-1]
        fqn, cls = value
        _, sep, index = str(key).rpartition("@")
        if not sep or not index.isdigit() or str(fqn).endswith(f"@{index}"):
            continue
        try:
            called = source.get_submodule(str(fqn))
        except AttributeError:
            continue
        if any(True for _ in called.parameters()) or any(True for _ in called.buffers()):
            continue
        stack = dict(stack)
        stack[key] = (f"{fqn}@{index}", cls)
        node.meta["nn_module_stack"] = stack
        split.add(str(fqn))
    return sorted(split)


def _drop_unused_attributes(gm: torch.fx.GraphModule) -> list[str]:
    """Delete the parameters, buffers and tensor attributes no ``get_attr`` node reads; return their names.

    Submodules left without anything the graph uses are deleted too.
    """
    used = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    used |= {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}

    def is_used(name: str) -> bool:
        return name in used or any(u.startswith(name + ".") for u in used)

    dropped = []
    for owner_name, owner in list(gm.named_modules()):
        prefix = owner_name + "." if owner_name else ""
        for attr in list(owner._parameters) + list(owner._buffers):
            if not is_used(prefix + attr):
                owner._parameters.pop(attr, None)
                owner._buffers.pop(attr, None)
                dropped.append(prefix + attr)
        for attr, value in list(vars(owner).items()):
            if isinstance(value, torch.Tensor) and not is_used(prefix + attr):
                delattr(owner, attr)
                dropped.append(prefix + attr)
    gm.delete_all_unused_submodules()
    return dropped


# --------------------------------------------------------------------------- the engine

class Pt2eEngine(QuantEngine):
    """torchao PT2E: ``torch.export`` (dynamic batch) + ``prepare_qat_pt2e``, then ``convert_pt2e``.

    Only the x86 backend (``X86InductorQuantizer``) unless ``spec.qconfig_mapping`` is a torchao
    ``Quantizer``, which is used as is. ``convert`` returns the Q/DQ reference model; lower it with
    ``torch.compile`` (inductor, ``torch._inductor.config.freezing = True``) for int8 kernels.

    ``spec.options``: ``dynamic_batch`` (default ``True``: dim 0 of the inputs is a ``torch.export.Dim``),
    ``dynamic_dims`` (default ``[]``: further input dims exported as dynamic, e.g. ``[1]`` for a sequence),
    ``quantize_embeddings`` (default ``False``: also store ``aten.embedding`` tables as uint8 rows, torchao's
    ``EmbeddingQuantizer`` composed before the x86 quantizer; weight-only, observed on the final weights),
    ``fold_quantize`` (default ``True``, passed to ``convert_pt2e``), ``fast_fold`` (default
    ``True``: the conv-bn fuse/fold described in the module docstring; ``False`` runs torchao's own),
    ``dropout_stochastic_depth`` (default ``True``: torchvision's ``StochasticDepth`` is exported as a
    dropout, so ``eval()`` turns it off, see :func:`_stochastic_depth_as_dropout`),
    ``split_call_sites`` (default ``True``: each call of a stateless module called at several sites is
    annotated on its own, see :func:`_split_call_sites`), ``compile`` (the callback's: :meth:`compile_training`).

    Example::

        engine = Pt2eEngine()
        prepared = engine.prepare(net.train(), Inputs((torch.randn(2, 1, 8, 8),)), QuantSpec(backend="x86"))
        ...  # train
        int8 = engine.convert(prepared, QuantSpec(backend="x86"))
    """

    name = "pt2e"
    converts_to_qdq_graph = True
    compiles_training = True

    def converted_here(self, module: nn.Module) -> bool:
        """Whether ``module`` is this engine's output: its graph holds ``quantized_decomposed`` q/dq ops.

        Args:
            module: the module to inspect.
        """
        return any(str(getattr(node, "target", "")).startswith("quantized_decomposed")
                   for node in getattr(getattr(module, "graph", None), "nodes", ()))

    def __reduce__(self) -> tuple:
        # stateless apart from the torch modules it imports: pickle as "make a new one"
        return (type(self), ())

    def __init__(self) -> None:
        self.ao = load_torchao()
        for base in self.ao.fake_quant_types:
            register_plain_flag_setters(base.enable_observer, base.enable_fake_quant)
        self._parts: weakref.WeakKeyDictionary[nn.Module, _PhaseParts] = weakref.WeakKeyDictionary()

    # ------------------------------------------------------------------ spec

    def check_spec(self, spec: QuantSpec) -> None:
        """Reject settings the PT2E engine cannot honour, all at once, naming the config keys.

        Args:
            spec: the spec; a non-Quantizer ``qconfig_mapping``, a backend other than x86 (without a
                custom Quantizer), FX-only settings and equalization raise one :class:`ConfigError`.
        """
        errors: list[str] = []
        custom_quantizer = isinstance(spec.qconfig_mapping, self.ao.Quantizer)
        if spec.qconfig_mapping is not None and not custom_quantizer:
            errors.append(
                "qconfig_mapping: the pt2e engine takes a torchao Quantizer instance (e.g. "
                f"X86InductorQuantizer), got {type(spec.qconfig_mapping).__name__}; "
                "use engine='fx' for a QConfigMapping"
            )
        if spec.backend != "x86" and not custom_quantizer:
            errors.append(
                f"backend={spec.backend!r}: the pt2e engine supports only 'x86' (X86InductorQuantizer, "
                "lowered by inductor); use backend='x86', pass your own torchao Quantizer, or use engine='fx'"
            )
        for attr, key in _FX_ONLY:
            if getattr(spec, attr) is not None:
                errors.append(f"{key}: only the FX engine supports it; use engine='fx' or remove {key}")
        if spec.options.get("equalization_config") is not None or spec.options.get("equalization") is not None:
            errors.append(
                "equalization_config: only the FX engine supports it; use engine='fx' or remove it"
            )
        if errors:
            raise ConfigError(errors)

    def quantizer_from_data(self, data: Any, is_qat: bool, errors: list[str], trusted: Any = ()) -> Any:
        """Map ``qconfig_mapping`` onto ``X86InductorQuantizer`` where the meaning is the same.

        ``global``, ``object_type`` and ``module_name`` carry over; each qconfig may be ``auto`` (the global's
        default: :func:`auto_variant`), ``default``, ``dynamic``, ``reduce_range`` (for CPUs without VNNI) or
        ``null``. Presets, observer specs,
        regexes and call-order entries are FX features and are refused, naming the FX engine.

        Args:
            data: the plain-data ``qconfig_mapping`` (a string or ``None`` is the global qconfig).
            is_qat: build QAT configs (``x86_config(is_qat=...)``).
            errors: list the problems are appended to.
            trusted: module names the user trusts, for ``object_type`` class paths.

        Returns:
            The configured ``X86InductorQuantizer``.
        """
        data = plain(data)
        data = {"global": data} if isinstance(data, str) or data is None else data
        quantizer = self.ao.X86InductorQuantizer()

        def config(value: Any, key: str) -> Any:
            if value is None or value == "none":
                return None
            if value == _AUTO:
                value = auto_variant()
            if isinstance(value, str) and value in _X86_VARIANTS:
                return self.ao.x86_config(is_qat=is_qat, **_X86_VARIANTS[value])
            errors.append(
                f"{key}={value!r}: the pt2e engine (X86InductorQuantizer) takes {sorted([*_X86_VARIANTS, _AUTO])} or null; "
                "qconfig presets and observer specs need engine='fx'"
            )
            return None

        for key in sorted(set(data) - {"global", "object_type", "module_name"}):
            errors.append(f"qconfig_mapping.{key}: not supported by the pt2e engine; use engine='fx'")
        global_value = data.get("global", _AUTO)
        if global_value == _AUTO:
            global_value = auto_variant()  # resolved once, for the config and the Linear ranges alike
        global_config = config(global_value, "qconfig_mapping.global")
        if global_config is not None:
            quantizer.set_global(global_config)
            if is_qat and isinstance(global_value, str):
                self._average_linear_ranges(quantizer, global_value)
        for i, item in enumerate(data.get("object_type") or []):
            key = f"qconfig_mapping.object_type[{i}]"
            target = resolve_reference(item.get("type"), f"{key}.type", errors, trusted, object_type=True)
            value = config(item.get("qconfig"), f"{key}.qconfig")
            if target is not None:
                try:
                    quantizer.set_module_type_qconfig(target, value)
                except Exception as exc:  # X86InductorQuantizer supports a fixed set of module types
                    errors.append(f"{key}.type={item.get('type')!r}: X86InductorQuantizer cannot configure it ({exc})")
        for i, item in enumerate(data.get("module_name") or []):
            key = f"qconfig_mapping.module_name[{i}]"
            quantizer.set_module_name_qconfig(str(item.get("name")), config(item.get("qconfig"), f"{key}.qconfig"))
        return quantizer

    def _average_linear_ranges(self, quantizer: Any, variant: str) -> None:
        """``nn.Linear`` weights keep torchao's averaged range (the default QAT config's other weights take the
        current one): with current ranges every channel's largest weight sits at +-127, and on x86 CPUs without
        VNNI the u8 x s8 kernels add pairs of products in int16, which then overflow: MiniLM's int8 parted from its
        q/dq reference at 13.6 dB (``minilm_pt2e`` recipe). The FX engine keeps plain Conv / Linear averaged too.

        Args:
            quantizer: the ``X86InductorQuantizer`` whose global config is the tracked default.
            variant: ``default``, ``dynamic`` or ``reduce_range`` (the global's variant).
        """
        if variant in _X86_VARIANTS:
            averaged = self.ao.get_default_x86_inductor_quantization_config(is_qat=True, **_X86_VARIANTS[variant])
            quantizer.set_module_type_qconfig(nn.Linear, averaged)

    def resolve_spec(self, spec: QuantSpec, errors: list[str]) -> QuantSpec:
        """A plain-data ``qconfig_mapping`` turned into a quantizer (:meth:`quantizer_from_data`), then
        :meth:`check_spec`.

        Args:
            spec: the spec as given.
            errors: list every problem is appended to (nothing is raised).
        """
        from dataclasses import replace

        value = spec.qconfig_mapping
        if value is not None and (isinstance(value, (str, dict)) or type(value).__module__.startswith("omegaconf")):
            spec = replace(spec, qconfig_mapping=self.quantizer_from_data(value, spec.is_qat, errors, spec.options.get("trusted", ())))
        try:
            self.check_spec(spec)
        except ConfigError as exc:
            errors.extend(exc.problems)
        return spec

    def _default_quantizer(self, spec: QuantSpec) -> Any:
        """``X86InductorQuantizer`` with the x86 config :func:`auto_variant` picks for this CPU (a spec without a
        ``qconfig_mapping``)."""
        variant = auto_variant()
        quantizer = self.ao.X86InductorQuantizer()
        quantizer.set_global(self.ao.x86_config(is_qat=spec.is_qat, **_X86_VARIANTS[variant]))
        if spec.is_qat:
            self._average_linear_ranges(quantizer, variant)
        return quantizer

    def quantizer(self, spec: QuantSpec) -> Any:
        """The torchao quantizer to prepare with: the spec's own ``Quantizer``, else ``X86InductorQuantizer``
        with the x86 config :func:`auto_variant` picks for this CPU, average pools observing their own output (``pool_observers``); composed after an
        ``EmbeddingQuantizer`` with ``quantize_embeddings``.

        Args:
            spec: the resolved spec.
        """
        if isinstance(spec.qconfig_mapping, self.ao.Quantizer):
            quantizer = spec.qconfig_mapping
        else:
            quantizer = self._default_quantizer(spec)
        if type(quantizer) is self.ao.X86InductorQuantizer and spec.options.get("pool_observers", True):
            quantizer = _pool_observing_quantizer(self.ao.Quantizer)(quantizer)  # not a custom subclass's choices
        if spec.options.get("quantize_embeddings", False):
            # weight-only uint8 rows (per-row float scale and offset) for aten.embedding, which
            # X86InductorQuantizer leaves float; a language model's embedding tables are often half its size
            from torchao.quantization.pt2e.quantizer.composable_quantizer import ComposableQuantizer
            from torchao.quantization.pt2e.quantizer.embedding_quantizer import EmbeddingQuantizer

            quantizer = ComposableQuantizer([EmbeddingQuantizer(), quantizer])
        return quantizer

    def notes(self, spec: QuantSpec) -> list[tuple[bool, str]]:
        """The activation range X86InductorQuantizer quantizes to, and what it means for the CPUs the int8 model runs
        on. Without VNNI here: 7 bits is said (``auto`` chose it), 8 bits is warned of (int8 will saturate where
        fake-quant did not). With VNNI here, 8 bits is said with where it will not compute (x86 CPUs without VNNI or
        AMX): the gates run on this CPU and cannot see a deploy CPU's kernels.

        Args:
            spec: the resolved spec.
        """
        pair_sums = x86_u8s8_pair_sums()
        if pair_sums is None:  # not x86: nothing measured to say (and no quantizer to build for it)
            return []
        quantizer = spec.qconfig_mapping
        if not isinstance(quantizer, self.ao.Quantizer):
            quantizer = self._default_quantizer(spec)
        activation = getattr(getattr(quantizer, "global_config", None), "input_activation", None)
        if not isinstance(quantizer, self.ao.X86InductorQuantizer) or activation is None or activation.dtype != torch.uint8:
            return []
        eight_bits = (activation.quant_max or 255) > 127
        adds = "add pairs of u8 x s8 products in int16, which saturate with 8-bit activations"
        if pair_sums != "int16":
            if not eight_bits:
                return []
            return [(False, "pt2e: activations quantized over 0..255 (X86InductorQuantizer's default; this CPU has "
                            "VNNI, which computes them exactly): the int8 model parts from the model it was made from "
                            f"on x86 CPUs without VNNI or AMX (AVX2 only), whose int8 kernels {adds}; to deploy there, "
                            "quantize with qconfig_mapping: {global: reduce_range} (7-bit activations)")]
        why = f"this CPU has no VNNI, and its x86 int8 kernels {adds}"
        if not eight_bits:
            return [(False, f"pt2e: activations quantized over 0..127 (X86InductorQuantizer reduce_range): {why}; "
                            "the int8 model computes the same on every x86 CPU")]
        return [(True, f"pt2e: activations quantized over 0..255 on a CPU where int8 cannot compute them: {why}, so the "
                       "int8 model will part from the model it was made from; use qconfig_mapping: auto "
                       "(7 bits here) or reduce_range, or convert on a CPU with VNNI")]

    # ------------------------------------------------------------------ prepare

    @staticmethod
    def export_inputs(
        module: nn.Module, inputs: Inputs, dynamic_batch: bool = True, dynamic_dims: Sequence[int] = ()
    ) -> tuple[tuple, dict, Any]:
        """Example args/kwargs for ``torch.export`` and a ``dynamic_shapes`` marking dim 0 as the batch.

        The batch size is dim 0 of the first tensor input; every tensor input with that dim 0 shares
        one ``Dim``. A batch of 1 is repeated to 2: export specializes sizes 0 and 1. ``dynamic_dims``
        lists further dims of those inputs (e.g. ``[1]``, the sequence length of token ids and their
        attention mask) that are exported as ``Dim.AUTO`` (dynamic unless the model forces a size).

        Args:
            module: the module to export (its ``forward`` signature names the ``dynamic_shapes`` entries).
            inputs: example inputs of one call.
            dynamic_batch: mark dim 0 as dynamic; if false, ``dynamic_shapes`` is ``None``.
            dynamic_dims: further dims exported as ``Dim.AUTO``.

        Returns:
            ``(args, kwargs, dynamic_shapes)``.
        """
        from torch.utils._pytree import tree_flatten, tree_map

        args, kwargs = tuple(inputs.args), dict(inputs.kwargs)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.dim() > 0]
        if not dynamic_batch or not tensors:
            return args, kwargs, None
        batch = tensors[0].shape[0]
        if batch == 0:
            return args, kwargs, None
        if batch == 1:

            def widen(v: Any) -> Any:
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == 1:
                    return torch.cat([v, v]).detach()
                return v

            args, kwargs = tree_map(widen, (args, kwargs))
        size = max(batch, 2)
        dim = torch.export.Dim("batch")

        def spec_of(v: Any) -> Any:
            if not (isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == size):
                return None
            return {0: dim, **{d: torch.export.Dim.AUTO for d in dynamic_dims if 0 < d < v.dim()}}

        try:
            bound = inspect.signature(module.forward).bind(*args, **kwargs)
        except TypeError:
            return args, kwargs, tree_map(spec_of, args + tuple(kwargs.values()))
        dynamic = {}
        for name, value in bound.arguments.items():
            if isinstance(value, torch.Tensor):
                dynamic[name] = spec_of(value)
            else:
                dynamic[name] = tree_map(spec_of, value)
        return args, kwargs, dynamic

    def prepare(self, module: nn.Module, inputs: Inputs, spec: QuantSpec) -> nn.Module:
        """``torch.export`` of ``module``, then ``prepare_qat_pt2e`` (QAT) or ``prepare_pt2e`` (PTQ).

        A failure of either raises :class:`~qlightning.errors.TraceError`.

        Args:
            module: the float module (put in train mode for QAT, eval for PTQ).
            inputs: example inputs of one call (see :meth:`export_inputs`).
            spec: the resolved spec (quantizer and engine options).

        Returns:
            The prepared GraphModule, whose ``train()`` / ``eval()`` switch its exported modes.
        """
        self.check_spec(spec)
        quantizer = self.quantizer(spec)
        module.train(spec.is_qat)
        args, kwargs, dynamic = self.export_inputs(
            module, inputs, spec.options.get("dynamic_batch", True), tuple(spec.options.get("dynamic_dims", ()))
        )
        try:
            with _stochastic_depth_as_dropout(module, spec.options.get("dropout_stochastic_depth", True)):
                exported = torch.export.export(module, args, kwargs, dynamic_shapes=dynamic)
        except Exception as exc:  # torch.export raises many kinds (UserError, Unsupported, TypeError, ...)
            raise TraceError(
                f"torch.export could not capture {type(module).__name__}: {type(exc).__name__}: {str(exc)[:2000]}. "
                "Quantize a smaller submodule that exports (modules); if the batch dimension is the problem, "
                "set engine_options dynamic_batch=false; or try engine='fx'."
            ) from exc
        graph = exported.module()
        _eliminate_dead_code(graph)
        if spec.options.get("split_call_sites", True):
            _split_call_sites(graph, module)
        prepare = self.ao.prepare_qat_pt2e if spec.is_qat else self.ao.prepare_pt2e
        try:
            # torchao's conv-bn fuse (or the fast one), keeping each BatchNorm's momentum and eps
            fast = spec.options.get("fast_fold", True)
            fuse = _fast_fuse_conv_bn_qat if fast else getattr(self.ao.quantize_pt2e_module, "_fuse_conv_bn_qat", None)
            with self._patched("_fuse_conv_bn_qat", _keeping_batch_norm_literals(fuse, keep_eps=fast), fuse is not None):
                prepared = prepare(graph, quantizer)
        except Exception as exc:
            raise TraceError(
                f"torchao {prepare.__name__} failed on {type(module).__name__} with {type(quantizer).__name__}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if spec.is_qat:
            refuse_zero_gammas(  # zero-init residual BatchNorms: no 0 / 0 in the fold (one it does not know refuses)
                _train_zero_gammas(prepared), "torchao's QAT conv-bn fold in these modules",
                "Train it with engine='fx' (its conv-bn fold convolves a channel of gamma 0 with the weight itself)")
            settle_fake_quant_state(prepared)  # no evaluation before training may move a buffer (base.py)
            if spec.options.get("lean_float_phase", True):
                lean_float_phase(prepared)
        return _install_train_eval(prepared, training=spec.is_qat)

    # ------------------------------------------------------------------ phases

    def _phase_parts(self, module: nn.Module) -> "_PhaseParts":
        """What a phase switches in ``module``, found once per prepared module (the callback applies a phase at
        every training batch; walking the module tree cost more than switching)."""
        parts = self._parts.get(module)
        if parts is None:
            types = self.ao.fake_quant_types + self.ao.observer_types
            outer: dict[str, nn.Module] = {}
            for name, m in module.named_modules():
                if not isinstance(m, types):
                    continue
                names = name.split(".")
                if not any(".".join(names[:i]) in outer for i in range(1, len(names))):
                    outer[name] = m
            graphs = tuple(m for m in module.modules() if isinstance(m, _ExportedTrainEval))
            learnable = frozenset(id(m) for m in outer.values() if hasattr(m, "learning_enabled"))
            parts = self._parts[module] = _PhaseParts(
                tuple(outer.items()), learnable, graphs, _fed_by_parameters_alone(graphs))  # type: ignore[arg-type]
        return parts

    def _quant_modules(self, module: nn.Module) -> tuple[tuple[str, nn.Module], ...]:
        """Top-level fake-quant and observer modules (not an observer inside a fake-quant), by name."""
        return self._phase_parts(module).quant_modules

    def set_phase(self, module: nn.Module, phase: Phase) -> None:
        """Switch fake-quant, observers (and learnable qparams) and BatchNorm statistics to ``phase``.

        Args:
            module: the prepared module.
            phase: the phase to apply; with ``rest_memoryless_weights``, the weights' fake-quants whose observer
                keeps only its last observation do not observe.
        """
        parts = self._phase_parts(module)
        for _, m in parts.quant_modules:
            if isinstance(m, self.ao.fake_quant_types):
                set_flag(m, "fake_quant_enabled", phase.fake_quant, m.enable_fake_quant)
                rests = phase.rest_memoryless_weights and id(m) in parts.weight_fake_quants and keeps_last_observation(m)
                set_flag(m, "observer_enabled", phase.observe and not rests, m.enable_observer)
                if id(m) in parts.learnable:  # LearnableFakeQuantize: learn qparams once observers freeze
                    if phase.fake_quant and not phase.observe:
                        m.enable_range_learning()
                    else:
                        m.disable_range_learning()
            else:
                _set_plain_observer(m, phase.observe)
        for gm in parts.graphs:
            _graph_state(gm)["bn_frozen"] = phase.bn_frozen
            _rewrite_modes(gm, gm.training)

    def set_observers(self, module: nn.Module, enabled: bool) -> None:
        """Turn every top-level fake-quant's observer, and every plain observer, on or off.

        Args:
            module: the prepared module.
            enabled: whether observers update.
        """
        for _, m in self._quant_modules(module):
            if isinstance(m, self.ao.fake_quant_types):
                set_flag(m, "observer_enabled", enabled, m.enable_observer)
            else:
                _set_plain_observer(m, enabled)

    # ------------------------------------------------------------------ compiled training

    def compile_training(self, module: nn.Module, **compile_kwargs: Any) -> bool:
        """Training forwards through ``torch.compile``, torchao's fused fake-quants in traceable tensor ops
        (:mod:`qlightning.engines.traceable`, shared with the FX engine).

        Unlike torch.ao's, torchao's fake-quants are not on dynamo's skip list, but their fused op reads its
        flags on the host. The exported graph's ReLU and ReLU6 ops take a float gradient mask
        (:func:`_float_mask_relus`: aten's bool mask was saved in residual blocks), the conv-bn fold divides the
        weight rather than the conv output, and a frozen BatchNorm folds whole into its conv
        (:func:`_fold_frozen_batch_norms`); the BatchNorm freeze and
        train/eval rewrite the graph's BatchNorm nodes, and each distinct graph compiles once.
        The conv-bn fold reads the running variance from a snapshot taken before each compiled call
        (:func:`_folds_from_snapshots`).

        Args:
            module: the prepared GraphModule; an earlier compile is undone first.
            compile_kwargs: keyword arguments of ``torch.compile``.
        """
        self.decompile(module)
        _restore_targets(module)  # torchao's fold again: the compiled fold takes a gamma of 0 itself
        fake_quants = make_traceable(module)
        snapshots = _folds_from_snapshots(module)
        _float_mask_relus(module)
        _fold_frozen_batch_norms(module)
        compile_training_forward(module, fake_quants, snapshots, **compile_kwargs)
        return True

    def decompile(self, module: nn.Module) -> None:
        """Undo :meth:`compile_training` on ``module``: eager forwards again, the eager path's own included.

        Args:
            module: the prepared module.
        """
        uncompile(module)
        _restore_targets(module)
        _unfold_snapshots(module)
        restore_fake_quants(module)
        _train_zero_gammas(module)

    # ------------------------------------------------------------------ convert

    @contextlib.contextmanager
    def _patched(self, name: str, replacement: Callable, enabled: bool) -> Iterator[None]:
        """Swap the conv-bn pass ``name`` that torchao's quantize_pt2e calls, for one call."""
        target = self.ao.quantize_pt2e_module
        if not enabled or not hasattr(target, name):
            yield
            return
        original = getattr(target, name)
        setattr(target, name, replacement)
        try:
            yield
        finally:
            setattr(target, name, original)

    def _observe_final_weights(self, gm: torch.fx.GraphModule) -> None:
        """Let every plain observer of a parameter (weight-only quantization, e.g. embeddings) see its final value.

        A QAT weight goes through a fake-quant whose qparams follow the weight; a plain observer
        (torchao's EmbeddingQuantizer) stopped observing when the observers froze, while the weight
        kept training: its range would clamp the converted weight.
        """
        for node in gm.graph.nodes:
            if node.op != "call_module" or not node.args or getattr(node.args[0], "op", None) != "get_attr":
                continue
            observer = gm.get_submodule(str(node.target))
            if isinstance(observer, self.ao.fake_quant_types) or not isinstance(observer, self.ao.observer_types):
                continue
            weight = _get_attr_value(gm, node.args[0])
            if hasattr(observer, "reset_min_max_vals"):
                observer.reset_min_max_vals()
            with torch.no_grad():
                type(observer).forward(observer, weight.detach())

    def convert(self, module: nn.Module, spec: QuantSpec) -> nn.Module:
        """``convert_pt2e`` of the prepared module (observers off, eval mode), without the float
        parameters the int8 graph no longer reads.

        Args:
            module: the GraphModule :meth:`prepare` returned (anything else raises ``TypeError``).
            spec: the resolved spec (engine options ``fast_fold``, ``trained_qparams``, ``fold_quantize``).

        Returns:
            The Q/DQ reference GraphModule.
        """
        self.check_spec(spec)
        if not isinstance(module, torch.fx.GraphModule):
            raise TypeError(f"Pt2eEngine.convert expects the module returned by prepare, got {type(module).__name__}")
        self.decompile(module)
        _restore_targets(module)  # torchao's fold, which its convert matches
        self.set_observers(module, False)
        self._observe_final_weights(module)
        module.eval()  # dropout off, BatchNorm on running statistics: the patterns the fold matches
        for node in list(module.graph.nodes):
            if _is_bn_counter(node) and not node.users:
                module.graph.erase_node(node)
        module.recompile()
        with self._patched("_fold_conv_bn_qat", _fast_fold_conv_bn_qat, spec.options.get("fast_fold", True)), \
                trained_qparams(module, spec.options.get("trained_qparams", True)):
            converted = self.ao.convert_pt2e(module, fold_quantize=spec.options.get("fold_quantize", True))
        # convert_pt2e folds each weight's quantize into an int8 ``_frozen_param`` but leaves the fp32
        # weight (and the folded BatchNorm's parameters and statistics) attached: drop what the graph
        # no longer reads, so the state dict and every saved program hold the int8 weights only
        _eliminate_dead_code(converted)
        _drop_unused_attributes(converted)
        return _install_train_eval(converted, training=False)

    # ------------------------------------------------------------------ state

    def quant_state(self, module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, buffer)`` of every buffer of the top-level fake-quants and observers of ``module``.

        Args:
            module: the prepared module.
        """
        for name, m in self._quant_modules(module):
            for buf_name, buf in m.named_buffers(prefix=name):
                yield buf_name, buf

    def describe_qparams(self, module: nn.Module) -> dict[str, dict[str, Any]]:
        """``{fake-quant name: {scale_mean, zero_point_mean, fake_quant, observer}}`` of ``module``.

        Args:
            module: the prepared module.
        """
        summary = {}
        for name, m in self._quant_modules(module):
            if isinstance(m, self.ao.fake_quant_types) and isinstance(getattr(m, "scale", None), torch.Tensor):
                summary[name] = {
                    "scale_mean": float(m.scale.detach().float().mean()),
                    "zero_point_mean": float(m.zero_point.detach().float().mean()),
                    "fake_quant": bool(m.fake_quant_enabled[0]),
                    "observer": bool(m.observer_enabled[0]),
                }
        return summary
