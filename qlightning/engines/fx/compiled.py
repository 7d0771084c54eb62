"""The compiled QAT training path of the FX engine (``engine_options.compile``).

The traceable fake-quant and the compiled dispatcher are both engines' (:mod:`qlightning.engines.traceable`, which
says how and why). What is the FX engine's own: which fake-quants qualify (torch.ao's fused moving-average
fake-quant and the default weight fake-quant built on it), and the ReLU modules of torch.ao's graph, each applied
inside the fake-quant after it where it is that fake-quant's only producer (the eager fast path's
``fuse_relu_fake_quant``), or given a float gradient mask (``torch.relu``'s own backward keeps a bool one,
which inductor stores an element at a time).

Classes, buffers and ``state_dict`` keys stay torch.ao's, so ``convert_fx`` is unchanged; :func:`decompile`
undoes everything (the engine calls it before converting).
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from qlightning.engines.fx.ao import quiet_torch_ao
from qlightning.engines.fx.fast_fq import CONV_BN_RELU, fuse_relu_fake_quant, unfuse_relu_fake_quant
from qlightning.engines.fx.weights import ZeroCenteredFusedFakeQuantize
from qlightning.engines.traceable import (
    compile_training_forward,
    is_traceable,
    relu,
    restore_fake_quants,
    traceable_fake_quants,
    uncompile,
)
from qlightning.engines.traceable import make_traceable as make_fake_quants_traceable

with quiet_torch_ao():
    from torch.ao.quantization.fake_quantize import FusedMovingAvgObsFakeQuantize


def _eligible(m: nn.Module) -> bool:
    """torch.ao's fused moving-average fake-quant (every default and preset QAT qconfig) with min/max observers."""
    return type(m) in (FusedMovingAvgObsFakeQuantize, ZeroCenteredFusedFakeQuantize)


def make_traceable(module: nn.Module) -> int:
    """Give every eligible fake-quant of ``module`` the traceable forward, and its ReLUs float masks; return how
    many fake-quants.

    Args:
        module: the prepared module.
    """
    count = len(make_fake_quants_traceable(module, _eligible))
    fuse_relu_fake_quant(module, applies_relu=is_traceable)
    _float_mask_relus(module)
    return count


def _float_mask_relus(module: nn.Module) -> int:
    """Give every ReLU module not fused into a fake-quant (a shared ``nn.ReLU``, one before anything else) the
    float mask of :func:`relu`; return how many. ``torch.relu``'s own backward would keep a bool one."""
    count = 0
    for m in module.modules():
        if "forward" in m.__dict__:  # fused into the fake-quant after it (or the compiled root)
            continue
        if type(m) is nn.ReLU:
            m.forward = types.MethodType(_relu_forward, m)
            count += 1
        elif type(m) in CONV_BN_RELU:
            m.forward = types.MethodType(_conv_bn_relu_forward, m)
            count += 1
    return count


def _relu_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    return relu(input)


def _conv_bn_relu_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """``ConvBnReLU*d.forward`` (``F.relu(self._forward(input))``) with :func:`relu`'s float mask."""
    return relu(self._forward(input))


def compile_for_training(module: nn.Module, **compile_kwargs: Any) -> int:
    """Training forwards of ``module`` run compiled (eval, and forwards without grad, stay eager).

    The fake-quants are made traceable (:func:`make_traceable`), then
    :func:`~qlightning.engines.traceable.compile_training_forward`. Returns the number of traceable fake-quants.

    Args:
        module: the prepared module; any earlier compile is undone first (:func:`decompile`).
        compile_kwargs: keyword arguments of ``torch.compile``.
    """
    decompile(module)
    count = make_traceable(module)
    compile_training_forward(module, list(traceable_fake_quants(module)), **compile_kwargs)
    return count


def decompile(module: nn.Module) -> int:
    """Undo :func:`compile_for_training` and :func:`make_traceable` on ``module``; return how many fake-quants it restored.

    Args:
        module: the module (and its submodules) to restore to their class forwards.
    """
    uncompile(module)
    if any(True for _ in traceable_fake_quants(module)):  # the ReLUs fused by make_traceable (a module on the eager fast path keeps the fast path's)
        unfuse_relu_fake_quant(module)
    for m in module.modules():
        if getattr(m.__dict__.get("forward"), "__func__", None) in (_relu_forward, _conv_bn_relu_forward):
            del m.__dict__["forward"]
    return restore_fake_quants(module)
