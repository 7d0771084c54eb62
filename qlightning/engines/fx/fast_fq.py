"""Faster QAT training steps on CPU for torch.ao FX-prepared models, with the same numerics.

Applied by ``FxEngine.prepare`` to QAT-prepared modules (``engine_options``: ``fast_qat`` for 1-4,
``fast_conv_bn`` for 5, ``fast_linear`` for 6, all default true); ``python -m benchmarks`` measures it (notes/perf.md). Where a torch.ao FX QAT step spends its extra time and
memory over the float step on CPU (``python -m benchmarks profile``), and what replaces it:

1. ``aten::_fake_quantize_per_tensor_affine_cachemask``, the element kernel of every activation
   fake-quant, is scalar (~3 ns per element, 5-8x the same arithmetic as vectorized ATen ops) and keeps
   a 1-byte mask per element. :class:`_FakeQuant`: three in-place vectorized passes for the values, and
   a 1-bit mask from two numpy comparisons of the input with the float bounds of the in-range set
   (:func:`_in_range_bounds`; torch's bool-producing comparisons are ~6x slower).
2. With fake-quant off, the fused op still copies its input and multiplies the gradient by a ones mask.
   Here the input is returned as is.
3. Per-channel weight fake-quant derives every channel's scale / zero point with tensor indexing in a
   C++ loop (``select`` + ``fill_`` per channel, every step). Here min/max are one vectorized reduction
   and the scale / zero point come from the fused op in qparams-only mode, once per change.
4. ``ConvBnReLU``'s ReLU keeps its float output for backward next to the fake-quant's mask: fused
   (:func:`fuse_relu_fake_quant`), one 1-bit mask for both and no extra activation copy.
5. torch.ao's QAT conv-bn divides the full conv output by the BN scale factor (one pass forward, three
   backward, the conv output kept for the gradient): :func:`fast_conv_bn_forward_approximate` divides
   the weight instead, and with the BatchNorm frozen folds it whole into the conv's bias
   (:func:`frozen_bn_bias`), the same function up to float rounding.
6. QAT ``Linear`` keeps the fake-quantized weight (a weight-sized float tensor) for backward:
   :func:`fast_linear_forward` keeps the weight parameter itself and recomputes ``fq(w)`` in backward.

1-4 are bit-identical to torch.ao (outputs, gradients, observer state, scales, zero points, after any
number of steps; ``python -m benchmarks equivalence``, tests); 6 gives identical outputs and gradients
equal up to the reduction order of its matrix products (identical in the tests); 5 differs by float rounding only (digits
int8 accuracy over 3 seeds: ``python -m benchmarks accuracy``). Tensors below ``MIN_ELEMENTS``, non-CPU
or non-float32 inputs and other observer types take torch.ao's own op, called through the module dicts
(:func:`~qlightning.engines.base.fused_forward`: at batch 1 per-call Python is most of a step).

Everything is done by replacing *instance* methods (``forward``, ``_forward_approximate``) of torch.ao's
own modules: classes, buffers, state_dict keys, ``convert_fx`` / reference conversion, ``deepcopy``
are untouched; :func:`restore_fake_quant` undoes it.
"""

from __future__ import annotations

import functools
import threading
import types
import weakref
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch
from torch import nn

from qlightning.engines.base import (
    centres_on_zero, dense_order, fused_fake_quant, fused_forward, observe_min_max, straddle_zero_, zero_gammas,
)
from qlightning.engines.fx.ao import quiet_torch_ao
from qlightning.engines.traceable import frozen_batch_norm_bias, weight_out_of_fold
from qlightning.engines.fx.weights import ZeroCenteredFusedFakeQuantize

with quiet_torch_ao():
    from torch.ao.quantization.fake_quantize import FusedMovingAvgObsFakeQuantize
    from torch.ao.quantization.observer import MovingAverageMinMaxObserver, MovingAveragePerChannelMinMaxObserver



def _pack_inverted(outside: torch.Tensor) -> torch.Tensor:
    """``~outside`` as 1 bit per element (numpy's SIMD packbits + invert: ~6 us per 128k elements)."""
    if _np is None:
        return outside.logical_not()
    packed = _np.packbits(outside.reshape(-1).numpy())
    return torch.from_numpy(_np.invert(packed, out=packed))


