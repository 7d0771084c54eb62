"""What you train is what you deploy: the int8 model as it runs, checked against the fake-quant model.

The fake-quant model is what training optimised and validation measured; the int8 model (as lowered,
the runtime that really executes) is what ships. :func:`check_fidelity` runs both on held batches and
compares their outputs (SQNR over every output tensor, top-1 agreement of the first one when it has a
class dimension); where both are graphs it also finds the first and the worst layers that depart.
A crash of the int8 forward is a breach naming the module and the failing op. The callbacks gate on
it at fit end; ``qlightning train`` reports it.
"""

from __future__ import annotations

import traceback
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from qlightning.core.inputs import Inputs, flat_tensors, source_of
from qlightning.core.metrics import MAX_SQNR_DB, ratio_db, summed_sqnr_db, top1_agreement
from qlightning.errors import FidelityError

ON_BREACH = ("fail", "warn", "fallback")


@dataclass
class FidelityConfig:
    """Thresholds of the fit-end fidelity gate and what to do on a breach; checks itself.

    Attributes:
        enabled: run the gate at fit end.
        min_sqnr_db: SQNR of the int8 outputs against the fake-quant outputs, in dB.
        min_top1_agreement: share of rows whose argmax agrees (outputs with a class dimension).
        on_breach: ``"fail"`` (raise :class:`~qlightning.errors.FidelityError`), ``"warn"`` (keep the
            int8 model, warn loudly, record it) or ``"fallback"`` (put the fake-quant module back in
            the model in place of the int8 one, warn, record it).
        batches: how many held batches to compare on (validation loader first).
    """

    enabled: bool = True
    min_sqnr_db: float = 20.0
    min_top1_agreement: float = 0.98
    on_breach: str = "fail"
    batches: int = 4

    def problems(self, prefix: str = "fidelity") -> list[str]:
        """Every invalid field, as messages naming the key, the value and the valid choices.

        Args:
            prefix: the config key the messages name the fields under (``<prefix>.<field>=...``).

        Returns:
            One message per invalid field; empty when the config is valid.
        """
        out = []
        if not isinstance(self.enabled, bool):
            out.append(f"{prefix}.enabled={self.enabled!r}: true or false")
        if not isinstance(self.min_sqnr_db, (int, float)) or isinstance(self.min_sqnr_db, bool):
            out.append(f"{prefix}.min_sqnr_db={self.min_sqnr_db!r}: a number of dB, e.g. 20")
        if (not isinstance(self.min_top1_agreement, (int, float)) or isinstance(self.min_top1_agreement, bool)
                or not 0.0 <= float(self.min_top1_agreement) <= 1.0):
            out.append(f"{prefix}.min_top1_agreement={self.min_top1_agreement!r}: a share between 0 and 1, e.g. 0.98")
        if self.on_breach not in ON_BREACH:
            out.append(f"{prefix}.on_breach={self.on_breach!r}: valid choices: {list(ON_BREACH)}")
        if not isinstance(self.batches, int) or isinstance(self.batches, bool) or self.batches < 1:
            out.append(f"{prefix}.batches={self.batches!r}: a positive number of batches")
        return out

    @classmethod
    def from_value(cls, value: Any, errors: list[str], prefix: str = "fidelity",
                   defaults: Optional["FidelityConfig"] = None) -> "FidelityConfig":
        """A config from ``None``/``True`` (``defaults``), ``False`` (off), a mapping (over ``defaults``;
        a ``None`` value keeps the default) or an instance.

        Args:
            value: the ``fidelity`` setting as given (``None``, a bool, a mapping or a ``FidelityConfig``).
            errors: list that messages for unknown keys, a wrong type or invalid fields are appended to.
            prefix: the config key, for messages.
            defaults: the config ``None``/``True`` and a mapping start from; ``FidelityConfig()`` if not given.

        Returns:
            The config; ``defaults`` (or ``FidelityConfig()``) when ``value`` has unknown keys or a wrong type.
        """
        base = defaults if defaults is not None else cls()
        if isinstance(value, cls):
            config = value
        elif value is None or value is True:
            config = base
        elif value is False:
            config = replace(base, enabled=False)
        elif hasattr(value, "items"):
            unknown = sorted(set(value) - set(cls.__dataclass_fields__))
            if unknown:
                errors.append(f"{prefix}: unknown key(s) {unknown}; valid: {sorted(cls.__dataclass_fields__)}")
                return base
            config = replace(base, **{k: v for k, v in dict(value).items() if v is not None})
        else:
            errors.append(f"{prefix}={value!r}: true, false, or a mapping of {sorted(cls.__dataclass_fields__)}")
            return base
        errors.extend(config.problems(prefix))
        return config


