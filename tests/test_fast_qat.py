"""The FX engine's fast QAT path (qlightning/engines/fast_fq.py) against torch.ao's own modules.

fake-quant and ReLU fusion must be bit-identical to torch.ao (outputs, gradients, observer state,
scales, zero points) over several training steps; the conv-bn forward the same function up to float
rounding; nothing may change what convert_fx, deepcopy or state_dict see.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from qlightning import Inputs, Phase, QuantSpec, get_engine
from qlightning.engines.fx import fast_fq
from qlightning.examples.digits import DigitsCNN, DigitsDataModule


class ResBlockNet(nn.Module):
    """conv-bn-relu, a residual add + nn.ReLU, a shared ReLU module and a maxpool: every fusion case."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
        self.conv = nn.Sequential(nn.Conv2d(32, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32))
        self.relu = nn.ReLU()
        self.shared = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.relu(self.conv(x) + x)
        x = self.pool(self.shared(x))
        return self.head(torch.flatten(self.shared(x), 1))


class HeadsNet(nn.Module):
    """Attention over a digit's 8 rows (tokens of 8 pixels) in 4 heads: matmul's fake-quants see transposed,
    non-contiguous views (the Transformer's layout), and a residual add + nn.ReLU is fused."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 256)
        self.q, self.k, self.v, self.out = (nn.Linear(256, 256) for _ in range(4))
        self.relu = nn.ReLU()
        self.head = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x.reshape(-1, 8, 8))
        q = self.q(t).reshape(-1, 8, 4, 64).transpose(1, 2)
        k = self.k(t).reshape(-1, 8, 4, 64).transpose(1, 2)
        v = self.v(t).reshape(-1, 8, 4, 64).transpose(1, 2)
        attention = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * 0.125, dim=-1)
        context = torch.matmul(attention, v).transpose(1, 2).reshape(-1, 8, 256)
        return self.head(self.relu(self.out(context) + t).mean(1))


def _data(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    dm = DigitsDataModule(seed=0)
    dm.setup()
    x, y = dm.splits["train"].tensors
    return x[:n], y[:n]


def _prepare(net: nn.Module, x: torch.Tensor, **options) -> nn.Module:
    engine = get_engine("fx")
    prepared = engine.prepare(net, Inputs((x[:1],)), QuantSpec(backend="x86", options=options))
    engine.set_phase(prepared, Phase(fake_quant=True, observe=True, bn_frozen=False))
    return prepared


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, phases=()) -> nn.Module:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    engine = get_engine("fx")
    for step in range(steps):
        for at, phase in phases:
            if step == at:
                engine.set_phase(model, phase)
        model.train()
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model


@pytest.mark.parametrize("net_cls", [DigitsCNN, ResBlockNet, HeadsNet])
def test_fast_fake_quant_and_relu_fusion_are_bit_identical(net_cls):
    torch.manual_seed(0)
    x, y = _data()
    net = net_cls()
    ref = _prepare(copy.deepcopy(net), x, fast_qat=False)
    fast = _prepare(copy.deepcopy(net), x, fast_conv_bn=False)
    assert any(fast_fq.is_fast(m) for m in fast.modules())
    assert any(m.__dict__.get("_qlightning_relu") for m in fast.modules()), "no ReLU was fused"
    phases = [(4, Phase(True, False, False)), (6, Phase(True, False, True))]  # observers, then BN frozen
    _train(ref, x, y, 8, phases)
    _train(fast, x, y, 8, phases)
    ref_state, fast_state = ref.state_dict(), fast.state_dict()
    assert list(ref_state) == list(fast_state)
    for key in ref_state:
        assert torch.equal(ref_state[key], fast_state[key]), key
    with torch.no_grad():
        assert torch.equal(ref.eval()(x), fast.eval()(x))


def test_shared_relu_and_observer_are_not_fused():
    torch.manual_seed(0)
    x, _ = _data()
    fast = _prepare(ResBlockNet(), x)
    calls: dict[int, int] = {}
    for node in fast.graph.nodes:
        if node.op == "call_module":
            key = id(fast.get_submodule(node.target))
            calls[key] = calls.get(key, 0) + 1
    for name, m in fast.named_modules():
        if m.__dict__.get("_qlightning_relu"):
            assert calls[id(m)] == 1, name
    shared = fast.get_submodule("shared") if hasattr(fast, "shared") else None
    if shared is not None:
        assert "forward" not in shared.__dict__


def test_fast_conv_bn_matches_up_to_rounding_and_converts_the_same():
    torch.manual_seed(0)
    x, y = _data()
    net = DigitsCNN()
    ref = _prepare(copy.deepcopy(net), x, fast_qat=False)
    fast = _prepare(copy.deepcopy(net), x)
    with torch.no_grad():
        out_ref, out_fast = ref(x), fast(x)
    # "up to rounding": the folded convolutions differ in float rounding (by CPU: oneDNN picks other kernels on
    # AVX2 than on AVX-512), which can move a value across a rounding boundary of the output fake-quant, one step
    step = float(ref.activation_post_process_7.scale)
    off = (out_ref - out_fast).abs()
    assert off.max() <= step * 1.001, (off.max(), step)
    assert (off > 1e-4).float().mean() <= 0.01, "more than 1 % of the outputs off by a quantization step"
    # same state into both: converted int8 models are identical (convert_fx sees torch.ao's classes)
    fast.load_state_dict(ref.state_dict())
    engine, spec = get_engine("fx"), QuantSpec(backend="x86")
    for m in (ref, fast):
        engine.set_phase(m, Phase(True, False, True))
    int8_ref = engine.convert(copy.deepcopy(ref), spec)
    int8_fast = engine.convert(copy.deepcopy(fast), spec)
    assert [type(m).__name__ for m in int8_ref.modules()] == [type(m).__name__ for m in int8_fast.modules()]
    with torch.no_grad():
        assert torch.equal(int8_ref(x), int8_fast(x))


@pytest.mark.parametrize("net_cls", [DigitsCNN, ResBlockNet])
def test_the_float_warm_up_trains_the_float_model_and_observes_as_torch_ao(net_cls):
    """Fake-quant off, observers on (the schedule's warm-up): the fast conv-bn convolves with the weight itself,
    so outputs and gradients are the float net's up to rounding, while the weight observers end where torch.ao's
    own QAT modules leave them (activation ranges: up to rounding)."""
    torch.manual_seed(0)
    x, y = _data()
    net = net_cls()
    warm_up = Phase(fake_quant=False, observe=True, bn_frozen=False)
    ref = _prepare(copy.deepcopy(net), x, fast_qat=False)
    fast = _prepare(copy.deepcopy(net), x)
    outputs, grads = [], []
    for model in (net, ref, fast):
        if model is not net:
            get_engine("fx").set_phase(model, warm_up)
        model.train()
        out = model(x)
        nn.functional.cross_entropy(out, y).backward()
        outputs.append(out.detach())
        grads.append(sorted((p.grad.abs().sum().item() for p in model.parameters() if p.grad is not None), reverse=True))
    for out, grad in zip(outputs[1:], grads[1:]):
        assert torch.allclose(out, outputs[0], rtol=1e-4, atol=1e-5)
        assert grad == pytest.approx(grads[0], rel=1e-4, abs=1e-6)
    observed = {k: v for k, v in fast.state_dict().items() if k.endswith(("min_val", "max_val"))}
    assert observed and all(torch.isfinite(v).all() for v in observed.values())
    reference = ref.state_dict()
    for key, value in observed.items():
        if "weight_fake_quant" in key:  # the folded weight w * s, computed alike
            assert torch.equal(value, reference[key]), key
        else:  # activations: conv outputs differ by rounding (w here, torch.ao divides the output by s)
            assert torch.allclose(value, reference[key], rtol=1e-5, atol=1e-6), key


def test_deepcopy_keeps_the_fast_path_bound_to_the_copy():
    torch.manual_seed(0)
    x, y = _data()
    fast = _prepare(DigitsCNN(), x)
    clone = copy.deepcopy(fast)
    for m in clone.modules():
        bound = m.__dict__.get("forward")
        if bound is not None and hasattr(bound, "__self__"):
            assert bound.__self__ is m
    _train(clone, x, y, 2)
    with torch.no_grad():
        assert not torch.equal(clone(x), fast(x))  # trained the copy, not the original


def test_qparam_cache_follows_state_dict_loads_and_invalidation():
    torch.manual_seed(0)
    x, y = _data()
    fast = _prepare(DigitsCNN(), x)
    _train(fast, x, y, 3)
    engine = get_engine("fx")
    engine.set_phase(fast, Phase(True, False, True))
    fast.eval()
    with torch.no_grad():
        before = fast(x)
    other = _prepare(DigitsCNN(), x)  # same code path, different weights and scales
    _train(other, x, y, 5)
    engine.set_phase(other, Phase(True, False, True))  # (the flags are buffers: they load too)
    fast.load_state_dict(other.state_dict())  # in-place copies: version bumps invalidate the caches
    with torch.no_grad():
        assert torch.equal(fast.eval()(x), other.eval()(x))
        assert not torch.equal(fast(x), before)
    # writes without a version bump (a distributed broadcast): set_phase / set_observers drop the caches
    fq = next(m for m in fast.modules() if fast_fq.is_fast(m) and not m.is_per_channel and "_qlightning_cache" in m.__dict__)
    with torch.no_grad():
        fq.zero_point.data.add_(1)  # .data: no version bump seen by the cache key
    engine.set_observers(fast, False)
    assert "_qlightning_cache" not in fq.__dict__


def test_disabled_by_engine_option():
    x, _ = _data(8)
    plain = _prepare(DigitsCNN(), x, fast_qat=False)
    assert not any(fast_fq.is_fast(m) for m in plain.modules())
    assert not any("_forward_approximate" in m.__dict__ for m in plain.modules())


def test_per_channel_weight_fake_quantized_before_any_observation():
    """torch.ao sizes per-channel min/max to +-inf when it fake-quantizes unobserved; observing must not give NaN."""
    from torch.ao.quantization.qconfig import get_default_qat_qconfig

    torch.manual_seed(0)
    ref = get_default_qat_qconfig("x86").weight()
    fast = copy.deepcopy(ref)
    fast_fq._patch(fast, "forward", fast_fq.fast_fake_quant_forward)
    w = torch.randn(64, 32, 3, 3)
    for m in (ref, fast):
        m.disable_observer()
        m(w)  # fake-quant before any observation
        m.enable_observer()
    for _ in range(3):
        w = w + 0.01 * torch.randn_like(w)
        assert torch.equal(ref(w), fast(w))
    for a, b in zip(ref.state_dict().values(), fast.state_dict().values()):
        assert torch.equal(a, b) and torch.isfinite(a.float()).all()


class MLPTokens(nn.Module):
    """Linear layers over (batch, tokens, features), as in a transformer's FFN; one LinearReLU fusion."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 256)
        self.act = nn.ReLU()
        self.down = nn.Linear(256, 128)
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(self.act(self.up(x))))


