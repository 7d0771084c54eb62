"""The compiled QAT training path of the FX engine (``engine_options.compile``).

The traceable fake-quant and the compiled dispatcher are both engines' (:mod:`qlightning.engines.traceable`, which
says how and why). What is the FX engine's own: which fake-quants qualify (torch.ao's fused moving-average
fake-quant and the default weight fake-quant built on it), the ReLU modules of torch.ao's graph, each applied
inside the fake-quant after it where it is that fake-quant's only producer (the eager fast path's
``fuse_relu_fake_quant``), or given a float gradient mask (``torch.relu``'s own backward keeps a bool one,
which inductor stores an element at a time), its ReLU6 / Hardtanh modules too (a float-mask ``hardtanh``), and torch.ao's conv-bn and linear-bn QAT modules, whose fold reads
the running variance through :func:`~qlightning.engines.traceable.folded_variance` (compiled, a snapshot taken
before the call: the compiled backward read it after the training batch_norm had updated it), divides the weight
rather than the output by the BatchNorm's scale, and with the BatchNorm frozen folds it whole (:func:`_fold`). A
fake-quant torch.ao shares across a ReLU6 (Hardtanh, ReLU), called before and after it, observes the second call's
range from the first's instead of reading the tensor again (:func:`_fuse_shared_fake_quants`).

Classes, buffers and ``state_dict`` keys stay torch.ao's, so ``convert_fx`` is unchanged; :func:`decompile`
undoes everything (the engine calls it before converting).
"""

from __future__ import annotations

import copy
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qlightning.engines.fx.ao import quiet_torch_ao
from qlightning.engines.fx.fast_fq import CONV_BN_RELU, frozen_bn_bias, fuse_relu_fake_quant, unfuse_relu_fake_quant
from qlightning.engines.fx.weights import ZeroCenteredFusedFakeQuantize
from qlightning.engines.traceable import (
    compile_training_forward,
    fake_quant_with_range,
    folded_variance,
    hardtanh,
    relu,
    restore_fake_quants,
    traceable_fake_quants,
    traceable_forward,
    uncompile,
    weight_out_of_fold,
)
from qlightning.engines.traceable import make_traceable as make_fake_quants_traceable

with quiet_torch_ao():
    from torch.ao.nn.intrinsic.qat import LinearBn1d
    from torch.ao.nn.intrinsic.qat.modules.conv_fused import _ConvBnNd
    from torch.ao.quantization.fake_quantize import FixedQParamsFakeQuantize, FusedMovingAvgObsFakeQuantize

#: the snapshot buffer of a conv-bn or linear-bn module (non-persistent: not in ``state_dict``)
FOLDED_VARIANCE = "_qlightning_folded_var"


def _eligible(m: nn.Module) -> bool:
    """torch.ao's fused moving-average fake-quant (every default and preset QAT qconfig) with min/max observers,
    and its fixed-qparams one (the defaults' for sigmoid, hardsigmoid, tanh and softmax)."""
    return type(m) in (FusedMovingAvgObsFakeQuantize, ZeroCenteredFusedFakeQuantize, FixedQParamsFakeQuantize)


def make_traceable(module: nn.Module) -> int:
    """Give every eligible fake-quant of ``module`` the traceable forward, and its ReLUs float masks; return how
    many fake-quants.

    Args:
        module: the prepared module.
    """
    count = len(make_fake_quants_traceable(module, _eligible))
    # only the moving-average forward applies a fused ReLU (fixed_qparams_forward does not)
    fuse_relu_fake_quant(module, applies_relu=lambda m: getattr(m.__dict__.get("forward"), "__func__", None) is traceable_forward)
    _float_mask_relus(module)
    return count


def _float_mask_relus(module: nn.Module) -> int:
    """Give every ReLU module not fused into a fake-quant (a shared ``nn.ReLU``, one before anything else) the
    float mask of :func:`relu`, and every ``nn.ReLU6`` / ``nn.Hardtanh`` that of :func:`hardtanh`; return how many.
    Their aten backwards would keep a bool one."""
    count = 0
    for m in module.modules():
        if "forward" in m.__dict__:  # fused into the fake-quant after it (or the compiled root)
            continue
        if type(m) is nn.ReLU:
            m.forward = types.MethodType(_relu_forward, m)
            count += 1
        elif type(m) in (nn.ReLU6, nn.Hardtanh):
            m.forward = types.MethodType(_hardtanh_forward, m)
            count += 1
        elif type(m) in CONV_BN_RELU:
            m.forward = types.MethodType(_conv_bn_relu_forward, m)
            count += 1
    return count


def _relu_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    return relu(input)


def _hardtanh_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    return hardtanh(input, self.min_val, self.max_val)


def _conv_bn_relu_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """``ConvBnReLU*d.forward`` (``F.relu(self._forward(input))``) with :func:`relu`'s float mask."""
    return relu(self._forward(input))