#: PTQ compares int8 with float, not with a fake-quant model that trained: the quantization noise itself is
#: measured, so the SQNR bar is lower (digits, 8-bit: 34 dB FX, 38 dB PT2E; 4-bit weights 10.9 dB and CLE +
#: selective equalization 12.4 dB, both at top-1 agreement >= 0.996)
PTQ_FIDELITY = FidelityConfig(min_sqnr_db=10.0)


@dataclass
class ModuleFidelity:
    """The fit-end comparison of one quantized submodule."""

    module: str
    sqnr_db: Optional[float] = None
    top1_agreement: Optional[float] = None
    samples: int = 0
    inputs: str = ""
    error: Optional[str] = None
    first_departing_layer: Optional[str] = None
    worst_layers: list[list[Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    action: str = "kept int8"
    against: str = "fake-quant"
    noise_floor: Optional[dict[str, Any]] = None
    within_noise_floor: bool = False

    def judge_noise_floor(self, min_sqnr_db: float) -> None:
        """Set :attr:`within_noise_floor`: the only breach is top-1 agreement, input noise of one part in 10^5 flips
        at least as many of the reference's own rows (:func:`reference_noise_floor`) while leaving its outputs above
        the SQNR bar (noise that wrecks the outputs says nothing about ties): near-ties, not a departing layer.

        Args:
            min_sqnr_db: the gate's SQNR threshold.
        """
        floor = self.noise_floor or {}
        self.within_noise_floor = bool(
            self.error is None and self.top1_agreement is not None and floor.get("top1_agreement") is not None
            and self.problems and all(p.startswith("top-1") for p in self.problems)
            and floor["sqnr_db"] >= min_sqnr_db and self.top1_agreement >= floor["top1_agreement"])

    @property
    def passed(self) -> bool:
        """Whether the comparison found no problem (no breach, no crash)."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """All fields as a plain dict, plus ``passed``, for report.json."""
        data = asdict(self)
        data["passed"] = self.passed
        return data

    def describe(self) -> str:
        """One line: the module, the figures (or the error), and on a breach its problems and departing layers."""
        head = f"{self.module}: int8 vs {self.against}"
        if self.error:
            return f"{head}: {self.error}"
        figures = f"SQNR {self.sqnr_db:.1f} dB" if self.sqnr_db is not None else "SQNR n/a"
        if self.top1_agreement is not None:
            figures += f", top-1 agreement {self.top1_agreement:.3f}"
        text = f"{head}: {figures} on {self.samples} samples ({self.inputs})"
        if self.problems:
            text += "; breach: " + "; ".join(self.problems)
            if self.first_departing_layer:
                text += f"; first departing layer: {self.first_departing_layer}"
            if self.worst_layers:
                text += "; worst layers: " + ", ".join(f"{n} {v:.1f} dB" for n, v in self.worst_layers)
            floor = self.noise_floor
            if floor:
                agreement = "" if floor.get("top1_agreement") is None else f", top-1 agreement {floor['top1_agreement']:.3f}"
                text += (f"; for scale, the {self.against} model against itself on inputs perturbed by "
                         f"{floor['relative_noise']:g} (relative): SQNR {floor['sqnr_db']:.1f} dB{agreement}")
                if self.within_noise_floor:
                    text += (" - int8 flips no more predictions than that: they sit on near-ties of the "
                             f"{self.against} model, which no layer kept in float changes; a longer fit widens "
                             "the margins")
        return text


# ---------------------------------------------------------------------------------------------- per layer


def _is_quant_module(module: Any) -> bool:
    return hasattr(module, "fake_quant_enabled") or hasattr(module, "calculate_qparams")


def _is_quant_step(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    if node.op == "call_module":
        return _is_quant_module(gm.get_submodule(node.target))
    if node.op == "call_method":
        return node.target == "dequantize"
    if node.op == "call_function":
        if node.meta.get("qlightning_activation_clamp") or node.meta.get("qlightning_requantize"):
            return True  # the FX engine's clamp to the trained range, its requantization of a pool or dropout
        name = getattr(node.target, "__name__", "") or str(node.target)
        return (
            node.target in (torch.quantize_per_tensor, torch.quantize_per_channel, torch.dequantize)
            or "quantized_decomposed" in str(node.target)
            or name in ("quantize_per_tensor", "dequantize")
        )
    return False


def _is_integer_quantize(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a ``quantized_decomposed`` quantize (its value: integer codes, not a quantized tensor)."""
    return node.op == "call_function" and "quantized_decomposed.quantize_per" in str(node.target)


def layer_nodes(gm: torch.fx.GraphModule) -> dict[str, str]:
    """``{layer (call_module target): node whose value is the layer's (re)quantized output}``.

    In a graph without module calls (PT2E's exported graphs) a layer is a module path of ``nn_module_stack``, its
    output the last op traced inside it, and only layers whose output is (fake-)quantized count.

    Args:
        gm: the graph; quantize/dequantize/fake-quant/observer steps are not layers, and a layer's output
            node is the end of the single-user chain of such steps after it.
    """
    outputs: dict[str, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.users and not _is_quant_step(gm, node):  # (export's _guards_fn: unused)
            outputs[str(node.target)] = node
    exported = not outputs
    if exported:  # an exported (aten) graph: a layer is the last op traced inside a module (nn_module_stack)
        for node in gm.graph.nodes:
            path = _module_path(node) if node.op == "call_function" else ""
            if path and not _is_quant_step(gm, node):
                outputs[path] = node
    layers = {}
    for name, node in outputs.items():
        end = node
        while end.users:
            users = list(end.users)
            if len(users) > 1 and not (_is_integer_quantize(end) and all(_is_quant_step(gm, u) for u in users)):
                break
            # a decomposed quantize holds integer codes: its dequantizes (one per consumer, PT2E's convert) are the value
            user = users[0]
            if not _is_quant_step(gm, user):
                break
            end = user
        # in exported graphs only the (fake-)quantized points mean the same in both versions: a QAT conv's own
        # output is before its BatchNorm, the folded int8 conv's after it
        if not (exported and end is node):
            layers[name] = end.name
    return layers


def _module_path(node: torch.fx.Node) -> str:
    """The innermost module ``node`` was traced in (``torch.export``'s ``nn_module_stack``), or ``""``."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path if isinstance(path, str) else ""


class _Recorder(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, keep: set[str]) -> None:
        super().__init__(gm)
        self.keep = keep
        self.values: dict[str, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if n.name in self.keep and isinstance(out, torch.Tensor):
            # a copy: a later in-place op (torchvision's ReLU(inplace=True)) would rewrite the kept value
            value = out.dequantize() if out.is_quantized else out
            self.values[n.name] = value.detach().to(torch.float32, copy=True)
        return out


def record(gm: torch.fx.GraphModule, args: tuple[Any, ...], keep: set[str]) -> dict[str, torch.Tensor]:
    """The values of the nodes named in ``keep`` on one call of ``gm`` (dequantized, float).

    Args:
        gm: the graph to run (under ``torch.inference_mode``).
        args: positional inputs of the call.
        keep: names of the nodes whose tensor values to keep.

    Returns:
        ``{node name: detached float tensor}`` for the kept nodes that produced a tensor.
    """
    recorder = _Recorder(gm, keep)
    with torch.inference_mode():
        recorder.run(*args)
    return recorder.values


def per_layer_sqnr(
    prefix: str,
    versions: dict[str, Optional[nn.Module]],
    batches: Sequence[tuple[Any, ...]],
    pairs: Sequence[tuple[str, str, str]] = (
        ("fake_quant_vs_float_sqnr_db", "fake_quant", "float"),
        ("int8_vs_float_sqnr_db", "int8", "float"),
        ("conversion_sqnr_db", "int8", "reference"),
    ),
) -> list[dict[str, Any]]:
    """SQNR of every layer's output for each ``(column, candidate, reference)`` of graph-mode versions.

    Returns one row per layer in graph order: ``{"layer": "<prefix>.<module path>", column: dB, ...}``.
    Layers are the ``call_module`` nodes of the int8 graph that the other versions have too; columns
    whose versions are not GraphModules are left out.

    Args:
        prefix: prepended to each layer name (``<prefix>.<layer>``); empty keeps the bare module path.
        versions: ``{version name: module}``, e.g. ``float``, ``fake_quant``, ``reference``, ``int8``; ``None``
            or non-GraphModule entries are skipped, and without an ``int8`` graph the result is empty.
        batches: positional inputs of each call; signal and noise are summed over all of them.
        pairs: ``(column, candidate version, reference version)`` of each SQNR column.
    """
    graphs = {k: v for k, v in versions.items() if isinstance(v, torch.fx.GraphModule)}
    if "int8" not in graphs:
        return []
    nodes = {k: layer_nodes(g) for k, g in graphs.items()}
    order = list(nodes["int8"])
    sums: dict[tuple[str, str], list[float]] = {}
    for args in batches:
        values = {k: record(g, args, set(nodes[k].values())) for k, g in graphs.items()}
        for column, cand, ref in pairs:
            if cand not in graphs or ref not in graphs:
                continue
            for layer in order:
                a = values[cand].get(nodes[cand].get(layer, ""))
                b = values[ref].get(nodes[ref].get(layer, ""))
                if a is None or b is None or a.shape != b.shape:
                    continue
                acc = sums.setdefault((layer, column), [0.0, 0.0])
                acc[0] += float(b.double().pow(2).sum())
                acc[1] += float((a.double() - b.double()).pow(2).sum())
    table: list[dict[str, Any]] = []
    for layer in order:
        row = {column: round(ratio_db(*sums[(layer, column)]), 3) for column, _, _ in pairs if (layer, column) in sums}
        if row:
            table.append({"layer": f"{prefix}.{layer}" if prefix else layer, **row})
    return table


def worst_layers(layers: Sequence[dict[str, Any]], column: str = "int8_vs_float_sqnr_db", count: int = 5) -> list[str]:
    """The ``count`` layers with the lowest SQNR in ``column``.

    Args:
        layers: rows of :func:`per_layer_sqnr`; rows without ``column`` are skipped.
        column: the SQNR column to rank by.
        count: how many layer names to return at most.

    Returns:
        Layer names, lowest SQNR first.
    """
    rows = [(row[column], row["layer"]) for row in layers if row.get(column) is not None]
    return [name for _, name in sorted(rows)[:count]]


# ---------------------------------------------------------------------------------------------- the check


def _failing_op(exc: BaseException) -> str:
    """The innermost frame of a forward that raised, as ``file:line in function`` (the op that failed)."""
    frames = traceback.extract_tb(exc.__traceback__)
    # the innermost frame of the model's own code (an FX GraphModule's generated forward names the op)
    inner = [f for f in frames if "/torch/" not in f.filename and "qlightning/core" not in f.filename] or frames
    if not inner:
        return ""
    f = inner[-1]
    line = f" `{f.line.strip()}`" if f.line else ""
    return f" at {f.filename.rsplit('/', 1)[-1]}:{f.lineno} in {f.name}{line}"


def _outputs(module: nn.Module, batches: Sequence[Inputs]) -> list[list[torch.Tensor]]:
    out = []
    with torch.inference_mode():
        for b in batches:
            out.append([t.detach().float().cpu() for t in flat_tensors(module(*b.args, **b.kwargs))])
    return out


def _figures(ref: Sequence[list[torch.Tensor]], cand: Sequence[list[torch.Tensor]]) -> tuple[float, Optional[float]]:
    """SQNR over every output of every batch, and top-1 agreement of the first output (``None`` without a class
    dimension), rounded as the gate reports them."""
    if any(len(r_list) != len(c_list) for r_list, c_list in zip(ref, cand)):
        sqnr = -MAX_SQNR_DB
    else:
        sqnr = round(summed_sqnr_db(pair for r_list, c_list in zip(ref, cand) for pair in zip(r_list, c_list)), 2)
    firsts_r = [r[0] for r in ref if r]
    firsts_c = [c[0] for c in cand if c]
    top1 = None
    if firsts_r and firsts_c and all(a.dim() >= 2 for a in firsts_r + firsts_c):
        try:
            top1 = top1_agreement(torch.cat(firsts_r), torch.cat(firsts_c))
        except RuntimeError:
            top1 = None
    return sqnr, None if top1 is None else round(top1, 4)


#: The relative input noise of :func:`reference_noise_floor`: far below any input's own precision (8-bit images
#: step by 4e-3), at the size of float32 rounding accumulated through a layer (about 1e-6 to 1e-5)
NOISE_FLOOR_RELATIVE = 1e-5


def _perturbed(batch: Inputs, relative: float, generator: torch.Generator) -> Optional[Inputs]:
    """``batch`` with every floating-point tensor multiplied by ``1 + relative * N(0, 1)``; ``None`` if it has none.

    Integer-valued tensors are left alone (masks: an attention mask of 0/1 floats becomes an additive mask of
    ``(1 - m) * min_float``, where noise on the ones would swamp every score)."""
    touched = False

    def perturb(value: Any) -> Any:
        nonlocal touched
        if (isinstance(value, torch.Tensor) and value.is_floating_point() and not value.is_quantized
                and not bool(torch.all(value == value.round()))):
            touched = True
            noise = torch.randn(value.shape, generator=generator, dtype=torch.float32)
            return value * (1 + relative * noise).to(device=value.device, dtype=value.dtype)
        return value

    args, kwargs = torch.utils._pytree.tree_map(perturb, (tuple(batch.args), dict(batch.kwargs)))
    return Inputs(tuple(args), kwargs) if touched else None


def reference_noise_floor(reference: nn.Module, batches: Sequence[Inputs], reference_outputs: Sequence[list[torch.Tensor]],
                          relative: float = NOISE_FLOOR_RELATIVE) -> Optional[dict[str, Any]]:
    """How far the reference moves from itself when its floating-point inputs are perturbed by ``relative`` noise.

    A breach on top-1 agreement alone can be near-tied predictions that any arithmetic flips: the fake-quant
    model's own float32 rounding does (efficientnet_b0 FX at the zoo's 48 steps: 31 of 128 rows with exactly
    tied quantized top-2 logits; recomputing it without oneDNN's convolutions flips 1-3 of 128 rows). This
    puts a figure on that, so the gate's message can say whether int8 departs more than such noise does.
    The noise comes from its own generator (the run's random state is untouched).

    Args:
        reference: the fake-quant module (eval, observers off).
        batches: the held inputs the gate compared on.
        reference_outputs: the reference's outputs on ``batches`` (:func:`_outputs`).
        relative: the noise's standard deviation relative to each input value.

    Returns:
        ``{"relative_noise", "sqnr_db", "top1_agreement"}``, or ``None`` when no input is floating point
        (token ids cannot be perturbed) or the perturbed forward fails.
    """
    generator = torch.Generator().manual_seed(0)
    perturbed = [_perturbed(b, relative, generator) for b in batches]
    kept = [(p, ref) for p, ref in zip(perturbed, reference_outputs) if p is not None]
    if not kept:
        return None
    try:
        moved = _outputs(reference, [p for p, _ in kept])
    except Exception:  # a reference that cannot take the noise (e.g. an input used as an index): no floor
        return None
    sqnr, top1 = _figures([ref for _, ref in kept], moved)
    return {"relative_noise": relative, "sqnr_db": sqnr, "top1_agreement": top1}


def compare_modules(
    name: str,
    reference: nn.Module,
    candidate: nn.Module,
    batches: Sequence[Inputs],
    min_sqnr_db: float,
    min_top1: float,
    inputs: str = "",
    against: str = "fake-quant",
) -> ModuleFidelity:
    """Compare ``candidate`` (int8, as executed) with ``reference`` (fake-quant) on ``batches``.

    Args:
        name: the submodule's name, for messages.
        reference: the fake-quant module (eval, observers off).
        candidate: the module that ships (the lowered runtime, or the engine's int8 module).
        batches: held inputs of the submodule.
        min_sqnr_db: the SQNR breach threshold.
        min_top1: the top-1 agreement breach threshold.
        inputs: where the batches came from, in words.
        against: what the reference is, in words (PTQ compares with the float module).
    """
    result = ModuleFidelity(module=name, inputs=inputs, against=against)
    ref = _outputs(reference, batches)
    try:
        cand = _outputs(candidate, batches)
    except Exception as exc:  # a crash is a breach, not a later surprise
        result.error = f"the int8 forward fails: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}{_failing_op(exc)}"
        result.problems.append(result.error)
        return result
    result.sqnr_db, result.top1_agreement = _figures(ref, cand)
    result.samples = sum(int(r[0].shape[0]) if r and r[0].dim() > 0 else 1 for r in ref)
    if result.sqnr_db < min_sqnr_db:
        result.problems.append(f"SQNR {result.sqnr_db:.1f} dB < {min_sqnr_db:g} dB")
    if result.top1_agreement is not None and result.top1_agreement < min_top1:
        result.problems.append(f"top-1 agreement {result.top1_agreement:.3f} < {min_top1:g}")
    if result.problems:
        _name_layers(result, reference, candidate, batches, min_sqnr_db)
        result.noise_floor = reference_noise_floor(reference, batches, ref)
        result.judge_noise_floor(min_sqnr_db)
    return result


def apply_on_breach(result: ModuleFidelity, config: FidelityConfig, fall_back: Callable[[], None], reference: str) -> bool:
    """``config.on_breach`` for one compared module: ``fall_back()`` puts ``reference`` back; True if it breached.

    Args:
        result: the module's comparison; its ``action`` is set on a breach.
        config: the gate; ``on_breach="fallback"`` calls ``fall_back``, ``"warn"`` and ``"fail"`` keep int8.
        fall_back: puts the reference module back in place of the int8 one.
        reference: what is put back, in words (for ``result.action``).

    Returns:
        ``True`` if the module breached, ``False`` if it passed.
    """
    if result.passed:
        return False
    if config.on_breach == "fallback":
        fall_back()
        result.action = f"fell back to the {reference} module"
    elif config.on_breach == "warn":
        result.action = "kept int8 (on_breach=warn)"
    return True


def breach_message(who: str, reference: str, breaches: Sequence[ModuleFidelity], config: FidelityConfig,
                   fallback: str) -> str:
    """The one message of a failed gate: every breach, a mapping entry that keeps the first departing
    layer (else the worst) float; with ``on_breach="fail"`` raised as :class:`~qlightning.errors.FidelityError` naming the
    options that keep going, else returned for the caller to warn with.

    Args:
        who: the callback, e.g. ``"QuantizationAwareTraining"``.
        reference: what int8 was compared with, in words.
        breaches: the failed comparisons.
        config: the gate's thresholds and ``on_breach``.
        fallback: what ``on_breach="fallback"`` ships instead, in words.
    """
    message = (
        f"{who}: the int8 model departs from {reference} "
        f"(fidelity: SQNR >= {config.min_sqnr_db:g} dB, top-1 agreement >= {config.min_top1_agreement:g}):\n"
        + "\n".join(f"  - {b.describe()}" for b in breaches)
    )
    # the first layer under the SQNR threshold; on an agreement-only breach (every layer above it) the worst one;
    # none for near-ties that input noise flips as often (keeping a layer float would not change them)
    layers = [b.first_departing_layer.split(" (")[0] if b.first_departing_layer else b.worst_layers[0][0]
              for b in breaches if (b.first_departing_layer or b.worst_layers) and not b.within_noise_floor]
    if layers:
        message += (
            "\n  (to keep a departing layer in float: qconfig_mapping {'module_name': [{'name': "
            f"'{layers[0]}', 'qconfig': None}}]}} (names inside the quantized submodule))"
        )
    if config.on_breach == "fail":
        message += (f"\n  (fidelity on_breach='warn' keeps the int8 model, 'fallback' {fallback}; "
                    "thresholds: fidelity min_sqnr_db / min_top1_agreement)")
        raise FidelityError(message)
    return message


def _name_layers(result: ModuleFidelity, reference: nn.Module, candidate: nn.Module, batches: Sequence[Inputs],
                 min_sqnr_db: float) -> None:
    """First and worst layers where the int8 graph departs from the fake-quant graph (graph order)."""
    graph = source_of(candidate)
    if not (isinstance(reference, torch.fx.GraphModule) and isinstance(graph, torch.fx.GraphModule)):
        return
    try:
        args = [tuple(b.args) for b in batches[:2] if not b.kwargs]
        rows = per_layer_sqnr("", {"fake_quant": reference, "int8": graph}, args, (("db", "int8", "fake_quant"),))
    except Exception:
        return
    first = next((row for row in rows if row["db"] < min_sqnr_db), None)
    result.first_departing_layer = None if first is None else f"{first['layer']} ({first['db']:.1f} dB)"
    result.worst_layers = [[row["layer"], row["db"]] for row in sorted(rows, key=lambda r: r["db"])[:3]
                           if row["db"] < MAX_SQNR_DB]