def _unpack(packed: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The 0/1 ``uint8`` mask back in ``like``'s shape (a uint8 multiplier is 3x faster than a bool one)."""
    if packed.dtype == torch.bool:
        return packed.view(torch.uint8)
    return torch.from_numpy(_np.unpackbits(packed.numpy(), count=like.numel())).view(like.shape)


def _masked_grad(grad: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``grad * mask`` for a mask kept by :func:`_pack_inverted` or :func:`_packed_mask`: the straight-through gradient.

    torch multiplies a float tensor by a ``uint8`` one by first copying the mask to a float tensor (``aten::_to_copy``,
    a full-size allocation and pass: 40 % of the product's time at 1M elements); numpy casts the 0/1 bytes inside its
    multiply loop. The same float32 products, so the same bits. A non-contiguous or differentiable gradient (double
    backward), or a bool mask, takes torch's product.
    """
    if (packed.dtype == torch.bool or not grad.is_contiguous() or grad.requires_grad or grad.dtype != torch.float32
            or grad.device.type != "cpu"):
        return grad * _unpack(packed, grad)
    out = torch.empty_like(grad, memory_format=torch.contiguous_format)
    _np.multiply(grad.numpy().reshape(-1), _np.unpackbits(packed.numpy(), count=grad.numel()), out=out.numpy().reshape(-1))
    return out


try:
    import numpy as _np
except ImportError:  # pragma: no cover - numpy ships with every torch wheel in practice
    _np = None


def _round_and_clamp(x: torch.Tensor, scale: Any, lo: Any, hi: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, clamp(q, lo, hi))`` with ``q = round(x * (1 / scale))``: the integer grid of every fake-quant here."""
    q = torch.mul(x, torch.reciprocal(scale))
    q.round_()
    return q, torch.clamp(q, lo, hi)


def _in_range_bounds(scale: torch.Tensor, lo: int, hi: int) -> Any:
    """Float32 ``(t_lo, t_hi)`` with ``lo <= round(x * (1 / scale)) <= hi`` exactly when ``t_lo <= x <= t_hi``, for
    every float32 ``x`` (the fake-quant's own float32 product and round half to even: both sides are monotone in
    ``x``, so the in-range set is an interval; its ends are found from the real quotient by stepping one float at
    a time); ``None`` for a per-channel or non-finite scale, or without numpy.

    numpy compares a float32 array with a scalar about 6x faster than torch's bool-producing comparisons on CPU, so
    the backward mask comes from two comparisons of ``x`` instead of four passes over the rounded values.
    """
    if _np is None or not isinstance(lo, int) or scale.numel() != 1:
        return None
    return _bounds_of(float(scale), lo, hi)


@functools.lru_cache(maxsize=4096)
def _bounds_of(scale: float, lo: int, hi: int) -> Any:
    """:func:`_in_range_bounds` of a scale's value, remembered: a frozen fake-quant asks for the same one every step."""
    f32 = _np.float32
    inv = f32(1.0) / f32(scale)
    if not _np.isfinite(inv) or inv <= 0:
        return None
    up, down = f32(_np.inf), f32(-_np.inf)

    def code(x: Any) -> Any:
        return _np.rint(f32(x) * inv)

    t_hi = f32((hi + 0.5) / float(inv))
    while code(t_hi) > hi:
        t_hi = _np.nextafter(t_hi, down)
    while code(_np.nextafter(t_hi, up)) <= hi:
        t_hi = _np.nextafter(t_hi, up)
    t_lo = f32((lo - 0.5) / float(inv))
    while code(t_lo) < lo:
        t_lo = _np.nextafter(t_lo, up)
    while code(_np.nextafter(t_lo, down)) >= lo:
        t_lo = _np.nextafter(t_lo, down)
    return t_lo, t_hi


def _packed_equal(q: torch.Tensor, clamped: torch.Tensor) -> torch.Tensor:
    """The in-range mask ``q == clamp(q)`` of rounded values, packed as by :func:`_packed_mask` (numpy's comparison:
    torch's bool-producing ones are 2.5x slower); a NaN is out of range, as before."""
    if _np is None:
        return _pack_inverted(q.sub(clamped).to(torch.bool))
    return _packed_mask(_np.equal(q.numpy(), clamped.numpy()))


def _packed_mask(keep: Any) -> torch.Tensor:
    """A numpy bool array as 1 bit per element, the form :func:`_unpack` reads."""
    return torch.from_numpy(_np.packbits(keep))


_scratch = threading.local()
# The reused comparison buffers stop growing here (two bytes an element: 16 MiB a thread); a larger input compares into
# fresh arrays, as before.
SCRATCH_ELEMENTS = 1 << 23


def _packed_in_range(xn: Any, lo: Any, hi: Any, strict_lo: bool = False) -> torch.Tensor:
    """``lo <= xn <= hi`` (``lo < xn`` with ``strict_lo``) packed as by :func:`_packed_mask`, in two reused bool buffers.

    Fresh comparison results of a megabyte or more are new pages each call (the page faults doubled the comparisons'
    time at 1M elements); the buffers are this thread's, grown to the largest input seen up to
    :data:`SCRATCH_ELEMENTS`, and only read before the packed bits are returned.
    """
    n = xn.size
    buffers = getattr(_scratch, "buffers", None)
    if n > SCRATCH_ELEMENTS:
        buffers = (_np.empty(n, _np.bool_), _np.empty(n, _np.bool_))
    elif buffers is None or buffers[0].size < n:
        buffers = _scratch.buffers = (_np.empty(n, _np.bool_), _np.empty(n, _np.bool_))
    a, b = (buf[:n].reshape(xn.shape) for buf in buffers)
    (_np.greater if strict_lo else _np.greater_equal)(xn, lo, out=a)
    _np.less_equal(xn, hi, out=b)
    return _packed_mask(_np.logical_and(a, b, out=a))


class _FakeQuant(torch.autograd.Function):
    """``(clamp(round(x / s) + zp, qmin, qmax) - zp) * s`` with the straight-through mask gradient.

    Equal to ``aten::fake_quantize_per_{tensor,channel}_affine_cachemask``: ``x * (1/s)`` in
    float32, round half to even, clamped to ``[qmin - zp, qmax - zp]`` (the same as adding ``zp``,
    clamping and subtracting it again: every value is a small integer), times ``s`` rounded once;
    backward ``grad * in_range``. Per-tensor, the mask comes from comparing ``x`` with the float bounds of the
    in-range set in numpy (:func:`_in_range_bounds`); per-channel, from ``q - clamp(q)``, 0 exactly in range,
    cast to bool (torch's bool-producing comparisons are 5-10x slower on CPU). The mask is kept as 1 bit per
    element (torch.ao keeps 1 byte). Values equal aten's, except that a value rounding to zero from below is
    -0.0 here and +0.0 there.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor, lo: Any, hi: Any) -> torch.Tensor:  # type: ignore[override]
        bounds = _in_range_bounds(scale, lo, hi) if ctx.needs_input_grad[0] else None
        if bounds is not None:  # the mask from two comparisons of x; the values in three passes, in place
            xn = x.detach().numpy()
            ctx.save_for_backward(_packed_in_range(xn, bounds[0], bounds[1]))
            return torch.mul(x, torch.reciprocal(scale)).round_().clamp_(lo, hi).mul_(scale)
        q, out = _round_and_clamp(x, scale, lo, hi)
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(_packed_equal(q, out))
        return out.mul_(scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (mask,) = ctx.saved_tensors
        return _masked_grad(grad, mask), None, None, None


# Below this many elements the fused op (one dispatch, scalar kernel) is faster than the vectorized
# path (about ten dispatches, ~70 us a call whatever the size). The crossover depends on the CPU: ~5-10k
# elements on an AMD EPYC core (issue 9, with the older six-pass path); on an Intel Xeon with AMX (stop 39)
# ~80k while observing and ~20k when frozen, where 16384 against 8192 made no QAT step slower and six of eight
# (digits CNN and residual depthwise net, batch 32 and 64, observing and frozen) 0.02-0.11x faster.
MIN_ELEMENTS = 16384
# While observing with fake-quant on, the fast path also observes and rederives scale / zero point (two more
# calls of the fused op on small tensors); the crossover there was ~80k elements on the Intel Xeon. Activations
# up to this size take the fused op in that phase (digits CNN, batch 32: QAT step 1.72x -> 1.59x float, against
# torch.ao's 1.62x); in the float warm-up and the frozen phase, MIN_ELEMENTS applies.
MIN_ELEMENTS_OBSERVING = 81920

_ON = torch.ones(1, dtype=torch.long)
_OFF = torch.zeros(1, dtype=torch.long)


# Buffers and the observer are read from the module dicts directly: nn.Module.__getattr__ costs ~1 us
# per lookup, and this forward runs for every activation and weight of every step. The functions below
# become *instance* methods of torch.ao's own modules (see swap_fake_quant): the classes stay exactly
# torch.ao's, which convert_fx's pattern matching requires.


def _observe(self: FusedMovingAvgObsFakeQuantize, x: torch.Tensor, relu: bool = False) -> Optional[torch.Tensor]:
    """Move the running min/max by ``x`` (``relu(x)``) exactly as the fused op does, in fewer passes; per tensor,
    returns the (min, max) pair observed."""
    if not self.is_per_channel:
        return observe_min_max(self, x, relu)  # the op's own moving average, without its full-size copy and mask
    if relu:
        x = torch.relu(x)
    obs = self._modules["activation_post_process"]
    min_val, max_val = obs._buffers["min_val"], obs._buffers["max_val"]
    axis = self.ch_axis
    flat = (x if axis == 0 else x.transpose(0, axis)).reshape(x.shape[axis], -1)
    cur_min, cur_max = flat.amin(1), flat.amax(1)  # (aminmax(dim=1) is ~20x slower here)
    if min_val.numel() != cur_min.numel():
        min_val.resize_(cur_min.shape).copy_(cur_min)
        max_val.resize_(cur_max.shape).copy_(cur_max)
        return
    c = obs.averaging_constant
    # running + c * (current - running), the fused op's update; a channel still at +-inf (torch.ao sizes
    # and fills the buffers when it fake-quantizes before any observation) takes the current value
    min_val.copy_(torch.where(torch.isinf(min_val), cur_min, min_val + c * (cur_min - min_val)))
    max_val.copy_(torch.where(torch.isinf(max_val), cur_max, max_val + c * (cur_max - max_val)))


def _state_key(self: FusedMovingAvgObsFakeQuantize) -> tuple[int, ...]:
    obs = self._modules["activation_post_process"]._buffers
    scale = self._buffers["scale"]
    return (id(obs["min_val"]), obs["min_val"]._version, obs["max_val"]._version, id(scale), scale._version)


def _update_qparams(self: FusedMovingAvgObsFakeQuantize, ndim: int) -> tuple[torch.Tensor, Any, Any]:
    """Scale / zero point from the running min/max, by the fused op itself, recomputed only when they changed."""
    cache = self.__dict__.get("_qlightning_cache")
    key = _state_key(self) + (ndim,)
    if cache is not None and cache[0] == key:
        return cache[1]
    if self.is_per_channel:
        channels = self._modules["activation_post_process"]._buffers["min_val"].numel()
        if self._buffers["scale"].numel() != channels:  # the op sizes them only when it observes itself
            self._buffers["scale"].resize_(channels)
            self._buffers["zero_point"].resize_(channels)
        dummy = torch.zeros([channels if i == self.ch_axis else 1 for i in range(max(self.ch_axis + 1, 2))])
    else:
        dummy = torch.zeros(1)
    fused_fake_quant(self, dummy, _OFF, _ON)
    obs = self._modules["activation_post_process"]
    scale = self._buffers["scale"]
    if self.is_per_channel:
        shape = [-1 if i == self.ch_axis else 1 for i in range(ndim)]
        zero_point = self._buffers["zero_point"]
        scale = scale.reshape(shape)
        if zero_point.numel() and bool((zero_point == zero_point[0]).all()):
            # one zero point for every channel (0 for symmetric weights): integer bounds, a clamp 3.5x faster than
            # one with per-channel bound tensors, and the same values
            zp = int(zero_point[0])
        else:
            zp = zero_point.to(torch.float32).reshape(shape)
        lo, hi = obs.quant_min - zp, obs.quant_max - zp
    else:
        zp = int(self._buffers["zero_point"].item())
        lo, hi = obs.quant_min - zp, obs.quant_max - zp
    self.__dict__["_qlightning_cache"] = (_state_key(self) + (ndim,), (scale, lo, hi))
    return scale, lo, hi


def fast_fake_quant_forward(self: FusedMovingAvgObsFakeQuantize, X: torch.Tensor) -> torch.Tensor:
    """``FusedMovingAvgObsFakeQuantize.forward`` with a vectorized CPU path; same state, same numbers.

    The running min/max and scale / zero point are still computed by torch.ao's fused op (called in
    observe-only mode on the input and in qparams-only mode on a one-element-per-channel dummy), so they
    are the op's own numbers; per-channel min/max (one vectorized reduction instead of the op's
    per-channel loop) and the fake-quant itself are computed here. When the module was fused with the
    ReLU before it (:func:`fuse_relu_fake_quant`), it applies that ReLU first, in the same function.

    In a module that the prepared graph calls at several sites (:func:`mark_repeated_fake_quants`), an input that is
    its own last output, or a view of it, takes :func:`_repeat_on_own_output`.

    Args:
        X: the input; small, non-CPU or non-float32 inputs take torch.ao's own forward.
    """
    if self.__dict__.get("_qlightning_repeated", False):
        last = _LAST_OUTPUT.get(self)
        if last is not None and _own_output(self, X, last):
            out = _repeat_on_own_output(self, X, last)
            if out is not None:
                return out
    return _fast_fake_quant(self, X)


class _Last(NamedTuple):
    """What a fake-quant's last call gave and saw (:data:`_LAST_OUTPUT`)."""

    base: Any  # a weak reference to the output, or to its base when it is a view (the view may go, its base stays)
    span: tuple[int, int]  # the output's storage offset and size, a dense span of that base
    version: int  # its version counter then (an in-place change moves it)
    state: tuple[int, ...]  # the module's state key (:func:`_state_key`) after the call
    observed: Optional[torch.Tensor]  # the (min, max) pair of the output's values, when the call observed
    qparams: Optional[tuple[torch.Tensor, int, int]]  # (scale, lo, hi) the output was fake-quantized with, per tensor
    phase: tuple[bool, bool]  # (observing, fake-quantizing) then: a repeat in another phase takes the full path


# torch.ao gives ops whose output shares its input's quantization (reshape, transpose, flatten, max pool) the *same*
# fake-quant module at their output as at their input, so a prepared transformer fake-quantizes each attention
# head's q, k and v three times (40 of the benchmark Transformer's 101 fake-quant calls a step). Each module's last
# call is kept here, outside the modules, so that pickling and deepcopy never see a weak reference.
_LAST_OUTPUT: "weakref.WeakKeyDictionary[nn.Module, _Last]" = weakref.WeakKeyDictionary()


def _remember(fq: nn.Module, out: torch.Tensor, observed: Optional[torch.Tensor] = None,
              qparams: Optional[tuple[Any, Any, Any]] = None) -> None:
    """Keep ``fq``'s call for :func:`_repeat_on_own_output`, when ``fq`` is called at several sites (else nothing)."""
    if not fq.__dict__.get("_qlightning_repeated", False):
        return
    if out.is_inference() or not dense_order(out).is_contiguous():
        # inference tensors keep no version counter; a tensor that is not one span of memory shares its base with
        # views holding other values
        _LAST_OUTPUT.pop(fq, None)
        return
    if qparams is not None and isinstance(qparams[1], int):
        qparams = (qparams[0].clone(), *qparams[1:])  # the module's own scale buffer, which the next call rewrites
    else:
        qparams = None
    base = out if out._base is None else out._base
    _LAST_OUTPUT[fq] = _Last(weakref.ref(base), (out.storage_offset(), out.numel()), out._version, _state_key(fq),
                             observed, qparams, _phase(fq))


def _phase(fq: nn.Module) -> tuple[bool, bool]:
    buffers = fq._buffers
    return buffers["observer_enabled"].item() == 1, buffers["fake_quant_enabled"].item() == 1


def _own_output(fq: nn.Module, X: torch.Tensor, last: _Last) -> bool:
    """Whether ``X`` holds the elements of ``fq``'s last output, unchanged since, with ``fq``'s state as it left it (a
    checkpoint load or a DDP broadcast in between changes it)."""
    base = last.base()
    if base is None or X.is_inference() or X._version != last.version or _state_key(fq) != last.state:
        return False
    # the output itself, or a view holding exactly its elements, in any order (a reshape, transpose or permute; not
    # a slice): a dense span of the same base, at the same place
    return ((X is base or X._base is base) and (X.storage_offset(), X.numel()) == last.span
            and dense_order(X).is_contiguous())


def _repeat_on_own_output(fq: nn.Module, X: torch.Tensor, last: _Last) -> Optional[torch.Tensor]:
    """The fused op's result on a view ``X`` of ``fq``'s own last output, from what that call saw; ``None``: the full path.

    Every element of ``X`` is ``c * s`` in float32 for an integer code ``c`` in the clamp range. ``(c * s) * (1 / s)``
    is ``c`` times at most three float32 roundings (relative 2**-24 each), off ``c`` by under ``3 * 2**-24 * |c|``
    (under 0.5 for any code below 2**21), so it rounds back to ``c``. Hence, by phase:

    * observer off, fake-quant on: fake-quantizing ``X`` again gives ``X``, with a gradient mask of ones;
    * observing and fake-quantizing: ``X``'s min and max are the last call's fake-quantized (min, max) (fake-quant
      is monotone), observed as a pair as :func:`observe_min_max` does. The new scale and zero point then map every
      code of the last grid to itself (checked on all of them, :func:`_same_codes`), or the full path runs: ``X`` is
      ``round(X / s_last) * s_new`` with the gradient passed through;
    * observing in the float warm-up: ``X``'s values are the last call's, so is their (min, max); ``X`` itself.

    A NaN element passes its gradient here where the full path's mask would zero it; the loss is NaN either way.
    """
    observing, quantizing = _phase(fq)
    if (observing, quantizing) != last.phase:  # the flags changed since (a phase switch between two calls)
        return None
    if not observing:
        return X if quantizing else None
    if last.observed is None or fq.__dict__.get("_qlightning_relu", False):
        return None
    if quantizing and last.qparams is None:
        return None
    with torch.no_grad():
        seen = last.observed
        if quantizing:
            scale, lo, hi = last.qparams
            seen = torch.mul(seen, torch.reciprocal(scale)).round_().clamp_(lo, hi).mul_(scale)
        fused_fake_quant(fq, seen, _ON, _OFF)  # observed as a pair, as observe_min_max does
        if centres_on_zero(fq):
            straddle_zero_(fq._modules["activation_post_process"])
        fq.__dict__.pop("_qlightning_cache", None)
        if not quantizing:
            _LAST_OUTPUT[fq] = last._replace(state=_state_key(fq))
            return X
        qparams = _update_qparams(fq, X.dim())
    if _same_codes(last.qparams, qparams):
        out = _Recode.apply(X, last.qparams[0], qparams[0])
    else:
        out = _FakeQuant.apply(X, *qparams)
    _remember(fq, out, seen, qparams)
    return out


def _same_codes(before: tuple[Any, Any, Any], after: tuple[Any, Any, Any]) -> bool:
    """Whether fake-quantizing with ``after``'s (scale, lo, hi) maps each value ``c * scale`` of ``before``'s grid back
    to its code ``c``: the fake-quant's own float32 arithmetic on all of ``before``'s codes."""
    (scale, lo, hi), (new_scale, new_lo, new_hi) = before, after
    if not isinstance(new_lo, int):
        return False
    codes = torch.arange(lo, hi + 1, dtype=torch.float32)
    again = torch.mul(codes * scale, torch.reciprocal(new_scale)).round_().clamp_(new_lo, new_hi)
    return torch.equal(again, codes)


class _Recode(torch.autograd.Function):
    """``round(x / s_before) * s_after`` (``x / s`` as the fake-quant computes it) with the gradient passed through:
    a fake-quant of values on ``s_before``'s grid whose codes :func:`_same_codes` found unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return torch.mul(x, torch.reciprocal(before)).round_().mul_(after)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None, None


def _fast_fake_quant(self: FusedMovingAvgObsFakeQuantize, X: torch.Tensor) -> torch.Tensor:
    """:func:`fast_fake_quant_forward` for an input it fake-quantizes afresh; remembers the call (:func:`_remember`)."""
    relu = self.__dict__.get("_qlightning_relu", False)
    n = X.numel()
    if (n < MIN_ELEMENTS or X.device.type != "cpu" or X.dtype != torch.float32
            or (n < MIN_ELEMENTS_OBSERVING and self._buffers["observer_enabled"].item() == 1
                and self._buffers["fake_quant_enabled"].item() == 1)):
        # small tensors: the fused op's single dispatch beats several vectorized ones
        self.__dict__.pop("_qlightning_cache", None)  # the op writes scale / zp without a version bump
        X = torch.relu(X) if relu else X
        out = fused_forward(self, X) if type(self) is FusedMovingAvgObsFakeQuantize else type(self).forward(self, X)
        _remember(self, out)
        return out
    observed: list = []
    qparams = _observe_then_qparams(self, X, relu, observed)
    seen = observed[0] if observed else None
    if qparams is FAKE_QUANT_OFF:
        out = torch.relu(X) if relu else X  # the fused op returns a copy whose gradient is grad * ones
        _remember(self, out, seen)
        return out
    if qparams is UNOBSERVED:  # not remembered: torch.ao's op derives qparams from no statistics
        _LAST_OUTPUT.pop(self, None)
        return type(self).forward(self, torch.relu(X) if relu else X)
    out = (_ReluFakeQuant if relu else _FakeQuant).apply(X, *qparams)
    _remember(self, out, seen, qparams)
    return out


FAKE_QUANT_OFF, UNOBSERVED = object(), object()


def _observe_then_qparams(self: FusedMovingAvgObsFakeQuantize, X: torch.Tensor, relu: bool = False,
                          observed: Optional[list] = None) -> Any:
    """Observe ``X`` (``relu(X)``) when the observer is on, as the fused op would; then what to fake-quantize
    with: ``(scale, lo, hi)``, ``FAKE_QUANT_OFF``, or ``UNOBSERVED`` (no statistics yet: torch.ao's own path).
    A per-tensor observation's (min, max) pair is appended to ``observed``."""
    buffers = self._buffers
    if buffers["observer_enabled"].item() == 1:
        with torch.no_grad():
            pair = _observe(self, X.detach(), relu)
            if observed is not None and pair is not None:
                observed.append(pair)
            if centres_on_zero(self):
                straddle_zero_(self._modules["activation_post_process"])  # as ZeroCenteredWeightRange.forward
        self.__dict__.pop("_qlightning_cache", None)  # the op writes min/max in place without a version bump
    if buffers["fake_quant_enabled"].item() != 1:
        return FAKE_QUANT_OFF
    if self._modules["activation_post_process"]._buffers["min_val"].numel() == 0:
        return UNOBSERVED
    with torch.no_grad():
        return _update_qparams(self, X.dim())


class _ReluFakeQuant(torch.autograd.Function):
    """``fake_quant(relu(x))`` in one function: one 1-bit mask (ReLU's and fake-quant's) kept for backward.

    Unfused, ReLU keeps its float output (4 bytes per element) for its backward and fake-quant keeps a
    mask; the next conv keeps the fake-quant output. Fused, the ReLU output is a temporary. Values and
    gradients are those of ``relu`` then :class:`_FakeQuant`: ``grad * (relu(x) > 0) * in_range``.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor, lo: Any, hi: Any) -> torch.Tensor:  # type: ignore[override]
        bounds = _in_range_bounds(scale, lo, hi) if ctx.needs_input_grad[0] else None
        if bounds is not None:  # kept where x > 0 (ReLU's gradient) and relu(x) rounds to at most hi
            xn = x.detach().numpy()
            ctx.save_for_backward(_packed_in_range(xn, _np.float32(0), bounds[1], strict_lo=True))
            # ReLU as the clamp's lower bound 0 (lo <= 0): the same values, a negative input giving -0.0 or +0.0
            return torch.mul(x, torch.reciprocal(scale)).round_().clamp_(0, hi).mul_(scale)
        r = torch.relu(x)
        q, out = _round_and_clamp(r, scale, lo, hi)
        if ctx.needs_input_grad[0]:
            # q - clamp(q) + 1 - sign(r): 0 exactly where in range and x > 0, >= 1 elsewhere (q >= 0 >= lo,
            # zero points lie in [qmin, qmax]: only the upper bound clips, so q - clamp(q) >= 0)
            drop = q.sub_(out).sub_(r.sign_()).add_(1.0)
            ctx.save_for_backward(_pack_inverted(drop.to(torch.bool)))
        return out.mul_(scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (mask,) = ctx.saved_tensors
        return _masked_grad(grad, mask), None, None, None


# ---------------------------------------------------------------------------------------------- linear


def _fake_quant_values(w: torch.Tensor, scale: torch.Tensor, lo: Any, hi: Any) -> tuple[torch.Tensor, Any]:
    """:class:`_FakeQuant`'s forward arithmetic: ``(fq(w), in_range)``, the mask a numpy bool array (torch's
    bool-producing comparisons are 2.5x slower), or a 0/1 ``uint8`` tensor without numpy."""
    q, out = _round_and_clamp(w, scale, lo, hi)
    if _np is None:
        inside = q.sub_(out).to(torch.bool).logical_not_().view(torch.uint8)
    else:
        inside = _np.equal(q.numpy(), out.numpy())
    return out.mul_(scale), inside


def _mask_(grad: torch.Tensor, inside: Any) -> torch.Tensor:
    """``grad *= inside`` for a fresh, contiguous ``grad`` and a :func:`_fake_quant_values` mask (numpy casts the mask
    inside its multiply; torch copies a ``uint8`` or bool multiplier to float first)."""
    if isinstance(inside, torch.Tensor):
        return grad.mul_(inside)
    _np.multiply(grad.numpy(), inside, out=grad.numpy())
    return grad


class _LinearRecomputingWeightFakeQuant(torch.autograd.Function):
    """``linear(x, fq(w), b)`` that keeps ``w`` (the parameter itself) for backward instead of ``fq(w)``.

    torch.ao's QAT Linear keeps the fake-quantized weight, a weight-sized float tensor per layer, alive
    until backward (on the benchmark transformer, 12 of 69 MiB saved for backward). Here backward
    re-derives ``fq(w)`` and its mask from the weight and the same scale / zero point (a few passes over
    the weight, small next to the matmuls). Forward values are bit-identical; gradients equal autograd's
    ``addmm`` backward up to the reduction order of the matrix products.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: Any, scale: torch.Tensor, lo: Any, hi: Any) -> torch.Tensor:  # type: ignore[override]
        wq, _ = _fake_quant_values(w, scale, lo, hi)
        tensors = (lo, hi) if isinstance(lo, torch.Tensor) else ()
        ctx.bounds = None if tensors else (lo, hi)
        ctx.has_bias = b is not None
        ctx.save_for_backward(x, w, scale, *tensors)
        return torch.nn.functional.linear(x, wq, b)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        x, w, scale, *tensors = ctx.saved_tensors
        lo, hi = ctx.bounds if ctx.bounds is not None else tensors
        wq, inside = _fake_quant_values(w, scale, lo, hi)
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = g.mm(wq).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = _mask_(g.t().mm(x.reshape(-1, x.shape[-1])), inside)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0)
        return grad_x, grad_w, grad_b, None, None, None


