"""Models that do not symbolically trace, written the way people write them, and how to quantize them.

The FX graph mode guide lists four routes for a model that FX cannot trace end to end:

* 1.a quantize only the submodules that trace: ``QuantizationAwareTraining(modules=[...])``
  with names and glob patterns (:class:`HybridDigitsNet`: a BERT-style encoder on top of a CNN);
* 1.b skip the submodule that does not trace, it runs in float inside the quantized graph:
  ``prepare_custom_config={"non_traceable_module_names": [...]}`` (:class:`RefineDigitsNet`: a
  refinement loop that stops when the update is small, data-dependent control flow);
* 2.a refactor the code so it traces (:class:`SelfAttention` unpacks a shape into ``view(*shape)``,
  :class:`TraceableSelfAttention` passes the tuple);
* 2.b write an observed and a quantized version of the non-traceable module (a custom module):
  :class:`ElmanRNN` (loops over time) with :class:`ObservedElmanRNN` (``from_float``),
  :class:`StaticQuantElmanRNN` (``from_observed``) for static QAT/PTQ, and
  :class:`DynamicQuantElmanRNN` / :class:`WeightOnlyQuantElmanRNN` for dynamic and weight-only
  quantization (:data:`ELMAN_STATIC`, :data:`ELMAN_DYNAMIC`, :data:`ELMAN_WEIGHT_ONLY` hold the
  callback arguments).

``qlightning doctor qlightning.examples.custom_modules:HybridClassifier`` shows which of these
submodules trace and which route fits each one.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from qlightning.examples.digits import ClassifierModule, conv_bn_relu

# --------------------------------------------------------------------------- 2.b: a custom module


class ElmanRNN(nn.Module):
    """A plain recurrent layer, ``h_t = tanh(W_ih x_t + W_hh h_{t-1})``, over ``(N, T, I)`` inputs.

    Returns every hidden state, ``(N, T, H)``. The loop runs over the sequence length, a value
    FX only knows at run time, so it does not trace; it also holds the Linears worth quantizing.
    """

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__()
        self.input_size, self.hidden_size = input_size, hidden_size
        self.ih = nn.Linear(input_size, hidden_size)
        self.hh = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(x.size(0), self.hidden_size)
        states = []
        for t in range(x.size(1)):
            h = torch.tanh(self.ih(x[:, t]) + self.hh(h))
            states.append(h)
        return torch.stack(states, 1)


# tanh's int8 output has fixed quantization parameters in every torch.ao backend: [-1, 1] in 256 steps
TANH_SCALE, TANH_ZERO_POINT = 2.0 / 256.0, 128


class ObservedElmanRNN(ElmanRNN):
    """:class:`ElmanRNN` with fake-quantized weights and activations (QAT) or observers (PTQ).

    Built by FX prepare from the float module through :meth:`from_float`; the float module's
    ``qconfig`` (set by FX from the qconfig mapping) says how to observe. The Linears become QAT
    Linears sharing the float module's Parameters; the outputs of ``ih``, ``hh`` and their sum get
    the qconfig's activation fake-quant; tanh gets the fixed [-1, 1] one its int8 kernel uses.
    """

    @classmethod
    def from_float(cls, float_module: ElmanRNN) -> "ObservedElmanRNN":
        from torch.ao.nn import qat as nnqat
        from torch.ao.quantization.fake_quantize import FixedQParamsFakeQuantize
        from torch.ao.quantization.observer import FixedQParamsObserver

        qconfig = float_module.qconfig
        observed = cls(float_module.input_size, float_module.hidden_size)
        for name in ("ih", "hh"):
            linear = getattr(float_module, name)
            linear.qconfig = qconfig
            if isinstance(linear, nnqat.Linear):  # prepare_qat_fx already swapped it (QAT module mapping)
                qat_linear = linear
            elif isinstance(qconfig.weight(), torch.ao.quantization.FakeQuantizeBase):
                qat_linear = nnqat.Linear.from_float(linear)  # shares weight and bias
            else:  # PTQ: a plain Linear plus a weight observer, read by from_observed
                qat_linear = linear
            qat_linear.activation_post_process = qconfig.activation()
            setattr(observed, name, qat_linear)
        observed.sum_post_process = qconfig.activation()
        fixed = FixedQParamsObserver.with_args(scale=TANH_SCALE, zero_point=TANH_ZERO_POINT, dtype=torch.quint8,
                                               quant_min=0, quant_max=255)
        is_qat = isinstance(qconfig.activation(), torch.ao.quantization.FakeQuantizeBase)
        observed.tanh_post_process = FixedQParamsFakeQuantize.with_args(observer=fixed)() if is_qat else fixed()
        observed.qconfig = qconfig
        return observed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(x.size(0), self.hidden_size)
        states = []
        for t in range(x.size(1)):
            a = self.ih.activation_post_process(self.ih(x[:, t]))
            b = self.hh.activation_post_process(self.hh(h))
            h = self.tanh_post_process(torch.tanh(self.sum_post_process(a + b)))
            states.append(h)
        return torch.stack(states, 1)


class StaticQuantElmanRNN(nn.Module):
    """int8 :class:`ElmanRNN`: quantized input in, quantized hidden states out (quint8, tanh's fixed qparams).

    ``from_observed`` turns the trained :class:`ObservedElmanRNN` into int8 Linears (packed
    weights, output scales from their fake-quants), an int8 add with the observed scale, and
    int8 tanh.
    """

    def __init__(self, ih: nn.Module, hh: nn.Module, sum_scale: float, sum_zero_point: int, hidden_size: int) -> None:
        super().__init__()
        self.ih, self.hh, self.hidden_size = ih, hh, hidden_size
        self.sum_scale, self.sum_zero_point = float(sum_scale), int(sum_zero_point)

    @classmethod
    def from_observed(cls, observed: ObservedElmanRNN) -> "StaticQuantElmanRNN":
        from torch.ao.nn import quantized as nnq

        ih, hh = (nnq.Linear.from_float(linear) for linear in (observed.ih, observed.hh))
        scale, zero_point = observed.sum_post_process.calculate_qparams()
        return cls(ih, hh, float(scale), int(zero_point), observed.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.quantize_per_tensor(torch.zeros(x.size(0), self.hidden_size), TANH_SCALE, TANH_ZERO_POINT, torch.quint8)
        states = []
        for t in range(x.size(1)):
            total = torch.ops.quantized.add(self.ih(x[:, t].contiguous()), self.hh(h), self.sum_scale, self.sum_zero_point)
            h = torch.tanh(total)
            states.append(h.dequantize())
        return torch.quantize_per_tensor(torch.stack(states, 1), TANH_SCALE, TANH_ZERO_POINT, torch.quint8)


class DynamicQuantElmanRNN(nn.Module):
    """Dynamic int8 :class:`ElmanRNN`: float in and out, int8 weights, activations quantized per call."""

    def __init__(self, ih: nn.Module, hh: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.ih, self.hh, self.hidden_size = ih, hh, hidden_size

    @classmethod
    def from_observed(cls, float_module: ElmanRNN) -> "DynamicQuantElmanRNN":
        # dynamic quantization observes nothing: FX hands over the float module itself
        from torch.ao.nn.quantized import dynamic as nnqd

        linears = []
        for linear in (float_module.ih, float_module.hh):
            linear.qconfig = float_module.qconfig
            linears.append(nnqd.Linear.from_float(linear))
        return cls(*linears, float_module.hidden_size)

    forward = ElmanRNN.forward


class WeightOnlyQuantElmanRNN(nn.Module):
    """Weight-only :class:`ElmanRNN`: int8 per-channel weights stored, dequantized for float compute."""

    def __init__(self, ih: nn.Module, hh: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.ih, self.hh, self.hidden_size = ih, hh, hidden_size

    @classmethod
    def from_observed(cls, float_module: ElmanRNN) -> "WeightOnlyQuantElmanRNN":
        return cls(_WeightOnlyLinear.from_linear(float_module.ih), _WeightOnlyLinear.from_linear(float_module.hh),
                   float_module.hidden_size)

    forward = ElmanRNN.forward


class _WeightOnlyLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        self.register_buffer("qweight", weight)  # a per-channel qint8 tensor
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "_WeightOnlyLinear":
        w = linear.weight.detach()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        qweight = torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
        return cls(qweight, None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.qweight.dequantize(), self.bias)


_HERE = "qlightning.examples.custom_modules"
# QuantizationAwareTraining arguments (plain data) for each kind of quantization of ElmanRNN
ELMAN_STATIC: dict[str, Any] = dict(
    prepare_custom_config={"float_to_observed": {"static": {f"{_HERE}.ElmanRNN": f"{_HERE}.ObservedElmanRNN"}}},
    convert_custom_config={"observed_to_quantized": {"static": {f"{_HERE}.ObservedElmanRNN": f"{_HERE}.StaticQuantElmanRNN"}}},
)
ELMAN_DYNAMIC: dict[str, Any] = dict(
    qconfig_mapping={"global": "default", "object_type": [{"type": f"{_HERE}.ElmanRNN", "qconfig": "dynamic"}]},
    prepare_custom_config={"non_traceable_module_classes": [f"{_HERE}.ElmanRNN"]},
    convert_custom_config={"observed_to_quantized": {"dynamic": {f"{_HERE}.ElmanRNN": f"{_HERE}.DynamicQuantElmanRNN"}}},
)
ELMAN_WEIGHT_ONLY: dict[str, Any] = dict(
    # torch.ao's own `weight_only` preset has an nn.Identity activation, which FX's custom-module convert
    # cannot read (`activation_dtype` -> AttributeError); a float placeholder observer says the same thing.
    qconfig_mapping={"global": "default", "object_type": [{"type": f"{_HERE}.ElmanRNN", "qconfig": {
        "activation": {"fake_quant": None, "observer": "placeholder", "dtype": "float32"},
        "weight": {"fake_quant": None, "observer": "per_channel_minmax", "dtype": "qint8", "qscheme": "per_channel_symmetric"},
    }}]},
    prepare_custom_config={"non_traceable_module_classes": [f"{_HERE}.ElmanRNN"]},
    convert_custom_config={"observed_to_quantized": {"weight_only": {f"{_HERE}.ElmanRNN": f"{_HERE}.WeightOnlyQuantElmanRNN"}}},
)


class RowRNN(nn.Module):
    """Digits as 8 rows of 8 pixels: a Linear embedding, an :class:`ElmanRNN`, a Linear head on the last state."""

    def __init__(self, hidden_size: int = 48, num_classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Linear(8, hidden_size)
        self.rnn = ElmanRNN(hidden_size, hidden_size)
        self.head = nn.Linear(hidden_size, num_classes)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        states = self.rnn(torch.relu(self.embed(rows)))
        return self.head(states[:, -1])


class RowRNNClassifier(ClassifierModule):
    """:class:`RowRNN` as ``self.net`` on ``DigitsDataModule(as_sequence=True)``."""

    def __init__(self, hidden_size: int = 48, lr: float = 1e-2) -> None:
        super().__init__(RowRNN(hidden_size), lr=lr)
        self.save_hyperparameters()
        self.example_input_array = torch.zeros(1, 8, 8)


# --------------------------------------------------------------------------- 1.b: data-dependent control flow


class IterativeRefine(nn.Module):
    """Refines a feature map with a residual 3x3 conv until the update is small (at most ``max_steps``).

    How many steps run depends on the values: ``if update.abs().amax() < tol: break``. FX cannot
    trace that; the module runs in float while everything around it is int8 (route 1.b).
    """

    def __init__(self, channels: int, max_steps: int = 3, tol: float = 1e-3) -> None:
        super().__init__()
        self.step = nn.Conv2d(channels, channels, 3, padding=1)
        self.max_steps, self.tol = max_steps, tol

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.max_steps):
            update = 0.5 * torch.tanh(self.step(x))
            x = x + update
            if update.abs().amax() < self.tol:
                break
        return x


class RefineNet(nn.Module):
    """Conv-BN-ReLU stem, :class:`IterativeRefine`, two more blocks, pooling and a Linear head."""

    def __init__(self, channels: tuple[int, int, int] = (16, 32, 32), num_classes: int = 10) -> None:
        super().__init__()
        c1, c2, c3 = channels
        self.stem = conv_bn_relu(1, c1)
        self.refine = IterativeRefine(c1)
        self.features = nn.Sequential(conv_bn_relu(c1, c2), nn.MaxPool2d(2), conv_bn_relu(c2, c3), nn.AdaptiveAvgPool2d(1))
        self.classifier = nn.Linear(c3, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.refine(self.stem(x))
        return self.classifier(torch.flatten(self.features(x), 1))


class RefineDigitsNet(ClassifierModule):
    """:class:`RefineNet` as ``self.net``; quantize ``net`` with ``refine`` marked non-traceable."""

    def __init__(self, channels: tuple[int, int, int] = (16, 32, 32), lr: float = 1e-2, weight_decay: float = 0.0) -> None:
        super().__init__(RefineNet(tuple(channels)), lr=lr, weight_decay=weight_decay)
        self.save_hyperparameters()
        self.example_input_array = torch.zeros(1, 1, 8, 8)


# --------------------------------------------------------------------------- 1.a and 2.a: a hybrid CNN + encoder


class SelfAttention(nn.Module):
    """Multi-head self-attention written like BERT's: ``split_heads`` unpacks the shape into ``view``.

    ``x.view(*new_shape)`` does not trace (FX cannot iterate over a traced shape); the Linears
    ``query``/``key``/``value`` trace on their own.
    """

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.query, self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        new_shape = x.size()[:-1] + (self.heads, self.head_dim)
        x = x.view(*new_shape)
        return x.permute(0, 2, 1, 3)

    def merge_heads(self, context: torch.Tensor) -> torch.Tensor:
        context = context.permute(0, 2, 1, 3).contiguous()
        return context.view(context.size()[:-2] + (self.heads * self.head_dim,))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = (self.split_heads(layer(hidden)) for layer in (self.query, self.key, self.value))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        return self.merge_heads(torch.softmax(scores, dim=-1) @ v)


class TraceableSelfAttention(SelfAttention):
    """:class:`SelfAttention` refactored to trace and quantize (route 2.a).

    The guide's fix, ``x.view(new_shape)`` with ``new_shape = x.size()[:-1] + (h, d)``, traces, but
    the shape arithmetic becomes an ``operator.add`` node that torch.ao's default qconfig mapping
    treats as a tensor add and fake-quantizes (``TypeError: ... must be Tensor, not torch.Size``
    in the first training step). Building the shape from single sizes avoids both problems.
    """

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens = x.size(0), x.size(1)
        return x.view(batch, tokens, self.heads, self.head_dim).permute(0, 2, 1, 3)

    def merge_heads(self, context: torch.Tensor) -> torch.Tensor:
        batch, tokens = context.size(0), context.size(2)
        return context.permute(0, 2, 1, 3).reshape(batch, tokens, self.heads * self.head_dim)


class AttentionOutput(nn.Module):
    """Dense + residual + LayerNorm; takes two tensors (the attention context and the block input)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dense, self.norm = nn.Linear(dim, dim), nn.LayerNorm(dim)

    def forward(self, context: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.norm(self.dense(context) + residual)


class Intermediate(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.dense, self.act = nn.Linear(dim, hidden), nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class Attention(nn.Module):
    """``self`` (the heads) and ``output`` (dense + residual), like BERT's ``BertAttention``."""

    def __init__(self, dim: int, heads: int, attention_cls: type = SelfAttention) -> None:
        super().__init__()
        self.self = attention_cls(dim, heads)
        self.output = AttentionOutput(dim)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(hidden), residual=hidden)


class EncoderLayer(nn.Module):
    """attention -> intermediate -> output; the output blocks take two tensors, the residual by keyword."""

    def __init__(self, dim: int, heads: int, hidden: int, attention_cls: type = SelfAttention) -> None:
        super().__init__()
        self.attention = Attention(dim, heads, attention_cls)
        self.intermediate = Intermediate(dim, hidden)
        self.output = AttentionOutput(dim) if hidden == dim else FeedForwardOutput(hidden, dim)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        attended = self.attention(hidden)
        return self.output(self.intermediate(attended), residual=attended)


class FeedForwardOutput(nn.Module):
    def __init__(self, hidden: int, dim: int) -> None:
        super().__init__()
        self.dense, self.norm = nn.Linear(hidden, dim), nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.norm(self.dense(x) + residual)


class Encoder(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, layers: int, attention_cls: type = SelfAttention) -> None:
        super().__init__()
        self.layer = nn.ModuleList(EncoderLayer(dim, heads, hidden, attention_cls) for _ in range(layers))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            hidden = layer(hidden)
        return hidden


class Backbone(nn.Module):
    """Three Conv-BN-ReLU stages; images larger than 8x8 are resized first (a shape-dependent branch)."""

    def __init__(self, channels: tuple[int, int, int] = (8, 16, 32)) -> None:
        super().__init__()
        c1, c2, c3 = channels
        self.layer1 = conv_bn_relu(1, c1)
        self.layer2 = nn.Sequential(conv_bn_relu(c1, c2), nn.MaxPool2d(2))
        self.layer3 = conv_bn_relu(c2, c3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != 8:
            x = nn.functional.interpolate(x, size=(8, 8), mode="bilinear", align_corners=False)
        return self.layer3(self.layer2(self.layer1(x)))


class HybridNet(nn.Module):
    """CNN backbone -> 16 tokens -> a BERT-style encoder -> mean pooling -> Linear head.

    Accepts ``(N, 8, 8)`` or ``(N, 1, 8, 8)``: the rank check is control flow on a traced value.
    """

    def __init__(self, dim: int = 32, heads: int = 2, hidden: int = 64, layers: int = 2,
                 attention_cls: type = SelfAttention, num_classes: int = 10) -> None:
        super().__init__()
        self.backbone = Backbone((8, 16, dim))
        self.encoder = Encoder(dim, heads, hidden, layers, attention_cls)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3:
            x = x.unsqueeze(1)
        tokens = self.backbone(x).flatten(2).transpose(1, 2)
        return self.head(self.encoder(tokens).mean(1))


class HybridClassifier(ClassifierModule):
    """:class:`HybridNet` as ``self.net`` (``traceable_attention=True`` uses the refactored attention)."""

    def __init__(self, traceable_attention: bool = False, lr: float = 5e-3) -> None:
        super().__init__(HybridNet(attention_cls=TraceableSelfAttention if traceable_attention else SelfAttention), lr=lr)
        self.save_hyperparameters()
        self.example_input_array = torch.zeros(1, 1, 8, 8)


# --------------------------------------------------------------------------- trace breakers, one per kind


class LengthNormalize(nn.Module):
    """Divides by the batch size with ``len(x)`` (tensor-valued ``len()``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / len(x)


class RowLoop(nn.Module):
    """Iterates over a tensor's rows (tensor iteration)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.proj(row) for row in x])


class KeywordOnly(nn.Module):
    """``forward(x, *, scale=None)``: a keyword-only argument whose ``None`` check FX fixes at trace time."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, *, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        y = self.proj(x)
        if scale is not None:
            y = y * scale
        return y
