"""Equalization before quantization: cross-layer (data-free), input-weight (FX), and selective.

Three tools, all function-preserving in float:

* :func:`cross_layer_equalization` (Nagel et al. 2019, "Data-Free Quantization Through Weight
  Equalization and Bias Correction"): for consecutive layers ``L1 -> [BN] -> ReLU-like -> L2``
  (Conv-Conv, Conv-Linear through pooling/flatten, Linear-Linear) output channel ``i`` of ``L1``
  is divided by ``s_i`` and the matching input channel of ``L2`` multiplied by ``s_i``, with
  ``s_i = sqrt(r1_i / r2_i)`` (``r`` = the channel's weight range), so both ranges become
  ``sqrt(r1_i * r2_i)``. ReLU (and LeakyReLU, PReLU, max/avg pooling, dropout) is positively
  homogeneous, so the float function does not change. A BatchNorm right after ``L1`` is not
  folded: its ``weight`` and ``bias`` are divided by ``s_i`` instead (exact in train and eval
  mode), and ``r1`` is the range of the BN-folded weight, which is what FX quantizes (PTQ folds
  BN, QAT's fused ConvBn scales by ``gamma / running_std``). So it works as a pre-pass before
  PTQ and before QAT alike. Pairs are found by tracing the float module with ``torch.fx``.
* :func:`input_weight_equalization_mapping`: the ``_equalization_config`` of torch.ao FX PTQ
  (``default_equalization_qconfig``, calibrated from activations), with the layer closure torch
  needs (see the function).
* Selective equalization: :func:`selective_cross_layer_equalization` keeps a pair's rescaling only
  where the per-layer weight SQNR improves (data-free); :func:`select_input_weight_equalization`
  keeps input-weight equalization only for layers whose output SQNR after PTQ improves on
  calibration data.

Example::

    from qlightning.quantize.equalization import cross_layer_equalization, weight_sqnr

    result = cross_layer_equalization(model.net)          # in place; model.net computes the same
    print(result.pairs, result.iterations)
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from qlightning.core.inputs import Inputs
from qlightning.core.metrics import sqnr_db as _sqnr_db
from qlightning.core.metrics import summed_sqnr_db
from qlightning.engines.fx import ao as fx_ao
from qlightning.quantize.calibration import calibrate_and_convert
from qlightning.errors import ConfigError, TraceError

LAYER_TYPES: tuple[type, ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)
# positively homogeneous per channel: f(x / s) = f(x) / s for s > 0, channel by channel
_PASS_MODULES: tuple[type, ...] = (
    nn.ReLU, nn.LeakyReLU, nn.PReLU, nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
)
_PASS_FUNCTIONS = {
    F.relu, torch.relu, F.leaky_relu, F.prelu, F.dropout, F.max_pool1d, F.max_pool2d, F.max_pool3d,
    F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.adaptive_avg_pool1d, F.adaptive_avg_pool2d,
    F.adaptive_avg_pool3d, F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d,
}
_PASS_METHODS = {"relu", "relu_"}
_RELU_LIKE = (nn.ReLU, nn.LeakyReLU, nn.PReLU)


# ---------------------------------------------------------------------- graph analysis


@dataclass(frozen=True)
class EqualizationPair:
    """``first`` -> [``bn``] -> positively homogeneous ops -> ``second``, names relative to the module.

    ``features_per_channel`` > 1 when ``second`` is a Linear after a flatten of ``first``'s
    channels (each channel of ``first`` feeds that many consecutive input features).
    """

    first: str
    second: str
    bn: Optional[str] = None
    features_per_channel: int = 1

    def __str__(self) -> str:
        return f"{self.first}{' -> ' + self.bn if self.bn else ''} -> {self.second}"


def _trace(module: nn.Module) -> torch.fx.GraphModule:
    try:
        return torch.fx.symbolic_trace(module)
    except Exception as exc:  # noqa: BLE001 - any tracing failure means the same thing here
        raise TraceError(
            f"equalization: torch.fx could not trace {type(module).__name__} to find consecutive layers "
            f"({type(exc).__name__}: {exc}); pass pairs=[EqualizationPair(first, second, bn), ...] explicitly"
        ) from exc


def _flatten_start(node: torch.fx.Node, modules: Mapping[str, nn.Module]) -> Optional[int]:
    """start_dim of a flatten node (module, function or method), else None."""
    if node.op == "call_module" and isinstance(modules[str(node.target)], nn.Flatten):
        m = modules[str(node.target)]
        return m.start_dim if m.end_dim == -1 else None
    if (node.op == "call_function" and node.target is torch.flatten) or (node.op == "call_method" and node.target == "flatten"):
        start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
        end = node.args[2] if len(node.args) > 2 else node.kwargs.get("end_dim", -1)
        return start if end == -1 and isinstance(start, int) else None
    return None


def _passes(node: torch.fx.Node, modules: Mapping[str, nn.Module]) -> bool:
    if node.op == "call_module":
        return isinstance(modules[str(node.target)], _PASS_MODULES)
    if node.op == "call_function":
        return node.target in _PASS_FUNCTIONS
    if node.op == "call_method":
        return node.target in _PASS_METHODS
    return False


def _is_layer(node: torch.fx.Node, modules: Mapping[str, nn.Module]) -> bool:
    return node.op == "call_module" and type(modules[str(node.target)]) in LAYER_TYPES


def _call_counts(gm: torch.fx.GraphModule) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            counts[str(node.target)] = counts.get(str(node.target), 0) + 1
    return counts


def find_pairs(module: nn.Module) -> list[EqualizationPair]:
    """Every ``L1 -> [BN] -> homogeneous ops -> L2`` chain of ``module`` that can be equalized.

    Each intermediate result must have exactly one user (a residual branch would see the scaled
    tensor), every module must be called once, a BatchNorm must directly follow ``L1`` and be
    affine, and the channel counts must match (Conv -> Linear needs a ``flatten(x, 1)`` with
    ``in_features`` a multiple of the channels).

    Args:
        module: the float model, traced with FX (not modified).

    Returns:
        The pairs, in graph order of their first layer.
    """
    gm = _trace(module)
    modules = dict(gm.named_modules())
    counts = _call_counts(gm)
    pairs: list[EqualizationPair] = []
    for node in gm.graph.nodes:
        if not _is_layer(node, modules) or counts[str(node.target)] != 1:
            continue
        first = modules[str(node.target)]
        channels = first.out_features if isinstance(first, nn.Linear) else first.out_channels
        cur, bn, flattened = node, None, isinstance(first, nn.Linear)
        while len(cur.users) == 1:
            nxt = next(iter(cur.users))
            if nxt.op == "call_module" and counts.get(str(nxt.target), 0) != 1:
                break
            if (
                cur is node and bn is None and nxt.op == "call_module"
                and isinstance(modules[str(nxt.target)], nn.modules.batchnorm._BatchNorm)
            ):
                m = modules[str(nxt.target)]
                if not m.affine or m.num_features != channels:
                    break
                bn, cur = str(nxt.target), nxt
                continue
            if _is_layer(nxt, modules):
                second = modules[str(nxt.target)]
                if nxt.args[0] is not cur:
                    break
                per = _features_per_channel(first, second, channels, flattened)
                if per:
                    pairs.append(EqualizationPair(str(node.target), str(nxt.target), bn, per))
                break
            start = _flatten_start(nxt, modules)
            if start is not None:
                if start != 1:
                    break
                flattened, cur = True, nxt
                continue
            if _passes(nxt, modules) and (not flattened or isinstance(first, nn.Linear) or not _is_pool(nxt, modules)):
                cur = nxt
                continue
            break
    return pairs


def _is_pool(node: torch.fx.Node, modules: Mapping[str, nn.Module]) -> bool:
    target = modules.get(str(node.target)) if node.op == "call_module" else node.target
    name = type(target).__name__ if node.op == "call_module" else getattr(target, "__name__", "")
    return "pool" in name.lower()


def _features_per_channel(first: nn.Module, second: nn.Module, channels: int, flattened: bool) -> int:
    if isinstance(second, nn.Linear):
        if isinstance(first, nn.Linear):
            return 1 if second.in_features == channels else 0
        if flattened and second.in_features % channels == 0:
            return second.in_features // channels
        return 0
    if isinstance(first, nn.Linear) or type(first) is not type(second) or flattened:
        return 0
    return 1 if second.in_channels == channels else 0


def _bn_followers(module: nn.Module) -> dict[str, str]:
    """layer name -> the affine BatchNorm that consumes its output alone (what FX folds into it)."""
    gm = _trace(module)
    modules = dict(gm.named_modules())
    out = {}
    for node in gm.graph.nodes:
        if _is_layer(node, modules) and len(node.users) == 1:
            user = next(iter(node.users))
            if user.op == "call_module" and isinstance(modules[str(user.target)], nn.modules.batchnorm._BatchNorm):
                out[str(node.target)] = str(user.target)
    return out


# ---------------------------------------------------------------------- ranges and scaling


def _bn_factor(bn: nn.Module) -> torch.Tensor:
    return bn.weight.detach() / torch.sqrt(bn.running_var.detach() + bn.eps)


def effective_weight(layer: nn.Module, bn: Optional[nn.Module] = None) -> torch.Tensor:
    """The weight FX quantizes: ``layer.weight`` with a following BatchNorm folded in.

    Args:
        layer: the Conv/Linear layer.
        bn: the BatchNorm that follows it; ``None`` returns the detached weight as is.
    """
    w = layer.weight.detach()
    if bn is None:
        return w
    return w * _bn_factor(bn).reshape(-1, *([1] * (w.dim() - 1)))


def _output_ranges(layer: nn.Module, bn: Optional[nn.Module]) -> torch.Tensor:
    w = effective_weight(layer, bn)
    return w.reshape(w.shape[0], -1).abs().amax(dim=1)


def _input_view(layer: nn.Module, channels: int, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Weights of ``layer`` (or ``weight`` of its shape) grouped by the input channel they read: (channels, -1)."""
    w = layer.weight.detach() if weight is None else weight
    if isinstance(layer, nn.Linear):
        per = w.shape[1] // channels
        return w.reshape(w.shape[0], channels, per).permute(1, 0, 2).reshape(channels, -1)
    groups, in_g = layer.groups, w.shape[1]
    return w.reshape(groups, w.shape[0] // groups, in_g, -1).permute(0, 2, 1, 3).reshape(groups * in_g, -1)


def _input_factor(layer: nn.Module, s: torch.Tensor) -> torch.Tensor:
    """``s`` (one factor per input channel) broadcast to ``layer.weight``'s shape."""
    w = layer.weight
    if isinstance(layer, nn.Linear):
        return s.repeat_interleave(w.shape[1] // s.numel()).reshape(1, -1)
    groups, in_g = layer.groups, w.shape[1]
    out_g = w.shape[0] // groups
    full = s.reshape(groups, 1, in_g).expand(groups, out_g, in_g).reshape(w.shape[0], in_g)
    return full.reshape(*full.shape, *([1] * (w.dim() - 2)))


@torch.no_grad()
def _rescale(root: nn.Module, pair: EqualizationPair, s: torch.Tensor) -> None:
    """Divide output channel i of ``pair.first`` (through its BN if any) by s_i, multiply input channel i of ``pair.second``."""
    first, second = root.get_submodule(pair.first), root.get_submodule(pair.second)
    s = s.to(first.weight.dtype)
    if pair.bn is not None:
        bn = root.get_submodule(pair.bn)
        bn.weight.div_(s.to(bn.weight.device))
        bn.bias.div_(s.to(bn.bias.device))
    else:
        first.weight.div_(s.to(first.weight.device).reshape(-1, *([1] * (first.weight.dim() - 1))))
        if first.bias is not None:
            first.bias.div_(s.to(first.bias.device))
    second.weight.mul_(_input_factor(second, s.to(second.weight.device)))


def _pair_scale(root: nn.Module, pair: EqualizationPair, second_bn: Optional[str] = None) -> torch.Tensor:
    """s_i = sqrt(r1_i / r2_i) on the weights FX quantizes (each layer with its following BN folded)."""
    first, second = root.get_submodule(pair.first), root.get_submodule(pair.second)
    bn = root.get_submodule(pair.bn) if pair.bn else None
    r1 = _output_ranges(first, bn).double()
    w2 = effective_weight(second, root.get_submodule(second_bn) if second_bn else None)
    r2 = _input_view(second, r1.numel(), w2).abs().amax(dim=1).to(r1.device).double()
    s = torch.ones_like(r1)
    ok = (r1 > 0) & (r2 > 0)
    s[ok] = torch.sqrt(r1[ok] / r2[ok])
    return s.float()


@dataclass
class EqualizationResult:
    """What :func:`cross_layer_equalization` did: the pairs, their cumulative scales, and (selective) the decisions."""

    pairs: list[EqualizationPair]
    scales: dict[str, torch.Tensor] = field(default_factory=dict)
    iterations: int = 0
    kept: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    sqnr_before: dict[str, float] = field(default_factory=dict)
    sqnr_after: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """Plain-JSON summary: pairs as strings, iterations, kept/rejected pairs, SQNR before/after (2 decimals)."""
        return {
            "pairs": [str(p) for p in self.pairs],
            "iterations": self.iterations,
            "kept": list(self.kept),
            "rejected": list(self.rejected),
            "sqnr_db_before": {k: round(v, 2) for k, v in self.sqnr_before.items()},
            "sqnr_db_after": {k: round(v, 2) for k, v in self.sqnr_after.items()},
        }


def cross_layer_equalization(
    module: nn.Module,
    pairs: Optional[Sequence[EqualizationPair]] = None,
    max_iter: int = 50,
    tol: float = 1e-4,
) -> EqualizationResult:
    """Data-free cross-layer equalization of ``module`` in place (the float function is unchanged).

    Pairs sharing a layer are swept repeatedly until no scale moves by more than ``tol``
    (relative) or ``max_iter`` sweeps. Parameters are changed in place, so an optimizer or a
    prepared QAT graph that holds them sees the new values.

    Args:
        module: the float model, changed in place.
        pairs: the pairs to equalize; ``None`` uses :func:`find_pairs`.
        max_iter: the most sweeps over the pairs.
        tol: stop when no scale's ``|log s|`` in a sweep exceeds this.

    Returns:
        :class:`EqualizationResult`: the pairs and the cumulative scale of each (``str(pair)``).
    """
    pairs = list(find_pairs(module) if pairs is None else pairs)
    result = EqualizationResult(pairs=pairs)
    try:
        bns = _bn_followers(module)
    except TraceError:  # explicit pairs on a module FX cannot trace: second layers taken without BN
        bns = {}
    for pair in pairs:
        result.scales[str(pair)] = torch.ones(_output_ranges(module.get_submodule(pair.first), None).numel())
    for it in range(1, max_iter + 1):
        moved = 0.0
        for pair in pairs:
            s = _pair_scale(module, pair, bns.get(pair.second))
            _rescale(module, pair, s)
            result.scales[str(pair)] = result.scales[str(pair)] * s.cpu()
            moved = max(moved, float((s.log().abs()).max()) if s.numel() else 0.0)
        result.iterations = it
        if moved < tol:
            break
    result.kept = [str(p) for p in pairs]
    return result


# ---------------------------------------------------------------------- SQNR


def sqnr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """:func:`qlightning.core.metrics.sqnr_db`, with +inf (not the report's 200 dB cap) for equal tensors.

    Args:
        reference: the tensor taken as the signal.
        approximation: its approximation (e.g. the fake-quantized weight).
    """
    value = _sqnr_db(reference, approximation)
    return math.inf if value >= 200.0 else value


def default_weight_observer() -> Any:
    """8-bit per-tensor symmetric (torch.ao's ``default_weight_observer``): where range imbalance hurts."""
    return fx_ao.default_weight_observer()


def fake_quantize_weight(weight: torch.Tensor, weight_observer: Any) -> torch.Tensor:
    """``weight`` quantized and dequantized with the qparams a fresh ``weight_observer()`` computes.

    Args:
        weight: the float weight.
        weight_observer: a torch.ao observer factory (called once, then run on ``weight``); per-channel
            qschemes fake-quantize per channel along its ``ch_axis``.
    """
    with fx_ao.quiet_torch_ao():
        obs = weight_observer()
        obs(weight)
        scale, zero_point = obs.calculate_qparams()
    qmin, qmax = int(obs.quant_min), int(obs.quant_max)
    if obs.qscheme in (torch.per_channel_symmetric, torch.per_channel_affine):
        return torch.fake_quantize_per_channel_affine(
            weight, scale.float(), zero_point.to(torch.int32), int(obs.ch_axis), qmin, qmax
        )
    return torch.fake_quantize_per_tensor_affine(weight, float(scale), int(zero_point), qmin, qmax)


def weight_sqnr(
    module: nn.Module,
    weight_observer: Any = None,
    layers: Optional[Iterable[str]] = None,
) -> dict[str, float]:
    """Per-layer SQNR (dB) of weight quantization: the BN-folded weight of every Conv/Linear
    (or of ``layers``) against itself quantized with ``weight_observer`` (default: 8-bit per tensor).

    Args:
        module: the float model (traced with FX to find the BatchNorms that follow layers).
        weight_observer: a torch.ao observer factory; ``None`` uses :func:`default_weight_observer`.
        layers: names of the layers to measure; ``None`` measures every Conv/Linear.

    Returns:
        ``{layer name: SQNR in dB}`` (+inf where quantization is exact).
    """
    weight_observer = weight_observer or default_weight_observer()
    bns = _bn_followers(module)
    names = list(layers) if layers is not None else [n for n, m in module.named_modules() if type(m) in LAYER_TYPES]
    out = {}
    for name in names:
        layer = module.get_submodule(name)
        bn = module.get_submodule(bns[name]) if name in bns else None
        w = effective_weight(layer, bn).float()
        out[name] = sqnr_db(w, fake_quantize_weight(w, weight_observer))
    return out


def _mean(values: Iterable[float]) -> float:
    values = [min(v, 200.0) for v in values]
    return sum(values) / max(1, len(values))


def selective_cross_layer_equalization(
    module: nn.Module,
    weight_observer: Any = None,
    pairs: Optional[Sequence[EqualizationPair]] = None,
    min_gain_db: float = 0.0,
    max_iter: int = 50,
) -> EqualizationResult:
    """Cross-layer equalization kept only for the pairs whose per-layer weight SQNR improves.

    The scales are those of a full :func:`cross_layer_equalization` (computed on a copy); then,
    pair by pair in graph order, the pair's scaling is applied to ``module`` and kept if the mean
    SQNR (dB) of its two layers under ``weight_observer`` rises by more than ``min_gain_db``,
    else undone. Data-free; every kept rescaling preserves the float function.

    Args:
        module: the float model, changed in place for the kept pairs.
        weight_observer: a torch.ao observer factory for the SQNR; ``None`` uses :func:`default_weight_observer`.
        pairs: the candidate pairs; ``None`` uses :func:`find_pairs`.
        min_gain_db: how many dB a pair's mean SQNR must rise by to be kept.
        max_iter: the most sweeps of the full equalization the scales come from.

    Returns:
        :class:`EqualizationResult` with ``kept``/``rejected`` pairs and SQNR before/after per layer.
    """
    weight_observer = weight_observer or default_weight_observer()
    pairs = list(find_pairs(module) if pairs is None else pairs)
    trial = copy.deepcopy(module)
    full = cross_layer_equalization(trial, pairs, max_iter=max_iter)
    del trial
    result = EqualizationResult(pairs=pairs, iterations=full.iterations)
    all_layers = sorted({n for p in pairs for n in (p.first, p.second)})
    result.sqnr_before = weight_sqnr(module, weight_observer, all_layers)
    for pair in pairs:
        layers = [pair.first, pair.second]
        before = weight_sqnr(module, weight_observer, layers)
        touched = [pair.first, pair.second] + ([pair.bn] if pair.bn else [])
        saved = {n: {k: v.detach().clone() for k, v in module.get_submodule(n).named_parameters(recurse=False)} for n in touched}
        s = full.scales[str(pair)]
        _rescale(module, pair, s)
        after = weight_sqnr(module, weight_observer, layers)
        if _mean(after.values()) > _mean(before.values()) + min_gain_db:
            result.kept.append(str(pair))
            result.scales[str(pair)] = s
        else:
            with torch.no_grad():
                for n, params in saved.items():
                    for k, v in params.items():
                        getattr(module.get_submodule(n), k).copy_(v)
            result.rejected.append(str(pair))
    result.sqnr_after = weight_sqnr(module, weight_observer, all_layers)
    return result


# ---------------------------------------------------------------------- input-weight equalization (FX)


def _equalizable_layers(module: nn.Module) -> tuple[list[str], dict[str, set[str]], set[str]]:
    """Layers FX can equalize, the layers each one needs equalized with it, and layers it cannot.

    torch.ao folds a layer's input-equalization scale into the previous layer's weight when the
    previous op is a Conv/Linear (or a node whose name contains ``relu``), and does so only if
    that previous layer is equalized too: equalizing ``conv2`` of ``conv1 -> relu -> conv2``
    alone silently changes the function (measured: output SQNR 41.5 dB -> 9.3 dB on the digits
    CNN). So each layer carries its chain of directly preceding layers, and a layer whose input
    is a ReLU of something that is not a layer cannot be equalized at all.
    """
    gm = _trace(module)
    modules = dict(gm.named_modules())
    layers = [str(n.target) for n in gm.graph.nodes if _is_layer(n, modules)]
    needs: dict[str, set[str]] = {}
    blocked: set[str] = set()
    for node in gm.graph.nodes:
        if not _is_layer(node, modules):
            continue
        name = str(node.target)
        prev, passed_relu = node.args[0] if node.args else None, False
        while isinstance(prev, torch.fx.Node):
            is_bn = prev.op == "call_module" and isinstance(modules[str(prev.target)], nn.modules.batchnorm._BatchNorm)
            is_relu = "relu" in prev.name or (prev.op == "call_module" and isinstance(modules[str(prev.target)], _RELU_LIKE))
            if is_bn or is_relu:
                passed_relu = passed_relu or is_relu
                prev = prev.args[0] if prev.args else None
                continue
            break
        if isinstance(prev, torch.fx.Node) and _is_layer(prev, modules):
            needs[name] = needs.get(str(prev.target), set()) | {str(prev.target)}
        elif passed_relu or (isinstance(prev, torch.fx.Node) and "relu" in prev.name):
            blocked.add(name)
    return [n for n in layers if n not in blocked], needs, blocked


def input_weight_equalization_mapping(module: nn.Module, layers: Optional[Iterable[str]] = None) -> Any:
    """``QConfigMapping`` of ``default_equalization_qconfig`` for FX PTQ's ``_equalization_config``.

    ``layers`` (names relative to ``module``; default: every Conv/Linear FX can equalize) are
    closed under the chain rule described in :func:`_equalizable_layers`; layers that cannot be
    equalized without changing the function raise :class:`ConfigError`.

    Args:
        module: the float model (traced with FX, not modified).
        layers: the layers to equalize; ``None`` for every layer FX can equalize.
    """
    allowed, needs, blocked = _equalizable_layers(module)
    wanted = list(allowed if layers is None else layers)
    errors = []
    known = set(allowed) | blocked
    for name in wanted:
        if name in blocked:
            errors.append(f"equalization: layer {name!r} follows a ReLU of a non-layer op; torch.ao cannot equalize it")
        elif name not in known:
            errors.append(f"equalization: {name!r} is not a Conv/Linear of {type(module).__name__}; equalizable: {allowed}")
    if errors:
        raise ConfigError(errors)
    closed: set[str] = set()
    for name in wanted:
        closed |= {name} | needs.get(name, set())
    return fx_ao.equalization_qconfig_mapping([name for name in allowed if name in closed])


def equalized_layers(mapping: Any) -> list[str]:
    """Layer names an equalization ``QConfigMapping`` covers (module_name entries).

    Args:
        mapping: a ``QConfigMapping``; entries whose qconfig is ``None`` are left out.

    Returns:
        The names, sorted.
    """
    return sorted(k for k, v in getattr(mapping, "module_name_qconfigs", {}).items() if v is not None)


@torch.no_grad()
def layer_output_sqnr(
    reference: nn.Module, quantized: nn.Module, inputs: Iterable[Inputs], layers: Iterable[str]
) -> dict[str, float]:
    """Per-layer output SQNR (dB) of ``quantized`` against ``reference`` on ``inputs``.

    Both modules are run on the same inputs; the outputs of the submodules named ``layers``
    (quantized tensors dequantized) are compared. Use a BN/ReLU-fused float reference
    (:func:`fused_reference`) so names and outputs match FX's converted module.

    Args:
        reference: the float reference module.
        quantized: the quantized module to measure.
        inputs: the inputs both are run on; signal and noise are summed over all of them.
        layers: names of submodules (present in both) whose outputs are compared.

    Returns:
        ``{layer: SQNR in dB}`` for the layers with a non-zero reference output.
    """
    layers = list(layers)
    pairs: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {n: [] for n in layers}
    for inp in inputs:
        outs: dict[str, dict[str, torch.Tensor]] = {"ref": {}, "q": {}}
        handles = []
        for key, root in (("ref", reference), ("q", quantized)):
            named = dict(root.named_modules())
            for n in layers:
                if n not in named:
                    continue

                def hook(mod: nn.Module, args: Any, out: Any, n: str = n, key: str = key) -> None:
                    t = out[0] if isinstance(out, (tuple, list)) else out
                    outs[key][n] = (t.dequantize() if t.is_quantized else t).detach().double()

                handles.append(named[n].register_forward_hook(hook))
        try:
            reference(*inp.args, **inp.kwargs)
            quantized(*inp.args, **inp.kwargs)
        finally:
            for h in handles:
                h.remove()
        for n in layers:
            if n in outs["ref"] and n in outs["q"]:
                pairs[n].append((outs["ref"][n], outs["q"][n]))
    return {n: summed_sqnr_db(pairs[n]) for n in layers if any(bool(r.any()) for r, _ in pairs[n])}


def fused_reference(module: nn.Module) -> nn.Module:
    """A float copy of ``module`` fused like FX PTQ fuses it (Conv-BN-ReLU -> ConvReLU, BN folded).

    Args:
        module: the float model (deep-copied and put in eval mode; not modified).
    """
    return fx_ao.fuse(copy.deepcopy(module).eval())


def select_input_weight_equalization(
    float_module: nn.Module,
    inputs: Sequence[Inputs],
    spec: Any,
    layers: Optional[Iterable[str]] = None,
    engine: Any = "fx",
    min_gain_db: float = 0.0,
) -> tuple[Any, dict[str, Any]]:
    """Input-weight equalization only where it raises the layer's output SQNR after PTQ.

    For each candidate layer (with the preceding layers torch needs equalized alongside it), PTQ
    is run with just that group equalized and the SQNR of the layer's output is compared with
    PTQ without equalization, on ``inputs`` (the calibration inputs of ``float_module``). The
    groups that improve by more than ``min_gain_db`` are combined; if the combination does not
    beat plain PTQ at the module output, nothing is equalized.

    Returns ``(mapping or None, details)``; ``details`` holds every SQNR measured.

    Args:
        float_module: the float model (copied by each PTQ run, not modified).
        inputs: the calibration inputs (the first is the example input), also used to measure SQNR.
        spec: the quantization spec PTQ runs with.
        layers: candidate layers; ``None`` for every layer FX can equalize (others are ignored).
        engine: the engine's name or an instance, for :func:`~qlightning.quantize.calibration.calibrate_and_convert`.
        min_gain_db: how many dB a layer's output SQNR must rise by for its group to be kept.
    """
    inputs = list(inputs)
    allowed, needs, _ = _equalizable_layers(float_module)
    candidates = [n for n in (allowed if layers is None else layers) if n in allowed]
    reference = fused_reference(float_module)

    def ptq(mapping: Any) -> nn.Module:
        return calibrate_and_convert(float_module, inputs, spec, engine=engine, equalization_config=mapping)

    def output_sqnr(q: nn.Module) -> float:
        with torch.no_grad():
            outputs = [(reference(*inp.args, **inp.kwargs), q(*inp.args, **inp.kwargs)) for inp in inputs]
        return summed_sqnr_db((r, o) for r, o in outputs if isinstance(r, torch.Tensor) and isinstance(o, torch.Tensor))

    plain = ptq(None)
    base = layer_output_sqnr(reference, plain, inputs, candidates)
    details: dict[str, Any] = {"sqnr_db_without": base, "sqnr_db_with": {}, "kept": [], "rejected": []}
    kept: set[str] = set()
    for name in candidates:
        group = {name} | needs.get(name, set())
        trial = ptq(input_weight_equalization_mapping(float_module, group))
        with_eq = layer_output_sqnr(reference, trial, inputs, [name]).get(name, -math.inf)
        details["sqnr_db_with"][name] = with_eq
        if with_eq > base.get(name, -math.inf) + min_gain_db:
            kept |= group
            details["kept"].append(name)
        else:
            details["rejected"].append(name)
    if not kept:
        return None, details
    mapping = input_weight_equalization_mapping(float_module, sorted(kept))
    details["output_sqnr_db_without"] = output_sqnr(plain)
    details["output_sqnr_db_with"] = output_sqnr(ptq(mapping))
    if details["output_sqnr_db_with"] <= details["output_sqnr_db_without"]:
        details["kept"], details["rejected"] = [], candidates
        return None, details
    return mapping, details


__all__ = [
    "EqualizationPair",
    "EqualizationResult",
    "LAYER_TYPES",
    "cross_layer_equalization",
    "default_weight_observer",
    "effective_weight",
    "equalized_layers",
    "fake_quantize_weight",
    "find_pairs",
    "fused_reference",
    "input_weight_equalization_mapping",
    "layer_output_sqnr",
    "select_input_weight_equalization",
    "selective_cross_layer_equalization",
    "sqnr_db",
    "weight_sqnr",
]