def fast_linear_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """QAT ``Linear`` / ``LinearReLU`` forward whose weight fake-quant is recomputed in backward.

    The weight fake-quant module still observes and derives its qparams exactly as
    :func:`fast_fake_quant_forward` does (same state); only what autograd keeps changes.

    Args:
        input: the layer input; small weights, no grad, non-CPU or non-float32 inputs and inputs of fewer
            than 2 dims take torch.ao's own forward.
    """
    fq = self._modules["weight_fake_quant"]
    weight = _parameter(self, "weight")
    relu = type(self) is not _nnqat.Linear
    if (weight.numel() < MIN_ELEMENTS or not is_fast(fq) or not torch.is_grad_enabled() or not weight.requires_grad
            or input.device.type != "cpu" or input.dtype != torch.float32 or input.dim() < 2):
        return type(self).forward(self, input)
    qparams = _observe_then_qparams(fq, weight)
    if qparams is UNOBSERVED:
        return type(self).forward(self, input)  # torch.ao's own path
    if qparams is FAKE_QUANT_OFF:
        out = torch.nn.functional.linear(input, weight, _parameter(self, "bias"))
    else:
        out = _LinearRecomputingWeightFakeQuant.apply(input, weight, _parameter(self, "bias"), *qparams)
    return torch.relu(out) if relu else out


