"""Fused fake-quants in plain tensor ops, and a training forward through ``torch.compile``: the compiled QAT
path of both engines (``engine_options.compile``).

``torch.compile`` of a prepared model gets nowhere by itself: dynamo skips ``torch.ao.quantization``
(``MOD_SKIPLIST`` in ``torch/_dynamo/trace_rules.py``), so every torch.ao fake-quant is a graph break, and the
fused op (torch.ao's and torchao's ``FusedMovingAvgObsFakeQuantize`` run the same one) keeps its flags in
tensors that it reads on the host. Here each such fake-quant gets an *instance* forward
(:func:`traceable_forward`, defined here, so dynamo inlines it) that does what
``torch.fused_moving_avg_obs_fake_quant`` does in plain tensor ops:

* the moving-average min/max update (``running + c * (current - running)``, the first observation taken as
  is), per tensor or per channel;
* scale and zero point by :func:`choose_qparams`, a tensor-op transcription of
  ``ATen/native/quantized/cpu/QuantUtils.h::ChooseQuantizationParams`` (what the fused op calls: float and
  double steps where it has them), so that the qparams are the fused op's own bit for bit;
* the fake-quant ``(clamp(round(x * (1/s)) + zp, qmin, qmax) - zp) * s`` with the straight-through
  gradient inside the range (``aten::fake_quantize_per_*_affine_cachemask``'s arithmetic), its mask built in
  float ops: inductor's C++ code stores a bool tensor an element at a time, and its partitioner saves the
  smallest tensor for the backward, so any bool on the way was stored (notes/perf.md section 26);
* a ReLU that an engine fused into the fake-quant (flag ``_qlightning_relu``; the FX engine does for
  ``nn.ReLU`` modules) is applied inside it, ReLU's gradient in the same float mask, for the same reason;
  :func:`relu` and :func:`hardtanh` (ReLU6) are the activations with float masks for an engine to use elsewhere.

Eagerly the forward is bit-identical to the fused op (outputs, gradients, every buffer: tests). Compiled,
inductor fuses it with its neighbours; the phase (observers, fake-quant) is a Python tuple that dynamo
guards on, refreshed from the modules' flag buffers before every compiled call, so a phase change
recompiles once instead of breaking the graph, and the buffers stay the single source of truth
(checkpoints, DDP broadcasts, the libraries' own ``enable_observer``). The batch dimension is dynamic from the
first compile, so an epoch's last, smaller batch does not compile again. A conv-bn fold reads BatchNorm's running
variance through :func:`folded_variance`, compiled from a snapshot the dispatcher takes before each call (AOT
autograd's backward otherwise read it after the training batch_norm had updated it in place). A graph module whose graph is rewritten
(PT2E's BatchNorm freeze and train/eval switches regenerate its code) gets one compiled function per generated
code. Compiled results differ from eager by float rounding (inductor reorders reductions), as compiled float
training does.

Classes, buffers and ``state_dict`` keys stay the library's, so converting is unchanged; the engines undo
everything (:func:`uncompile`, :func:`restore_fake_quants`) before converting. No quantization library is
imported here: the engines say which fake-quants qualify.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from qlightning.engines.base import centres_on_zero, is_fused_fake_quant, per_channel_counts, straddle_zero_

# ATen/native/quantized/cpu/QuantUtils.h: constexpr float SMALL_SCALE_THRESHOLD = 6.1e-5f
SMALL_SCALE_THRESHOLD = float(torch.tensor(6.1e-5, dtype=torch.float32))


def choose_qparams(min_val: torch.Tensor, max_val: torch.Tensor, qmin: int, qmax: int,
                   symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale (float32) and zero point (int32) per element of ``min_val`` / ``max_val``, as the fused op computes them.

    A line-by-line transcription of ``ChooseQuantizationParams(min, max, qmin, qmax, preserve_sparsity=symmetric)``:
    the symmetric widening in float32, scale and zero point in double, the 0.1 fallback for a zero or
    overflowing scale and the small-scale cut-off (``SMALL_SCALE_THRESHOLD``) with its min/max rescaling.

    Args:
        min_val: the observed minimum (a scalar tensor, or one per channel).
        max_val: the observed maximum, of the same shape.
        qmin: the lowest quantized value.
        qmax: the highest quantized value.
        symmetric: a symmetric qscheme (``preserve_sparsity``): the range is widened symmetrically and a
            straddling range gets the middle zero point.
    """
    mn, mx = min_val, max_val
    if symmetric:
        sym_qmin, sym_qmax = -((qmax - qmin) // 2 + 1), (qmax - qmin) // 2
        max_scale = torch.maximum((mn / sym_qmin).abs(), (mx / sym_qmax).abs())
        straddles = (mn < 0) & (mx > 0)
        mn = torch.where(straddles, max_scale * sym_qmin, mn)
        mx = torch.where(straddles, max_scale * sym_qmax, mx)
    mn, mx = torch.clamp(mn, max=0.0), torch.clamp(mx, min=0.0)  # the range holds 0
    scale = (mx.double() - mn.double()) / (qmax - qmin)
    as_float = scale.float()
    scale = torch.where((as_float == 0) | torch.isinf(torch.reciprocal(as_float)), 0.1, scale)
    small = scale < SMALL_SCALE_THRESHOLD
    amplifier = SMALL_SCALE_THRESHOLD / scale.float()
    span = SMALL_SCALE_THRESHOLD * (qmax - qmin)
    small_min = torch.where(mn == 0, mn, torch.where(mx == 0, torch.full_like(mn, -span), mn * amplifier))
    small_max = torch.where(mn == 0, torch.full_like(mx, span), torch.where(mx == 0, mx, mx * amplifier))
    mn, mx = torch.where(small, small_min, mn), torch.where(small, small_max, mx)
    scale = torch.where(small, SMALL_SCALE_THRESHOLD, scale)
    low, high = mn.double() / scale, mx.double() / scale
    # the zero point from whichever end adds the smaller terms
    zero_point = torch.where(abs(qmin) - low.abs() < abs(qmax) - high.abs(), qmin - low, qmax - high)
    if symmetric:
        zero_point = torch.where((mn < 0) & (mx > 0), (qmin + qmax) / 2, zero_point)
    zero_point = torch.where(zero_point < qmin, float(qmin), torch.where(zero_point > qmax, float(qmax), torch.round(zero_point)))
    return scale.float(), zero_point.to(torch.int32)


def fake_quantize(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int,
                  relu: bool = False) -> torch.Tensor:
    """``(clamp(round(x * (1/s)) + zp, qmin, qmax) - zp) * s``; gradient 1 where ``round(x/s) + zp`` is in range, else 0.

    Args:
        x: the tensor to fake-quantize.
        scale: the scale, broadcastable to ``x``.
        zero_point: the zero point, broadcastable to ``x``.
        qmin: the lowest quantized value.
        qmax: the highest quantized value.
        relu: fake-quantize ``relu(x)``, with ReLU's gradient (0 where ``x <= 0``) in the same mask.
    """
    with torch.no_grad():
        zp = zero_point.to(x.dtype)
        q, clamped = _codes(torch.relu(x) if relu else x, scale, zp, qmin, qmax)
        # The mask in float arithmetic, with no bool on the way: inductor's C++ code stores a bool vector an
        # element at a time (131k elements: 700 us against 35 us at 1 thread, torch 2.13), and its partitioner
        # saves the smallest tensor for the backward, so a bool anywhere in the mask got stored. q and its clamp
        # are integers, so |q - clamp(q)| is 0 inside the range and at least 1 outside: the mask is 1.0 or 0.0,
        # what a bool promotes to in the product. (A NaN input gets a NaN mask where aten's is 0; its output is
        # NaN too, so the loss and every gradient before it are NaN either way.)
        inside = torch.clamp(1.0 - torch.abs(q - clamped), min=0.0)
        if relu:
            inside = inside * _positive(x)
        out = (clamped - zp) * scale
    # forward: out + 0; backward: the mask (the straight-through estimator torch.ao's cachemask ops implement)
    return out + (x - x.detach()) * inside


def _codes(x: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, qmin: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``round(x / s) + zp`` (as ``x * (1/s)``, the fused op's arithmetic) and its clamp to ``[qmin, qmax]``."""
    q = torch.round(x * torch.reciprocal(scale)) + zp
    return q, torch.clamp(q, qmin, qmax)


def _on_grid(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """:func:`fake_quantize`'s values of ``x``, without its gradient: the same arithmetic, element for element."""
    zp = zero_point.to(x.dtype)
    return (_codes(x, scale, zp, qmin, qmax)[1] - zp) * scale


def _positive(x: torch.Tensor) -> torch.Tensor:
    """1.0 where ``x > 0``, else 0.0 (ReLU's gradient), in float ops: ``torch.relu``'s own backward keeps a bool
    mask, which inductor stores an element at a time (a compiled ``relu(x) * 2`` of 1M elements, forward and
    backward: 15.8 ms at 1 thread)."""
    return torch.clamp(torch.sign(x), min=0.0)


def relu(x: torch.Tensor) -> torch.Tensor:
    """``torch.relu(x)``, its gradient through :func:`_positive`'s float mask.

    Args:
        x: the input.
    """
    with torch.no_grad():
        out = torch.relu(x)
    return out + (x - x.detach()) * _positive(x)


def hardtanh(x: torch.Tensor, min_val: float, max_val: float) -> torch.Tensor:
    """``F.hardtanh(x, min_val, max_val)`` (``nn.ReLU6``: 0, 6), its gradient through a float mask (1.0 where
    ``min_val < x < max_val``, aten's ``hardtanh_backward``): aten's bool mask, saved for the backward, was stored
    an element at a time and transposed by inductor's C++ code (MobileNetV2-like, FX compiled while observing: 2.99x
    the float step against 1.66x eager; notes/perf.md section 36).

    Args:
        x: the input.
        min_val: the lower bound.
        max_val: the upper bound.
    """
    with torch.no_grad():
        out = torch.clamp(x, min_val, max_val)
    return out + (x - x.detach()) * (_positive(x - min_val) * _positive(max_val - x))


def _stored_once(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values, as the output of a reduction, which inductor computes once and stores.

    A chain of pointwise ops on a few elements is inlined into each consumer's loop instead: the ~40 scalar steps
    of :func:`choose_qparams` (double divisions among them) ran once per vector of the fake-quant's input. The
    maximum of two copies of ``t`` is ``t`` bit for bit.
    """
    return torch.stack([t, t]).amax(0)


def _flags(fq: nn.Module) -> tuple[bool, bool]:
    return bool(fq.observer_enabled[0]), bool(fq.fake_quant_enabled[0])


def traceable_forward(self: nn.Module, X: torch.Tensor) -> torch.Tensor:
    """``FusedMovingAvgObsFakeQuantize.forward`` in plain tensor ops (see the module docstring).

    As the fused op: the observer moves the running min/max only; with fake-quant on, scale and zero point
    are recomputed from the running min/max at every call (observer on or off) and written to the buffers.

    Args:
        X: the input; returned unchanged when fake-quant is off.
    """
    return fake_quant_with_range(self, X)[0]


def fake_quant_with_range(self: nn.Module, X: torch.Tensor, input_range: tuple[torch.Tensor, torch.Tensor] | None = None
                          ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """:func:`traceable_forward`'s output, and while observing (per tensor) its output's ``(min, max)``.

    The output's range is the fake-quant of the observed input's (fake-quant is monotone), a few scalar ops. A
    caller that knows ``X``'s range passes it as ``input_range`` and the call observes it without reading ``X``:
    the same values as ``aminmax(X)`` where ``X`` is a monotone function of an output whose range this returned.

    Args:
        X: the input; returned unchanged when fake-quant is off.
        input_range: ``X``'s ``(min, max)`` (per-tensor fake-quants), or ``None`` to read them from ``X``.
    """
    obs = self.activation_post_process
    # compiled: the guarded Python copy of the flags (refreshed by the compiled caller); eager: the buffers
    observe, fake_quant = self.__dict__["_qlightning_flags"] if torch.compiler.is_compiling() else _flags(self)
    relu_first = self.__dict__.get("_qlightning_relu", False)  # the ReLU before it is fused in (make_traceable)
    qmin, qmax = obs.quant_min, obs.quant_max
    min_val, max_val = obs.min_val, obs.max_val
    observed = None
    if observe:
        with torch.no_grad():
            x = X.detach()
            if self.is_per_channel:
                if min_val.numel() == 0 and not torch.compiler.is_compiling():  # after reset_min_max_vals
                    _size_per_channel(self, x.shape[self.ch_axis])
                    min_val, max_val = obs.min_val, obs.max_val
                rows = (x if self.ch_axis == 0 else x.transpose(0, self.ch_axis)).flatten(1)
                current_min, current_max = rows.amin(1), rows.amax(1)
            else:
                current_min, current_max = torch.aminmax(x) if input_range is None else input_range
                if relu_first:  # ReLU is monotone: the range of relu(x) is relu of x's
                    current_min, current_max = torch.relu(current_min), torch.relu(current_max)
                observed = current_min, current_max
            c = obs.averaging_constant
            min_val.copy_(torch.where(torch.isinf(min_val), current_min, min_val + c * (current_min - min_val)))
            max_val.copy_(torch.where(torch.isinf(max_val), current_max, max_val + c * (current_max - max_val)))
            if centres_on_zero(self):  # ZeroCenteredWeightRange
                straddle_zero_(obs)
    if not fake_quant:
        return (relu(X) if relu_first else X), observed
    if observe:
        with torch.no_grad():
            scale, zero_point = choose_qparams(min_val, max_val, qmin, qmax, self.is_symmetric_quant)
            self.scale.copy_(scale)
            self.zero_point.copy_(zero_point)
            if torch.compiler.is_compiling():
                scale, zero_point = _stored_once(scale), _stored_once(zero_point)
    else:
        # min/max do not move: the qparams the fused op would recompute are those of the last change, which
        # sync_qparams computes outside the graph (in the compiled caller; here when eager)
        if not torch.compiler.is_compiling():
            sync_qparams(self)
        scale, zero_point = self.scale, self.zero_point
    if self.is_per_channel:
        shape = [-1 if i == self.ch_axis else 1 for i in range(X.dim())]
        scale, zero_point = scale.reshape(shape), zero_point.reshape(shape)
    if observed is not None:
        with torch.no_grad():
            observed = tuple(_on_grid(v, scale, zero_point, qmin, qmax) for v in observed)
    return fake_quantize(X, scale, zero_point, qmin, qmax, relu=relu_first), observed


def fixed_qparams_forward(self: nn.Module, X: torch.Tensor) -> torch.Tensor:
    """A fixed-qparams fake-quant's forward (``FakeQuantize.forward`` with its ``FixedQParamsObserver``, which
    observes nothing: torch.ao's default for sigmoid, hardsigmoid, tanh and softmax) in plain tensor ops: the
    fixed scale and zero point when fake-quant is on, the input otherwise.

    Args:
        X: the input.
    """
    _, fake_quant = self.__dict__["_qlightning_flags"] if torch.compiler.is_compiling() else _flags(self)
    if not fake_quant:
        return X
    obs = self.activation_post_process
    return fake_quantize(X, self.scale, self.zero_point, obs.quant_min, obs.quant_max)


def sync_qparams(m: nn.Module) -> None:
    """``scale`` / ``zero_point`` := ``choose_qparams(min_val, max_val)`` unless nothing changed since the last time.

    What the fused op does at every call with fake-quant on; done once per change (buffer versions and
    identities: a checkpoint load, a DDP broadcast or an observing step bumps them) instead of every step,
    which in a compiled graph costs more than the rest of the fake-quant (measured: 13 ms of a 22 ms digits step).

    Args:
        m: the fused fake-quant; its ``scale`` / ``zero_point`` are written (resized for a per-channel one).
    """
    obs = m.activation_post_process
    key = _qparams_key(m)
    if m.__dict__.get("_qlightning_qparams_key") == key:
        return
    with torch.no_grad():
        scale, zero_point = choose_qparams(obs.min_val, obs.max_val, obs.quant_min, obs.quant_max, m.is_symmetric_quant)
        if m.scale.numel() != scale.numel():  # a per-channel fake-quant before its first observation
            m.scale.resize_(scale.shape)
            m.zero_point.resize_(zero_point.shape)
        m.scale.copy_(scale)
        m.zero_point.copy_(zero_point)
    m.__dict__["_qlightning_qparams_key"] = _qparams_key(m)


def _qparams_key(m: nn.Module) -> tuple[int, ...]:
    """:func:`_buffers_key` of what :func:`sync_qparams` reads and writes (from the module dicts: an
    ``nn.Module`` attribute lookup is ~2 us on this CPU, and this runs per fake-quant before each compiled call)."""
    observed, own = m.activation_post_process._buffers, m._buffers
    return _buffers_key(observed["min_val"], observed["max_val"]) + _buffers_key(own["scale"], own["zero_point"])


def _size_per_channel(m: nn.Module, channels: int) -> None:
    """What the fused op does to empty per-channel buffers at its first observation (+-inf, 1.0, 0)."""
    obs = m.activation_post_process
    obs.min_val.resize_(channels).fill_(float("inf"))
    obs.max_val.resize_(channels).fill_(float("-inf"))
    m.scale.resize_(channels).fill_(1.0)
    m.zero_point.resize_(channels).zero_()


def stock_fused_fake_quant(m: nn.Module) -> bool:
    """A fused moving-average fake-quant (torch.ao's or torchao's) whose forward is its class's own or
    :class:`~qlightning.engines.base.ZeroCenteredWeightRange`'s, which :func:`traceable_forward` reproduces.

    Args:
        m: any module.
    """
    if not is_fused_fake_quant(m):
        return False
    owner = next(c for c in type(m).__mro__ if "forward" in c.__dict__)
    return owner.__name__ in ("FusedMovingAvgObsFakeQuantize", "ZeroCenteredWeightRange")


def fixed_qparams_fake_quant(m: nn.Module) -> bool:
    """A per-tensor ``FakeQuantize`` (its class's forward) whose observer is a ``FixedQParamsObserver``, which
    :func:`fixed_qparams_forward` reproduces.

    Args:
        m: any module.
    """
    if type(getattr(m, "activation_post_process", None)).__name__ != "FixedQParamsObserver" or m.is_per_channel:
        return False
    owner = next((c for c in type(m).__mro__ if "forward" in c.__dict__), None)
    return owner is not None and owner.__name__ == "FakeQuantize"


def stock_fake_quant(m: nn.Module) -> bool:
    """:func:`stock_fused_fake_quant` or :func:`fixed_qparams_fake_quant`.

    Args:
        m: any module.
    """
    return stock_fused_fake_quant(m) or fixed_qparams_fake_quant(m)


def is_traceable(m: nn.Module) -> bool:
    """Whether :func:`make_traceable` gave ``m`` :func:`traceable_forward` or :func:`fixed_qparams_forward`.

    Args:
        m: any module.
    """
    return getattr(m.__dict__.get("forward"), "__func__", None) in (traceable_forward, fixed_qparams_forward)


def traceable_fake_quants(module: nn.Module) -> Iterator[nn.Module]:
    """The fake-quants of ``module`` that :func:`make_traceable` gave :func:`traceable_forward`.

    Args:
        module: the prepared module whose submodules are searched.
    """
    for m in module.modules():
        if is_traceable(m):
            yield m


def make_traceable(module: nn.Module, eligible: Callable[[nn.Module], bool] = stock_fake_quant) -> list[nn.Module]:
    """Give every eligible fake-quant of ``module`` :func:`traceable_forward` (a fixed-qparams one
    :func:`fixed_qparams_forward`); return them.

    Per-channel buffers are sized to their channels first (the fused op does it at its first observation,
    with the same +-inf / 1.0 / 0 fill), so that the traced graph never resizes a buffer. An instance forward
    the engine's eager path had given the fake-quant is kept for :func:`restore_fake_quants`.

    Args:
        module: the prepared module; a per-channel fake-quant's channel count is read from what it quantizes
            (a weight, or a graph node's recorded shape).
        eligible: which fake-quants qualify (default :func:`stock_fake_quant`).
    """
    channels = per_channel_counts(module)
    made = []
    for m in module.modules():
        if is_traceable(m) or not eligible(m):
            continue
        if fixed_qparams_fake_quant(m):
            if "forward" in m.__dict__:
                m.__dict__["_qlightning_eager_forward"] = m.__dict__["forward"]
            m.forward = types.MethodType(fixed_qparams_forward, m)
            m.__dict__["_qlightning_flags"] = _flags(m)
            made.append(m)
            continue
        if m.is_per_channel:
            count = channels.get(id(m), m.activation_post_process.min_val.numel())
            m.__dict__["_qlightning_channels"] = count
            if m.activation_post_process.min_val.numel() == 0:
                _size_per_channel(m, count)
        if "forward" in m.__dict__:
            m.__dict__["_qlightning_eager_forward"] = m.__dict__["forward"]
        m.forward = types.MethodType(traceable_forward, m)
        m.__dict__["_qlightning_flags"] = _flags(m)
        made.append(m)
    return made


def restore_fake_quants(module: nn.Module) -> int:
    """Undo :func:`make_traceable`: each fake-quant's forward is what it was before; return how many.

    Args:
        module: the module (and its submodules) to restore.
    """
    count = 0
    for m in list(traceable_fake_quants(module)):
        del m.forward
        eager = m.__dict__.pop("_qlightning_eager_forward", None)
        if eager is not None:
            m.forward = eager
        for key in ("_qlightning_flags", "_qlightning_flags_key", "_qlightning_channels", "_qlightning_qparams_key"):
            m.__dict__.pop(key, None)
        count += 1
    return count


def _buffers_key(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, int, int]:
    """Identities and versions of two buffers: equal as long as nothing replaced or wrote either."""
    return id(a), a._version, id(b), b._version


def _refresh_flags(fake_quants: list[nn.Module]) -> None:
    """The buffers are the truth (checkpoints, broadcasts, torch.ao's own enable_* write them): copy their
    flags where dynamo guards on them, and re-size per-channel buffers an observer reset emptied.

    Runs before every compiled call, so it reads each flag buffer's value only when the buffer was written or
    replaced since the last read (its version or identity changed): a read is an indexing and an ``item()``,
    ~7 us a fake-quant on this CPU, 0.07-0.15 ms of a 3 ms compiled digits step at batch 1 (notes/perf.md 36).
    """
    for m in fake_quants:
        state, buffers = m.__dict__, m._buffers
        key = _buffers_key(buffers["observer_enabled"], buffers["fake_quant_enabled"])
        if state.get("_qlightning_flags_key") != key:
            state["_qlightning_flags"] = _flags(m)
            state["_qlightning_flags_key"] = key
        observe, fake_quant = state["_qlightning_flags"]
        if state["forward"].__func__ is fixed_qparams_forward:
            continue
        channels = state.get("_qlightning_channels")
        if channels is not None and m.activation_post_process._buffers["min_val"].numel() != channels:
            _size_per_channel(m, channels)
        if fake_quant and not observe:
            sync_qparams(m)


def folded_variance(running_var: torch.Tensor, snapshot: torch.Tensor) -> torch.Tensor:
    """The running variance a conv-bn (or linear-bn) QAT fold scales the weight by: ``running_var`` eagerly;
    compiled, ``snapshot``, the copy :func:`compile_training_forward` takes before each compiled call.

    The fold reads the variance, then the training ``batch_norm`` updates it in place. Eager autograd keeps the
    value the forward read. AOT autograd's partitioned forward saves the ``running_var`` input itself for the
    backward and writes the update into it, so the compiled backward recomputed the fold's scale from the updated
    variance: conv and BatchNorm weight gradients off by 5 % on the digits CNN, 20 % on resnet18 (torch 2.13 and
    2.14, notes/perf.md sections 34-35). A graph input that nothing in the graph writes is saved as it was read.

    Args:
        running_var: the BatchNorm's running variance, which its training ``batch_norm`` updates.
        snapshot: a copy of it taken before the call, which nothing in the graph writes.
    """
    return snapshot if torch.compiler.is_compiling() else running_var


def weight_out_of_fold(folded: torch.Tensor, scale_factor: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``folded / scale_factor``, the conv-bn (or linear-bn) fold's weight ``fq(w * s) / s``, where an output channel
    whose ``s`` is 0 takes the ``weight`` itself.

    ``s = gamma / running_std`` is 0 where the BatchNorm's gamma is exactly 0 (timm ResNets' ``zero_init_last``,
    torchvision's ``zero_init_residual``): the division was ``0 / 0``, NaN from the first step, and any other finite
    divisor would leave that channel's conv output 0, so gamma's gradient (the normalized conv output) 0 for good, a
    residual branch that never starts. A training BatchNorm's output in a channel of gamma 0 is its beta whatever
    the conv computes, so the forward is unchanged; with the weight itself gamma and the weight get the float
    model's gradients, and once gamma has moved the channel folds as the others. Written with a float mask, not
    ``torch.where``: compiled, a bool mask saved for the backward is stored an element at a time by inductor's C++
    (notes/perf.md section 26), and the divisor is 1 where ``s`` is 0, so no NaN reaches a gradient. Where ``s`` is
    not 0 the values are ``folded / s`` bit for bit (``+ 0``, ``* 1``).

    Args:
        folded: ``fq(w * s)``, the fake-quantized folded weight.
        scale_factor: ``s``, shaped to broadcast over the weight's output channels.
        weight: ``w``, the layer's own weight.
    """
    kept = (scale_factor != 0).to(folded.dtype)
    dropped = 1 - kept
    return folded / (scale_factor + dropped) * kept + weight * dropped


def frozen_batch_norm_bias(beta: torch.Tensor, running_mean: torch.Tensor, scale_factor: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """The bias of a conv-bn (or linear-bn) QAT fold whose BatchNorm normalizes with its running statistics
    (frozen, or eval), folded into the layer: ``bn(y / s + b) = y + (b - mean) * s + beta`` for ``y`` the layer's
    output with the weight ``fq(w * s)`` and ``s = gamma / running_std`` (``scale_factor``).

    torch.ao's and torchao's folds compute ``y / s`` and the BatchNorm over the full output, forward and backward
    (``s`` taken back out, ``s / s``); folded, neither runs. The same function up to float rounding, the same
    gradients (``s``'s reaches ``gamma`` through the weight and this bias). Both engines' folds use it.

    Args:
        beta: the BatchNorm's bias, one value per output channel.
        running_mean: its running mean.
        scale_factor: ``gamma / running_std``, 1-D.
        bias: the layer's own bias (1-D), or ``None``.
    """
    shift = beta - running_mean * scale_factor
    return shift if bias is None else shift + bias * scale_factor


def _resolve_snapshots(module: nn.Module, snapshots: Sequence[tuple[str, str]]) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """``(source owner, buffer name, target owner, buffer name)`` for each ``(source, target)`` buffer path of
    ``module``: the owners once, the buffers looked up at each call (``module.to()`` replaces them)."""
    resolved = []
    for source, target in snapshots:
        (source_owner, _, source_name), (target_owner, _, target_name) = source.rpartition("."), target.rpartition(".")
        resolved.append((module.get_submodule(source_owner), source_name, module.get_submodule(target_owner), target_name))
    return resolved


def _take_snapshots(snapshots: list[tuple[nn.Module, str, nn.Module, str]]) -> None:
    """Each target buffer := a fresh copy of its source (:func:`_resolve_snapshots`).

    A new tensor each call rather than a ``copy_``: the previous call's backward may still hold the old one (a
    module called twice before one ``backward``), and autograd refuses a saved tensor written since.
    """
    with torch.no_grad():
        for source_owner, source_name, target_owner, target_name in snapshots:
            target_owner._buffers[target_name] = source_owner._buffers[source_name].detach().clone()


def _batch_dims_dynamic(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Let dim 0 of the tensor inputs vary in the compiled graph from the first compile on.

    Otherwise dynamo specializes the first graph to the batch size and recompiles when an epoch's last, smaller
    batch arrives, in every phase, for as long as the first compile or longer (the observing phase: 42 s, then
    42 s again for the digits CNN; 170 s, then 187 s for the ResNet-18-like net on this CPU; notes/perf.md section
    27). ``maybe_mark_dynamic`` leaves a dimension static where the model needs it to be; a batch under 16 still
    recompiles once, as convolution's shape function guards on ``16 <= batch``.
    """
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            torch._dynamo.maybe_mark_dynamic(value, 0)


# Inductor's generated Python wrapper asserts every graph input's sizes and strides on every call: one
# ``assert_size_stride`` per parameter, buffer, scale, zero point and range, 113 a step for the digits CNN's QAT
# graphs against 53 for float. Dynamo's guards check the same sizes and strides before the call (a buffer
# replaced by one of other strides recompiles), so the asserts only repeat them: ~0.4 us each, ~40 us of a
# 1.5-2 ms step at batch 1 (notes/perf.md section 37).
LEAN_WRAPPER_OPTIONS = {"size_asserts": False}


def with_lean_wrapper(compile_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``compile_kwargs`` with :data:`LEAN_WRAPPER_OPTIONS` under inductor's ``options`` (inductor only, the
    default backend; a ``mode`` excludes ``options`` in ``torch.compile``, so it is left as given; the caller's
    own options win).

    Args:
        compile_kwargs: keyword arguments of ``torch.compile``.
    """
    if compile_kwargs.get("backend", "inductor") != "inductor" or "mode" in compile_kwargs:
        return dict(compile_kwargs)
    return {**compile_kwargs, "options": {**LEAN_WRAPPER_OPTIONS, **(compile_kwargs.get("options") or {})}}


def compile_training_forward(module: nn.Module, fake_quants: list[nn.Module], snapshots: Sequence[tuple[str, str]] = (),
                             **compile_kwargs: Any) -> None:
    """Training forwards of ``module`` run compiled (eval, and forwards without grad, stay eager).

    ``module.forward`` becomes a dispatcher that refreshes the fake-quants' flags from their buffers and calls a
    ``torch.compile`` of the class forward in training mode, its inputs' batch dimension dynamic (one graph a
    phase whatever the batch size). A graph module's class forward is regenerated whenever its graph is
    rewritten (PT2E switches BatchNorm and dropout nodes in place for train/eval and the BatchNorm freeze): one
    compiled function per generated code, so each distinct graph compiles once, however often the modes switch
    back and forth. Before each compiled call, the engine's snapshot buffers get fresh copies of the running
    variances that its conv-bn folds read through :func:`folded_variance`. A deep copy of ``module`` runs
    eagerly: the dispatcher only compiles for the module it was made for. Undone by :func:`uncompile`.

    Args:
        module: the prepared module, its fake-quants already traceable (:func:`make_traceable`).
        fake_quants: those fake-quants (their flags are read before every compiled call).
        snapshots: ``(running variance, snapshot)`` buffer paths in ``module``, the snapshot the one a fold
            reads compiled (:func:`folded_variance`).
        compile_kwargs: keyword arguments of ``torch.compile`` (inductor's size asserts off unless they say
            otherwise: :func:`with_lean_wrapper`).
    """
    owner = id(module)
    compiled: dict[Any, Callable[..., Any]] = {}
    resolved = _resolve_snapshots(module, snapshots)
    compile_kwargs = with_lean_wrapper(compile_kwargs)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if id(self) == owner and self.training and torch.is_grad_enabled():
            _refresh_flags(fake_quants)
            _take_snapshots(resolved)
            _batch_dims_dynamic(args, kwargs)
            code = self.__dict__.get("_code")  # a GraphModule's generated source; None for other modules
            function = compiled.get(code)
            if function is None:
                function = compiled[code] = torch.compile(types.MethodType(type(self).forward, self), **compile_kwargs)
            return function(*args, **kwargs)
        return type(self).forward(self, *args, **kwargs)

    module.__dict__["_qlightning_compiled"] = forward
    module.forward = types.MethodType(forward, module)


def uncompile(module: nn.Module) -> None:
    """Undo :func:`compile_training_forward` on ``module`` and its submodules (the fake-quants stay traceable).

    Args:
        module: the module whose dispatcher is removed.
    """
    for m in module.modules():
        if m.__dict__.pop("_qlightning_compiled", None) is not None:
            m.__dict__.pop("forward", None)