#: activation modules that are elementwise and non-decreasing: the range of ``f(x)`` is ``f`` of ``x``'s range
MONOTONE_ACTIVATIONS = (nn.ReLU, nn.ReLU6, nn.Hardtanh)
#: where :func:`_fuse_shared_fake_quants` keeps a graph module's graph as it was
ORIGINAL_GRAPH = "_qlightning_original_graph"


def fake_quant_activation_fake_quant(fake_quant: nn.Module, activation: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """``fake_quant(activation(fake_quant(input)))``, the second call observing the range the first call's output
    range maps to, instead of reading the activation's output again (:func:`_fuse_shared_fake_quants`).

    Args:
        fake_quant: a traceable per-tensor fake-quant, called twice.
        activation: one of :data:`MONOTONE_ACTIVATIONS`.
        input: the first call's input.
    """
    out, observed = fake_quant_with_range(fake_quant, input)
    y = activation(out)
    if observed is not None:
        with torch.no_grad():
            low, high = observed
            if type(activation) is nn.ReLU:
                observed = torch.relu(low), torch.relu(high)
            else:
                observed = (torch.clamp(low, activation.min_val, activation.max_val),
                            torch.clamp(high, activation.min_val, activation.max_val))
    return fake_quant_with_range(fake_quant, y, observed)[0]


def _fuse_shared_fake_quants(module: nn.Module) -> int:
    """In each graph module of ``module``, replace ``fq(act(fq(x)))`` (one fake-quant module at both sites, ``act``
    a ReLU / ReLU6 / Hardtanh module, nothing else reading either output) by one call of
    :func:`fake_quant_activation_fake_quant`; return how many.

    torch.ao's x86 config gives a ReLU6 (and Hardtanh, and a ReLU it does not fuse) its input's fake-quant: the
    graph observes the conv-bn output and then the ReLU6's output with the same module, each observation a full
    read (a reduction) of the tensor. The second is known from the first (the fake-quant and the activation are
    both monotone): compiled, a MobileNetV2-like step held one such reduction per inverted-residual ReLU6
    (notes/perf.md section 39). The same values; the original graph is kept for :func:`_unfuse_shared_fake_quants`
    (node names are what torch.ao's convert reads its qconfigs by).

    Args:
        module: the prepared module.
    """
    count = 0
    for gm in [m for m in module.modules() if isinstance(m, torch.fx.GraphModule)]:
        original = None
        for second in list(gm.graph.nodes):
            if second.op != "call_module" or len(second.args) != 1 or second.kwargs:
                continue
            act = second.args[0]
            if not (isinstance(act, torch.fx.Node) and act.op == "call_module" and len(act.users) == 1
                    and len(act.args) == 1 and not act.kwargs):
                continue
            first = act.args[0]
            if not (isinstance(first, torch.fx.Node) and first.op == "call_module" and len(first.users) == 1
                    and len(first.args) == 1 and not first.kwargs):
                continue
            fake_quant, activation = gm.get_submodule(second.target), gm.get_submodule(act.target)
            # torch.ao registers a shared fake-quant under one name per site
            if (gm.get_submodule(first.target) is not fake_quant
                    or getattr(fake_quant.__dict__.get("forward"), "__func__", None) is not traceable_forward
                    or fake_quant.is_per_channel or type(activation) not in MONOTONE_ACTIVATIONS):
                continue
            if original is None:
                original = copy.deepcopy(gm.graph)
            with gm.graph.inserting_before(second):
                call = gm.graph.call_function(fake_quant_activation_fake_quant, (
                    gm.graph.get_attr(second.target), gm.graph.get_attr(act.target), first.args[0]))
            second.replace_all_uses_with(call)
            for node in (second, act, first):
                gm.graph.erase_node(node)
            count += 1
        if original is not None:
            gm.__dict__[ORIGINAL_GRAPH] = original
            gm.recompile()
    return count


def _unfuse_shared_fake_quants(module: nn.Module) -> None:
    """Undo :func:`_fuse_shared_fake_quants`: each graph module's original graph, its node names included."""
    for gm in module.modules():
        original = gm.__dict__.pop(ORIGINAL_GRAPH, None)
        if original is not None:
            gm.graph = original
            gm.recompile()


def _folds_from_snapshots(module: nn.Module) -> list[tuple[str, str]]:
    """Give torch.ao's conv-bn and linear-bn QAT modules folds that read the running variance through
    :func:`~qlightning.engines.traceable.folded_variance`, each with its snapshot buffer; return the
    ``(running_var, snapshot)`` buffer paths for the compiled caller to refresh.

    A module on torch.ao's slow path (``_enable_slow_path_for_better_numerical_stability``, never set here) keeps
    its own forward.

    Args:
        module: the prepared module.
    """
    pairs = []
    for name, m in module.named_modules():
        if not isinstance(m, (_ConvBnNd, LinearBn1d)) or m.bn.running_var is None:  # torch.ao refuses the latter
            continue
        if isinstance(m, _ConvBnNd) and not m._enable_slow_path_for_better_numerical_stability:
            m._forward_approximate = types.MethodType(_conv_bn_fold, m)
        elif isinstance(m, LinearBn1d):
            m.forward = types.MethodType(_linear_bn_fold, m)
        else:
            continue
        m.register_buffer(FOLDED_VARIANCE, m.bn.running_var.detach().clone(), persistent=False)
        prefix = f"{name}." if name else ""
        pairs.append((f"{prefix}bn.running_var", f"{prefix}{FOLDED_VARIANCE}"))
    return pairs


def _unfold_snapshots(module: nn.Module) -> None:
    """Undo :func:`_folds_from_snapshots`: torch.ao's own folds, no snapshot buffers."""
    for m in module.modules():
        if m._buffers.pop(FOLDED_VARIANCE, None) is not None:
            m.__dict__.pop("_forward_approximate", None)
            if getattr(m.__dict__.get("forward"), "__func__", None) is _linear_bn_fold:
                del m.__dict__["forward"]


def _scaled_weight(self: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The fold's ``gamma / sqrt(var + eps)`` (the variance through ``folded_variance``) and the fake-quantized weight
    scaled by it, as torch.ao's folds compute them."""
    running_std = torch.sqrt(folded_variance(self.bn.running_var, getattr(self, FOLDED_VARIANCE)) + self.bn.eps)
    scale_factor = self.bn.weight / running_std
    return scale_factor, self.weight_fake_quant(self.weight * _per_output_channel(scale_factor, self.weight))


def _per_output_channel(scale_factor: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    shape = [1] * weight.dim()
    shape[0] = -1
    return scale_factor.reshape(shape)


def _fold(self: nn.Module, layer: Any, input: torch.Tensor) -> torch.Tensor:
    """torch.ao's ``bn(layer(x, fq(w * s)) / s + b)`` with the division on the weight, ``bn(layer(x, fq(w * s) / s,
    b))`` (as the eager path's :func:`~qlightning.engines.fx.fast_fq.fast_conv_bn_forward_approximate`), or with
    the BatchNorm frozen the whole fold in the layer, ``layer(x, fq(w * s), (b - mean) * s + beta)``.

    The same function up to float rounding. Compiled, torch.ao's full-size ``/ s`` and frozen BatchNorm each cost a
    fused pass forward and reductions backward (notes/perf.md section 38).
    """
    scale_factor, scaled_weight = _scaled_weight(self)
    if not self.bn.training:
        return layer(input, scaled_weight, frozen_bn_bias(self, scale_factor, self.bias))
    # a channel of gamma 0 (zero-init residual BatchNorms) convolves with the weight itself, not 0 / 0
    weight = weight_out_of_fold(scaled_weight, _per_output_channel(scale_factor, scaled_weight), self.weight)
    return self.bn(layer(input, weight, self.bias))


def _conv_bn_fold(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """torch.ao's ``_ConvBnNd._forward_approximate`` (torch 2.13-2.15) folded as :func:`_fold` says, the variance read
    through ``folded_variance``."""
    return _fold(self, self._conv_forward, input)


def _linear_bn_fold(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """torch.ao's ``LinearBn1d.forward`` (torch 2.13-2.15) folded as :func:`_fold` says, the variance read through
    ``folded_variance``."""
    return _fold(self, F.linear, input)


def compile_for_training(module: nn.Module, **compile_kwargs: Any) -> int:
    """Training forwards of ``module`` run compiled (eval, and forwards without grad, stay eager).

    The fake-quants are made traceable (:func:`make_traceable`), then
    :func:`~qlightning.engines.traceable.compile_training_forward`, the conv-bn and linear-bn folds reading their
    running variances from snapshots. Returns the number of traceable fake-quants.

    Args:
        module: the prepared module; any earlier compile is undone first (:func:`decompile`).
        compile_kwargs: keyword arguments of ``torch.compile``.
    """
    decompile(module)
    count = make_traceable(module)
    _fuse_shared_fake_quants(module)
    snapshots = _folds_from_snapshots(module)
    compile_training_forward(module, list(traceable_fake_quants(module)), snapshots, **compile_kwargs)
    return count


def decompile(module: nn.Module) -> int:
    """Undo :func:`compile_for_training` and :func:`make_traceable` on ``module``; return how many fake-quants it restored.

    Args:
        module: the module (and its submodules) to restore to their class forwards.
    """
    uncompile(module)
    _unfuse_shared_fake_quants(module)
    _unfold_snapshots(module)
    if any(True for _ in traceable_fake_quants(module)):  # the ReLUs fused by make_traceable (a module on the eager fast path keeps the fast path's)
        unfuse_relu_fake_quant(module)
    for m in module.modules():
        if getattr(m.__dict__.get("forward"), "__func__", None) in (_relu_forward, _hardtanh_forward, _conv_bn_relu_forward):
            del m.__dict__["forward"]
    return restore_fake_quants(module)