# ---------------------------------------------------------------------------------------------- conv-bn


def fast_conv_bn_forward_approximate(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """torch.ao's QAT conv-bn forward without the full-size ``conv / scale_factor`` pass.

    torch.ao computes ``bn(conv(x, fq(w * s)) / s + b)`` with ``s = gamma / running_std`` per output
    channel: one extra elementwise pass over the conv output forward and three backward (the gradient
    to ``s`` reads the conv output, which is kept alive for it). The division is per output channel, so
    it moves onto the weight: ``bn(conv(x, fq(w * s) / s, b))``, the same function (float rounding
    differs, ~1e-7 relative), computed on the small weight tensor.

    With the weight's fake-quant off (the float warm-up) ``fq(w * s) / s`` is ``w``: the conv takes the
    weight itself (the weight observer, when on, still sees the folded ``w * s``), the float model's cost.
    A channel whose gamma is exactly 0 takes the weight itself in every phase
    (:func:`~qlightning.engines.traceable.weight_out_of_fold`): torch.ao's fold is NaN there.
    With the BatchNorm frozen (or in eval) it folds whole: ``conv(x, fq(w * s), (b - mean) * s + beta)``
    (:func:`frozen_bn_bias`), no BatchNorm pass at all.

    Args:
        input: the conv input.
    """
    modules, weight, bias = self._modules, _parameter(self, "weight"), _parameter(self, "bias")
    fq = modules["weight_fake_quant"]
    enabled = fq._buffers.get("fake_quant_enabled")  # a FakeQuantizeBase's flag (a custom weight module may have none)
    if enabled is not None and input.device.type == "cpu" and enabled.item() != 1:  # on CPU: no device wait
        observing = fq._buffers.get("observer_enabled")
        if observing is None or observing.item() == 1:
            with torch.no_grad():
                fq(weight * _folding_factor(self, weight.dim()))  # observes (the folded weight, as below); returns its input
        return modules["bn"](self._conv_forward(input, weight, bias))
    s = _folding_factor(self, weight.dim())
    folded = fq(weight * s)
    if not modules["bn"].training:  # BatchNorm frozen (or eval): the whole fold is the conv's weight and bias
        return self._conv_forward(input, folded, frozen_bn_bias(self, s.reshape(-1), bias))
    if input.device.type != "cpu" or not bool(s.all()):  # a gamma of exactly 0 (zero-init residual BatchNorms)
        weight = weight_out_of_fold(folded, s, weight)  # that channel convolves with the weight itself, not 0 / 0
    # the custom backward keeps one weight-sized tensor less, for ~40 us of Python a step: worth it only for large
    # weights (the same quotient; gamma's gradient differs by float rounding)
    elif folded.numel() < MIN_ELEMENTS:
        weight = folded / s
    else:
        weight = _DivideKeepingResult.apply(folded, s)
    return modules["bn"](self._conv_forward(input, weight, bias))


def folds_dividing_by_zero_gammas(module: nn.Module, names: Optional[dict[int, str]] = None) -> list[str]:
    """The BatchNorms of ``module``'s torch.ao QAT conv-bn and linear-bn modules whose gamma is exactly 0 in some channel
    and whose fold divides by it (:func:`~qlightning.engines.base.zero_gammas`): a conv-bn on this module's fold
    (:func:`fast_conv_bn_forward_approximate`) is left out, as it convolves such a channel with the weight itself.

    Args:
        module: a prepared module.
        names: ``{id(gamma): name}`` of the float model's BatchNorms, to name them as the user's model does (torch.ao's
            QAT modules keep the float model's parameters); a BatchNorm not in it is named inside the fused module.
    """
    dividing = []
    for name, m in module.named_modules():
        if isinstance(m, (_nniqat.ConvBn1d, _nniqat.ConvBn2d, _nniqat.ConvBn3d, _nniqat.LinearBn1d)):
            fold = getattr(m.__dict__.get("_forward_approximate"), "__func__", None)
            if fold is not fast_conv_bn_forward_approximate:
                own = f"{name}.bn" if name else "bn"
                dividing.append(((names or {}).get(id(m.bn.weight), own), m.bn.weight))
    return zero_gammas(dividing)


def frozen_bn_bias(conv_bn: nn.Module, scale_factor: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """:func:`~qlightning.engines.traceable.frozen_batch_norm_bias` of a torch.ao QAT module's BatchNorm.

    Args:
        conv_bn: torch.ao's QAT conv-bn or linear-bn module.
        scale_factor: ``gamma / running_std``, 1-D.
        bias: the layer's own bias, or ``None``.
    """
    bn = conv_bn._modules["bn"]
    return frozen_batch_norm_bias(_parameter(bn, "bias"), bn._buffers["running_mean"], scale_factor, bias)


def _parameter(module: nn.Module, name: str) -> Any:
    """``getattr(module, name)``, read from the parameter dict where it is a plain parameter: ``nn.Module.__getattr__``
    costs 1-2 us a lookup, ~10 per layer and step (most of a step's Python at batch 1). Pruned (``torch.nn.utils.prune``:
    an attribute computed from ``<name>_orig``) or parametrized, it is the attribute itself."""
    parameters = module._parameters
    return parameters[name] if name in parameters else getattr(module, name)


def _folding_factor(conv_bn: nn.Module, ndim: int) -> torch.Tensor:
    """``gamma / running_std`` of ``conv_bn``'s BatchNorm, shaped to scale its ``ndim``-dimensional weight's output
    channels."""
    bn = conv_bn._modules["bn"]
    scale_factor = _parameter(bn, "weight") / torch.sqrt(bn._buffers["running_var"] + bn.eps)
    shape = [1] * ndim
    shape[0] = -1
    return scale_factor.reshape(shape)


class _DivideKeepingResult(torch.autograd.Function):
    """``a / b`` whose backward keeps the result (which the conv keeps anyway), not ``a``: one weight-sized
    tensor less held until backward. ``d/da = g / b``, ``d/db = -sum(g * (a / b)) / b`` over broadcast dims."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out = a / b
        ctx.save_for_backward(out, b)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        out, b = ctx.saved_tensors
        grad_a = grad / b if ctx.needs_input_grad[0] else None
        grad_b = None
        if ctx.needs_input_grad[1]:
            grad_b = -(grad * out) / b
            dims = [i for i, (n, m) in enumerate(zip(grad_b.shape, b.shape)) if m == 1 and n != 1]
            grad_b = grad_b.sum(dim=dims, keepdim=True) if dims else grad_b
        return grad_a, grad_b


def _conv_bn_without_relu(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """``ConvBnReLU*d.forward`` minus the ReLU, which the fake-quant after it applies (fused)."""
    return self._forward(input)


def _identity(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """``nn.ReLU.forward`` when the fake-quant after it applies the ReLU (fused)."""
    return input


with quiet_torch_ao():
    from torch.ao.nn import qat as _nnqat
    from torch.ao.nn.intrinsic import qat as _nniqat

_CONV_BN = (_nniqat.ConvBn1d, _nniqat.ConvBn2d, _nniqat.ConvBn3d)
_CONV_BN_RELU = (_nniqat.ConvBnReLU1d, _nniqat.ConvBnReLU2d, _nniqat.ConvBnReLU3d)
CONV_BN_RELU = _CONV_BN_RELU  # the compiled path's ReLUs too


def _eligible(m: nn.Module) -> bool:
    return type(m) in (FusedMovingAvgObsFakeQuantize, ZeroCenteredFusedFakeQuantize) and type(m.activation_post_process) in (
        MovingAverageMinMaxObserver,
        MovingAveragePerChannelMinMaxObserver,
    )


def is_fast(m: nn.Module) -> bool:
    """Whether ``m``'s instance forward is :func:`fast_fake_quant_forward` (set by :func:`swap_fake_quant`).

    Args:
        m: the module to inspect.
    """
    return getattr(m.__dict__.get("forward"), "__func__", None) is fast_fake_quant_forward


def _patch(m: nn.Module, name: str, fn: Any) -> None:
    m.__dict__[name] = types.MethodType(fn, m)


def _call_sites(gm: nn.Module) -> dict[int, int]:
    """How many ``call_module`` nodes of ``gm``'s graph call each module *object* (torch.ao registers a shared
    fake-quant under several names)."""
    calls: dict[int, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            key = id(gm.get_submodule(node.target))
            calls[key] = calls.get(key, 0) + 1
    return calls


def mark_repeated_fake_quants(gm: nn.Module) -> int:
    """Flag the fast fake-quants that ``gm``'s graph calls at more than one site (``_qlightning_repeated``): only
    they remember their last call for :func:`_repeat_on_own_output`. Returns how many.

    Args:
        gm: the prepared GraphModule (a module without a graph flags nothing).
    """
    if getattr(gm, "graph", None) is None:
        return 0
    calls = _call_sites(gm)
    count = 0
    for m in gm.modules():
        if is_fast(m) and calls.get(id(m), 0) > 1:
            m.__dict__["_qlightning_repeated"] = True
            count += 1
    return count


def fuse_relu_fake_quant(gm: nn.Module, applies_relu: Callable[[nn.Module], bool] = is_fast) -> int:
    """Let each fake-quant that only follows a ``ConvBnReLU*d`` or ``nn.ReLU`` apply that ReLU itself.

    Only where the ReLU's output has no other user, both modules are called once in the graph (torch.ao
    shares one observer between ops that share qparams; models reuse one ``nn.ReLU``) and the fake-quant
    is per-tensor. The fake-quant is flagged ``_qlightning_relu``; its forward must honour the flag. Returns
    how many pairs were fused (:func:`unfuse_relu_fake_quant` undoes them).

    Args:
        gm: the prepared GraphModule (a module without a graph fuses nothing).
        applies_relu: whether a fake-quant's forward applies the ReLU when flagged (default: the fast path's).
    """
    graph = getattr(gm, "graph", None)
    if graph is None:
        return 0
    calls = _call_sites(gm)
    fused = 0
    for node in graph.nodes:
        if node.op != "call_module" or len(node.users) != 1:
            continue
        producer = gm.get_submodule(node.target)
        if type(producer) not in _CONV_BN_RELU + (nn.ReLU,) or calls.get(id(producer)) != 1:
            continue
        user = next(iter(node.users))
        if user.op != "call_module":
            continue
        fq = gm.get_submodule(user.target)
        if calls.get(id(fq)) != 1:
            continue
        if not applies_relu(fq) or fq.is_per_channel:
            continue
        _patch(producer, "forward", _identity if type(producer) is nn.ReLU else _conv_bn_without_relu)
        fq.__dict__["_qlightning_relu"] = True
        fused += 1
    return fused


def unfuse_relu_fake_quant(module: nn.Module) -> int:
    """Undo :func:`fuse_relu_fake_quant` alone: the ReLUs run their own forwards again; returns how many.

    Args:
        module: the prepared module.
    """
    count = 0
    for m in module.modules():
        if getattr(m.__dict__.get("forward"), "__func__", None) in (_identity, _conv_bn_without_relu):
            del m.__dict__["forward"]
        count += m.__dict__.pop("_qlightning_relu", False) is True
    return count


def swap_fake_quant(module: nn.Module, fake_quant: bool = True, conv_bn: bool = False, relu: bool | None = None,
                    linear: bool = False) -> int:
    """Switch eligible modules of a prepared ``module`` to the fast paths, in place; returns how many.

    ``fake_quant``: plain ``FusedMovingAvgObsFakeQuantize`` (bit-identical). ``conv_bn``: torch.ao
    QAT ``ConvBn*`` / ``ConvBnReLU*`` (the same function up to float rounding). ``relu`` (default: with
    ``conv_bn``): ReLU of a ``ConvBnReLU*d`` applied inside the fake-quant after it (bit-identical).
    Only instance methods change: classes, state and ``convert_fx`` are untouched.

    Args:
        module: the prepared module.
        fake_quant: swap the fused moving-average fake-quants with min/max observers.
        conv_bn: swap the conv-bn QAT modules' ``_forward_approximate``.
        relu: fuse ReLUs into the fake-quants after them (:func:`fuse_relu_fake_quant`); ``None`` follows ``conv_bn``.
        linear: swap QAT ``Linear`` / ``LinearReLU`` forwards (large enough weights only).
    """
    count = 0
    for m in module.modules():
        if fake_quant and _eligible(m):
            _patch(m, "forward", fast_fake_quant_forward)
            count += 1
        elif conv_bn and type(m) in _CONV_BN + _CONV_BN_RELU and not m._enable_slow_path_for_better_numerical_stability:
            _patch(m, "_forward_approximate", fast_conv_bn_forward_approximate)
            count += 1
        elif (linear and type(m) in (_nnqat.Linear, _nniqat.LinearReLU) and _eligible(m.weight_fake_quant)
              and m.weight.numel() >= MIN_ELEMENTS):  # small layers: not worth an extra Python frame per call
            _patch(m, "forward", fast_linear_forward)
            count += 1
    if relu if relu is not None else conv_bn:
        fuse_relu_fake_quant(module)
    if fake_quant:
        mark_repeated_fake_quants(module)
    return count


def restore_fake_quant(module: nn.Module) -> int:
    """Undo :func:`swap_fake_quant`.

    Args:
        module: the prepared module; instance forwards and cached qparams are removed from every submodule.

    Returns:
        How many patched methods and ReLU flags were removed (cache entries not counted).
    """
    count = 0
    for m in module.modules():
        for name in ("forward", "_forward_approximate", "_qlightning_cache", "_qlightning_relu", "_qlightning_repeated"):
            if name in m.__dict__:
                del m.__dict__[name]
                count += name not in ("_qlightning_cache", "_qlightning_repeated")
    return count


def fast_modules(module: nn.Module) -> Iterator[nn.Module]:
    """The submodules of ``module`` that run :func:`fast_fake_quant_forward`.

    Args:
        module: the prepared module.
    """
    for m in module.modules():
        if is_fast(m):
            yield m