def _saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd keeps for backward beyond the model's own parameters (which live anyway)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in parameters:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum()
    return sum(storages.values())


def test_linear_recomputes_its_weight_fake_quant_with_the_same_numbers():
    """Same outputs, gradients and quant state as torch.ao over training (observer freeze included),
    without keeping the fake-quantized weights for backward."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 12, 64), torch.randint(0, 10, (16,))
    engine = get_engine("fx")
    ref = engine.prepare(MLPTokens(), Inputs((x[:1],)), QuantSpec(backend="x86", options={"fast_qat": False}))
    fast = copy.deepcopy(ref)
    fast_fq.swap_fake_quant(fast, fake_quant=True, linear=True)
    assert sum("forward" in m.__dict__ for m in fast.modules() if hasattr(m, "weight_fake_quant")) == 2  # head: small

    def loss(model):
        return nn.functional.cross_entropy(model(x).mean(1), y)

    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, fast)]
    for step in range(4):
        for model, optimizer in zip((ref, fast), optimizers):
            engine.set_phase(model, Phase(fake_quant=True, observe=step < 2, bn_frozen=False))
            model.train()
            optimizer.zero_grad()
            loss(model).backward()
        for (name, a), b in zip(ref.named_parameters(), fast.parameters()):
            assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), name
        for optimizer in optimizers:
            optimizer.step()
    torch.testing.assert_close(fast.state_dict(), ref.state_dict(), rtol=1e-5, atol=1e-6)
    ref.eval(), fast.eval()
    with torch.no_grad():
        torch.testing.assert_close(fast(x), ref(x), rtol=1e-5, atol=1e-5)
    ref.train(), fast.train()
    weights = sum(m.weight.numel() * 4 for m in (fast.up, fast.down))
    assert _saved_bytes(ref, x) - _saved_bytes(fast, x) >= 0.9 * weights

def test_phase_flags_go_through_a_fake_quants_own_setter_when_it_overrides_the_stock_one():
    """The engines write a stock flag setter's buffer directly (fill_); a class that overrides the setter (LSQ turns
    its static estimation with it) has its own method called, and both end with the flag the phase asks for."""
    from torch.ao.quantization.fake_quantize import FusedMovingAvgObsFakeQuantize

    calls = []

    class Counting(FusedMovingAvgObsFakeQuantize):
        def enable_observer(self, enabled: bool = True) -> None:
            calls.append(enabled)
            super().enable_observer(enabled)

    engine = get_engine("fx")
    model = nn.Sequential(FusedMovingAvgObsFakeQuantize(), Counting())
    for observe in (False, True, False):
        engine.set_phase(model, Phase(fake_quant=True, observe=observe, bn_frozen=False))
        assert [int(m.observer_enabled[0]) for m in model] == [int(observe)] * 2
    assert calls == [False, True, False]


@settings(max_examples=300, deadline=None)
@given(
    scale=st.floats(2.0 ** -13, 20.0, allow_nan=False, allow_infinity=False, width=32),
    bounds=st.sampled_from([(0, 127), (0, 255), (-128, 127), (0, 15)]),
    zp_share=st.floats(0.0, 1.0),
    relu=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fake_quant_mask_from_bounds_is_atens_on_every_rounding_edge(scale, bounds, zp_share, relu, seed):
    """The in-range mask from two comparisons of x (``_in_range_bounds``) against aten's own cachemask kernel, on
    random values and on every float next to a rounding edge: (k + 0.5) * scale for each code k, the bounds found,
    their neighbours, and signed zeros and tiny values. Values equal, gradients bit for bit."""
    import numpy as np

    qmin, qmax = bounds
    zp = qmin + int(round(zp_share * (qmax - qmin)))
    lo, hi = qmin - zp, qmax - zp
    s = torch.tensor([scale], dtype=torch.float32)
    edges = [np.float32((k + 0.5) * float(s)) for k in range(lo - 2, hi + 2)]
    found = fast_fq._in_range_bounds(s, lo, hi)
    assert found is not None
    edges += list(found)
    near = []
    for e in edges:
        up, down = np.nextafter(e, np.float32(np.inf)), np.nextafter(e, np.float32(-np.inf))
        near += [e, up, down, np.nextafter(up, np.float32(np.inf)), np.nextafter(down, np.float32(-np.inf))]
    g = torch.Generator().manual_seed(seed)
    x = torch.cat([torch.tensor(np.array(near, dtype=np.float32)),
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-45, -1e-45]),
                   torch.randn(4096, generator=g) * float(s) * (hi - lo) / 3]).requires_grad_()
    ref_x = x.detach().clone().requires_grad_()
    ref = torch.fake_quantize_per_tensor_affine(torch.relu(ref_x) if relu else ref_x, s,
                                                torch.tensor([zp], dtype=torch.int32), qmin, qmax)
    ref.backward(torch.ones_like(ref))
    out = (fast_fq._ReluFakeQuant if relu else fast_fq._FakeQuant).apply(x, s, lo, hi)
    out.backward(torch.ones_like(out))
    # equal values; the float path rounds -0.3 to -0.0 where aten's integer path gives +0.0 (as before this mask)
    assert torch.equal(out.detach(), ref.detach())
    assert torch.equal(x.grad, ref_x.grad)


@pytest.mark.parametrize("relu", [False, True])
def test_fast_fake_quant_gradient_is_atens_bit_for_bit_on_strided_inputs_and_gradients(relu, monkeypatch):
    """The fast fake-quant's backward (numpy's product with the unpacked mask, reused comparison buffers) against
    aten's cachemask kernel: transposed inputs, contiguous and transposed random gradients (with signed zeros; without
    the ReLU compared as bits); a small input after a larger one compares in the reused buffers, and the largest,
    above their cap, in fresh arrays."""
    g = torch.Generator().manual_seed(0)
    scale = torch.tensor([0.05])
    monkeypatch.setattr(fast_fq, "SCRATCH_ELEMENTS", 100_000)  # the largest compares into fresh arrays
    monkeypatch.setattr(fast_fq, "_scratch", threading.local())
    for shape in ((64, 8, 4, 64), (3, 5, 7, 11), (2, 5, 7, 11), (64, 8, 4, 64)):
        base = torch.randn(shape, generator=g) * 4
        x = base.transpose(1, 2).requires_grad_()  # a non-contiguous leaf
        ref_x = base.clone().transpose(1, 2).requires_grad_()
        out = (fast_fq._ReluFakeQuant if relu else fast_fq._FakeQuant).apply(x, scale, -128, 127)
        ref = torch.fake_quantize_per_tensor_affine(torch.relu(ref_x) if relu else ref_x, scale,
                                                    torch.tensor([0], dtype=torch.int32), -128, 127)
        assert torch.equal(out.detach(), ref.detach())
        for grad in (torch.randn(out.shape, generator=g), torch.randn(out.transpose(1, 2).shape, generator=g).transpose(1, 2)):
            grad[..., 0] = -0.0
            (got,) = torch.autograd.grad(out, x, grad, retain_graph=True)
            (want,) = torch.autograd.grad(ref, ref_x, grad, retain_graph=True)
            assert torch.equal(got, want)
            if not relu:  # as bits too; ReLU's own backward writes +0.0 where the product with the mask gives -0.0
                assert torch.equal(got.contiguous().view(torch.int32), want.contiguous().view(torch.int32))


@pytest.mark.parametrize("qscheme", [torch.per_channel_symmetric, torch.per_channel_affine])
def test_per_channel_fast_fake_quant_is_the_fused_ops_with_one_or_many_zero_points(qscheme):
    """Per-channel weights through the fast path (integer clamp bounds when every channel has the same zero point, as
    symmetric weights do; per-channel bound tensors otherwise) against the fused op: values, gradients and state over
    observing steps, then with the observer off."""
    from torch.ao.quantization.fake_quantize import FusedMovingAvgObsFakeQuantize
    from torch.ao.quantization.observer import MovingAveragePerChannelMinMaxObserver

    def make() -> nn.Module:
        return FusedMovingAvgObsFakeQuantize(observer=MovingAveragePerChannelMinMaxObserver, quant_min=-128,
                                             quant_max=127, dtype=torch.qint8, qscheme=qscheme, ch_axis=0)

    ref, fast = make(), make()
    fast_fq._patch(fast, "forward", fast_fq.fast_fake_quant_forward)
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        if step == 3:
            ref.disable_observer(), fast.disable_observer()
        w = torch.randn(256, 128, generator=g) * 0.05 + torch.linspace(-0.02, 0.03, 256)[:, None]
        grad = torch.randn(256, 128, generator=g)
        a, b = w.clone().requires_grad_(), w.clone().requires_grad_()
        out_ref, out_fast = ref(a), fast(b)
        out_ref.backward(grad), out_fast.backward(grad)
        assert torch.equal(out_ref, out_fast) and torch.equal(a.grad, b.grad), step
        distinct = len(set(fast.zero_point.tolist()))
        assert distinct == 1 if qscheme == torch.per_channel_symmetric else distinct > 1
        for key, value in ref.state_dict().items():
            assert torch.equal(value, fast.state_dict()[key]), (step, key)


@pytest.mark.parametrize("phase", ["frozen", "observing", "warm-up"])
def test_a_fake_quant_called_again_on_a_view_of_its_output_trains_as_torch_ao_without_a_full_pass(monkeypatch, phase):
    """torch.ao gives reshape / transpose outputs the same fake-quant module as their inputs (HeadsNet: q, k and v
    each pass one module three times, k's transpose for the scores a fourth, the context twice). Such a repeated call
    works from what the module's last call saw instead of a full fake-quant pass: frozen, it returns its input;
    observing, it observes the last output's (min, max) and moves the codes onto the new grid; in the warm-up, it
    observes the last (min, max) again. Outputs, gradients and state equal torch.ao's, bit for bit, over steps of
    each phase. A copy (reshape of a transposed tensor), a changed output (in place), or a module whose new scale
    moves a code takes the full path."""
    torch.manual_seed(0)
    x, y = _data()
    net = HeadsNet()
    ref = _prepare(copy.deepcopy(net), x, fast_qat=False)
    fast = _prepare(copy.deepcopy(net), x)
    _train(ref, x, y, 2), _train(fast, x, y, 2)
    full = []
    fast_fake_quant = fast_fq._fast_fake_quant
    monkeypatch.setattr(fast_fq, "_fast_fake_quant", lambda fq, X: full.append(fq) or fast_fake_quant(fq, X))
    phases = [(0, {"frozen": Phase(True, False, False), "observing": Phase(True, True, False),
                   "warm-up": Phase(False, True, False)}[phase])]
    plain = copy.deepcopy(fast)  # the same model with every call a full pass, to count the repeats
    own_output = fast_fq._own_output
    monkeypatch.setattr(fast_fq, "_own_output", lambda *args: False)
    _train(plain, x, y, 4, phases)
    monkeypatch.setattr(fast_fq, "_own_output", own_output)
    all_full, full[:] = len(full), []
    _train(ref, x, y, 4, phases), _train(fast, x, y, 4, phases)
    # a step: q, v: reshape, transpose; k: reshape, transpose, transpose for the scores; the context's transpose
    # (its reshape copies the transposed tensor, so that call fake-quantizes); observing, a call whose new scale
    # moves a code takes the full path
    repeats = all_full - len(full)
    assert repeats == 4 * 8 if phase != "observing" else 4 * 6 <= repeats <= 4 * 8, repeats
    for key, value in ref.state_dict().items():
        assert torch.equal(value, fast.state_dict()[key]), key
    with torch.no_grad():
        assert torch.equal(ref.eval()(x), fast.eval()(x))
    with torch.inference_mode():  # Lightning's validation: inference tensors keep no version counter
        assert torch.equal(ref.eval()(x), fast.eval()(x))

    module = fast.get_submodule("activation_post_process_2")  # q's
    assert module.__dict__.get("_qlightning_repeated") is True
    assert "_qlightning_repeated" not in fast.get_submodule("activation_post_process_1").__dict__  # embed's: one site
    module.train()
    full.clear()
    out = module(torch.randn(64, 8, 256))
    module(out.reshape(64, 8, 4, 64).transpose(1, 2))
    assert len(full) == 1
    module(out.transpose(1, 2).reshape(64, 2048))  # a copy: fake-quantized
    assert len(full) == 2
    out = module(torch.randn(64, 8, 256))
    out.mul_(1.5)  # changed in place: fake-quantized again
    module(out.reshape(64, 2048))
    assert len(full) == 4
    module.disable_fake_quant(), module.enable_observer()  # a warm-up call returns its input ...
    t = torch.randn(64, 8, 256) * 3
    assert module(t) is t
    module.enable_fake_quant(), module.disable_observer()  # ... which the next phase must fake-quantize
    assert not torch.equal(module(t.reshape(64, 2048)), t.reshape(64, 2048))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), bits=st.sampled_from([4, 8]), averaging=st.sampled_from([1.0, 0.5, 0.01]),
       spread=st.floats(0.1, 10.0))
def test_a_repeated_observing_call_equals_the_fused_op_when_the_grid_moves_its_codes(seed, bits, averaging, spread):
    """Observing, a repeated call on a view of the module's output moves the running range, and with few levels or a
    large averaging constant the new grid moves codes (the top code rounds past the range). Such calls must take the
    full pass; the rest map codes to themselves. Against torch.ao's module, unpatched: both outputs, the input's
    gradient and the state, bit for bit."""
    from torch.ao.quantization.fake_quantize import FusedMovingAvgObsFakeQuantize
    from torch.ao.quantization.observer import MovingAverageMinMaxObserver

    def make() -> nn.Module:
        return FusedMovingAvgObsFakeQuantize(observer=MovingAverageMinMaxObserver, averaging_constant=averaging,
                                             quant_min=0, quant_max=2 ** bits - 1, dtype=torch.quint8)

    ref, fast = make(), make()
    fast_fq._patch(fast, "forward", fast_fq.fast_fake_quant_forward)
    fast.__dict__["_qlightning_repeated"] = True  # as mark_repeated_fake_quants flags a module called at two sites
    g = torch.Generator().manual_seed(seed)
    for _ in range(3):
        x = (torch.randn(16, 64, 96, generator=g) * spread + spread * (torch.rand(1, generator=g) - 0.3)).requires_grad_()
        grad = torch.randn(16, 96, 64, generator=g)
        outs = []
        for module in (ref, fast):
            first = module(x)
            second = module(first.transpose(1, 2))
            (x_grad,) = torch.autograd.grad((second * grad).sum(), x)
            outs.append((first.detach(), second.detach(), x_grad))
        for a, b in zip(*outs):
            assert torch.equal(a, b)
        for key, value in ref.state_dict().items():
            assert torch.equal(value, fast.state_dict()[key]), key


def test_a_remembered_call_keeps_the_grid_its_output_was_made_with():
    """The repeated call compares the last grid with the new one (``_same_codes``) and recovers codes with the last
    scale; the module rewrites its scale buffer in place when it derives the new one, so the remembered scale must
    be a copy (with the buffer itself, the check compared the new grid with itself)."""
    from torch.ao.quantization.fake_quantize import FusedMovingAvgObsFakeQuantize

    fq = FusedMovingAvgObsFakeQuantize()
    fast_fq._patch(fq, "forward", fast_fq.fast_fake_quant_forward)
    fq.__dict__["_qlightning_repeated"] = True
    out = fq(torch.randn(16, 64, 96) * 2)
    scale = fq.scale.item()
    fq.scale.fill_(scale * 2)
    remembered = fast_fq._LAST_OUTPUT[fq]
    assert remembered.base() is out and remembered.qparams[0].item() == scale


@pytest.mark.parametrize("source", ["torch.ao", "torchao"])
@pytest.mark.parametrize("per_channel", [False, True])
def test_fused_forward_is_the_classes_own_forward_in_every_phase(source, per_channel):
    """``fused_forward`` (the fast path's call on small tensors, and the default weight fake-quant's when not
    observing) reads the module dicts instead of the class forward's eleven ``__getattr__`` calls: outputs,
    gradients and every buffer equal the class's own forward, bit for bit, through each phase in turn, for torch.ao's
    and torchao's fused fake-quant (the FX and PT2E engines')."""
    from qlightning.engines.base import fused_forward

    if source == "torch.ao":
        from torch.ao.quantization import fake_quantize, observer
    else:
        pytest.importorskip("torchao.quantization.pt2e", reason="the pt2e extra")
        from torchao.quantization.pt2e import fake_quantize, observer
    if per_channel:
        ctr = fake_quantize.FusedMovingAvgObsFakeQuantize.with_args(
            observer=observer.MovingAveragePerChannelMinMaxObserver, quant_min=-128, quant_max=127, dtype=torch.qint8,
            qscheme=torch.per_channel_symmetric, ch_axis=0, averaging_constant=0.5)
    else:
        ctr = fake_quantize.FusedMovingAvgObsFakeQuantize.with_args(
            observer=observer.MovingAverageMinMaxObserver, quant_min=0, quant_max=255, dtype=torch.quint8,
            averaging_constant=0.01)
    torch.manual_seed(0)
    ours, theirs = ctr(), ctr()
    for step, (observe, quantize) in enumerate([(1, 1), (1, 1), (0, 1), (1, 0), (0, 0), (1, 1)]):
        for fq in (ours, theirs):
            fq.observer_enabled[0], fq.fake_quant_enabled[0] = observe, quantize
        x = (torch.randn(8, 3, 5, 5) * (step + 1)).requires_grad_()
        x_ref = x.detach().clone().requires_grad_()
        out, out_ref = fused_forward(ours, x), type(theirs).forward(theirs, x_ref)
        grad = torch.randn_like(out)
        out.backward(grad)
        out_ref.backward(grad)
        assert torch.equal(out, out_ref) and torch.equal(x.grad, x_ref.grad), step
        for (key, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
            assert torch.equal(a, b), (step, key)
