"""Traceability report: which submodules FX can trace, why the others cannot, and which route fits.

FX graph mode quantization needs a symbolically traceable module. :func:`diagnose` walks a model
top down: it traces each candidate submodule with ``torch.fx.symbolic_trace``; a module that
traces covers its whole subtree, a module that fails is examined further (its children are
visited, then it is traced again with its failing descendants kept as leaves). Every failure is
reported with the error, the source line that raised it, what kind of trace breaker it is and the
route of the FX guide that fits, with the config snippet for it:

* 1.a quantize only what traces: ``modules: [...]`` (names and glob patterns);
* 1.b skip what does not: ``prepare_custom_config: {non_traceable_module_names: [...]}``;
* 2.a refactor (the fix for the breaker, e.g. ``x.view(shape)`` instead of ``x.view(*shape)``);
* 2.b a custom module pair (observed ``from_float`` / quantized ``from_observed``) for code that
  must be quantized but cannot be made traceable (loops over time, like ``nn.LSTM``).

When example inputs are known (``example_input_array``), every module that traces is also run as
a traced graph on the inputs it really receives and compared with the eager module: a graph that
traced but fixed a branch at trace time (``if scale is not None`` on a keyword-only argument) is
caught there.

Example::

    from qlightning.quantize.doctor import diagnose
    report = diagnose(model)                 # a LightningModule or any nn.Module
    print(report.to_text())
    report.traceable_modules()               # the 1.a candidates, names relative to the model

Command line: ``qlightning doctor pkg.module:Class`` or ``qlightning doctor recipe=NAME``.
"""

from __future__ import annotations

import fnmatch
import inspect
import json
import os
import re
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Optional, Sequence

import torch
from torch import nn

from qlightning.core.inputs import Inputs, capture_inputs, positional_args
from qlightning.core.quiet import quiet

# Layers worth quantizing: a subtree without any of these is not a candidate of its own.
QUANTIZABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
               nn.ConvTranspose3d, nn.LSTM, nn.GRU, nn.RNN, nn.LSTMCell, nn.GRUCell, nn.RNNCell,
               nn.Embedding, nn.EmbeddingBag, nn.MultiheadAttention)
RECURRENT = (nn.LSTM, nn.GRU, nn.RNN)
_TORCH_DIR = os.path.dirname(torch.__file__)

BREAKERS = {
    "control_flow": "data-dependent control flow (an if/while on a traced value)",
    "view_unpack": "*args unpacking of a traced shape (x.view(*shape))",
    "len": "len() of a tensor",
    "iteration": "iteration over a tensor or a traced size (for ... in x / range(x.size(1)))",
    "keyword_only": "keyword-only forward parameter (FX makes it a positional tensor input)",
    "variadic": "*args/**kwargs forward (often added by a decorator)",
    "specialised": "traces, but the traced graph does not reproduce the module on real inputs",
    "other": "other trace error",
}

FIXES = {
    "control_flow": "move the branch out of the traced code (into the parent, or a submodule kept out of "
                    "tracing), or compute both sides and select with torch.where",
    "view_unpack": "pass the shape itself: x.view(new_shape) / x.reshape(new_shape) instead of x.view(*new_shape)",
    "len": "use x.size(0) / x.shape[0] instead of len(x) (or torch.fx.wrap('len') at module level)",
    "iteration": "vectorise the loop over the batch/time dimension; a recurrence that cannot be vectorised "
                 "is a custom module (route 2.b)",
    "keyword_only": "make the parameter positional-or-keyword and always pass a tensor (no `if arg is None` "
                    "inside the traced forward), or quantize the submodules it calls",
    "variadic": "give the forward an explicit signature (no *args/**kwargs, no wrapping decorator), or quantize "
                "the submodules it calls",
    "specialised": "remove the branch on arguments (`is None` checks, Python values) from the traced forward",
    "other": "see the error; quantize the submodules that trace instead",
}


@dataclass
class Finding:
    """What the doctor found about one submodule (``name`` relative to the diagnosed model)."""

    name: str
    cls: str
    traces: bool
    quantizable: int = 0
    kind: Optional[str] = None
    error: Optional[str] = None
    location: Optional[str] = None
    source: Optional[str] = None
    skip: list[str] = field(default_factory=list)   # traces with these (relative) names kept as leaves
    route: Optional[str] = None
    advice: str = ""
    leaf: bool = False                              # a torch.nn layer: traces as one call
    notes: list[str] = field(default_factory=list)

    @property
    def breaks_itself(self) -> bool:
        """Whether the module does not trace and keeping submodules as leaves (``skip``) does not make it trace."""
        return not self.traces and not self.skip


@dataclass
class Report:
    """All findings, in model order, plus the routes that fit and their config snippets."""

    model: str
    findings: list[Finding]
    checked_inputs: bool = False
    configured: list[dict[str, Any]] = field(default_factory=list)

    def get(self, name: str) -> Optional[Finding]:
        """The finding of submodule ``name``, if it was visited.

        Args:
            name: a submodule's qualified name (``""``: the model).
        """
        return next((f for f in self.findings if f.name == name), None)

    def failing(self) -> list[Finding]:
        """The findings of modules that do not trace."""
        return [f for f in self.findings if not f.traces]

    def traceable_modules(self) -> list[str]:
        """Largest submodules that trace and hold quantizable layers (route 1.a), in model order."""
        return [f.name for f in self.findings if f.traces and f.quantizable and f.name]

    def skip_routes(self) -> list[Finding]:
        """Outermost modules that trace once their failing descendants are kept out of tracing (route 1.b)."""
        found = [f for f in self.findings if f.skip and f.route == "1.b" and f.name]
        return [f for f in found if not any(g is not f and (not g.name or f.name.startswith(g.name + ".")) for g in found)]

    # ------------------------------------------------------------------ rendering
    def modules_snippet(self, names: Optional[Sequence[str]] = None, all_names: Sequence[str] = ()) -> str:
        """A ``modules:`` YAML list for a recipe, runs of names compressed into globs.

        Args:
            names: the modules to list (default: :meth:`traceable_modules`).
            all_names: every submodule name a glob must not match beyond ``names`` (default: the findings').
        """
        names = list(self.traceable_modules() if names is None else names)
        patterns = compress(names, all_names or [f.name for f in self.findings])
        return "modules:\n" + "".join(f"  - {p}\n" for p in patterns)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (``--json``)."""
        return {"model": self.model, "checked_inputs": self.checked_inputs, "findings": [asdict(f) for f in self.findings],
                "traceable_modules": self.traceable_modules(), "configured": self.configured}

    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON."""
        return json.dumps(self.to_dict(), indent=2)

    def to_text(self) -> str:
        """The report as the terminal shows it."""
        lines = [f"qlightning doctor: {self.model}", ""]
        names = [f.name for f in self.findings]
        rows = []
        for f in self.findings:
            if f.leaf and f.traces and not f.quantizable:
                continue
            if f.leaf:
                status, why = "yes", "torch.nn layer (one call)"
            elif f.traces:
                status, why = "yes", ""
            elif f.skip:
                status, why = "no", f"traces once {', '.join(f.skip)} {'is' if len(f.skip) == 1 else 'are'} skipped"
            else:
                status, why = "no", BREAKERS.get(f.kind or "other", f.kind or "")
            rows.append((f.name, (f.cls.rsplit(".", 1)[-1][:24], status, f.route or "", why)))
        grouped = _group(rows, names)
        width = max([len(n) for n, _, _ in grouped] + [10])
        lines.append(f"{'submodule':{width}s}  {'class':24s}  traces  route  why")
        for name, (cls, status, route, why), count in grouped:
            lines.append(f"{name:{width}s}  {cls:24s}  {status:6s}  {route:5s}  {why}" + (f"  [x{count}]" if count > 1 else ""))
        failing = [f for f in self.findings if f.breaks_itself]
        if failing:
            lines += ["", "Trace breakers (where FX stops):"]
            details = [(f.name, (f.cls.rsplit(".", 1)[-1], f.kind, f.location, f.source, f.error, f.route,
                                 f.advice, tuple(f.notes))) for f in failing]
            for name, (cls, kind, location, source, error, route, advice, notes), count in _group(details, names):
                lines.append(f"- {name} ({cls}{f', {count} modules' if count > 1 else ''}): {BREAKERS.get(kind or 'other')}")
                if location:
                    lines.append(f"    at {location}")
                if source:
                    lines.append(f"      {source}")
                if error:
                    lines.append(f"    error: {error}")
                for note in notes:
                    lines.append(f"    note: {note}")
                lines.append(f"    route {route}: {advice}")
        noted = [(f.name, tuple(f.notes)) for f in self.findings if f.traces and f.notes]
        if noted:
            lines += ["", "Traces, with a caveat:"]
            for name, notes, count in _group(noted, names):
                lines += [f"- {name}: {note}" for note in notes]
        traceable = self.traceable_modules()
        lines += ["", "Routes and config snippets", ""]
        if traceable:
            lines += ["1.a  Quantize only what traces (each prepared and converted on its own):", "",
                      _indent(self.modules_snippet(traceable)), ""]
        for f in self.skip_routes():
            lines += [f"1.b  Quantize {f.name} and keep what does not trace in float "
                      "(names relative to the quantized module):", "",
                      _indent(f"modules: [{f.name}]\nquant:\n  prepare:\n    non_traceable_module_names:\n"
                              + "".join(f"      - {s}\n" for s in f.skip)),
                      "    Python: QuantizationAwareTraining(modules=[%r], prepare_custom_config="
                      "{'non_traceable_module_names': %r})" % (f.name, f.skip), ""]
        refactor = _group([(f.name, (f.kind, f.advice)) for f in failing if f.route == "2.a"], names)
        for name, (_, advice), _count in refactor:
            lines += [f"2.a  Refactor {name}: {advice}", ""]
        custom = [f for f in self.findings if f.route == "2.b" or f.notes and any("2.b" in n for n in f.notes)]
        for name, (hint,), _count in _group([(f.name, (custom_module_hint(f),)) for f in custom], names):
            lines += [f"2.b  {name}: {hint}", ""]
        configured = [(c["name"], (c["traces"], c.get("error"))) for c in self.configured]
        for name, (traces, error), count in _group(configured, [c["name"] for c in self.configured]):
            verdict = "traces" if traces else f"does NOT trace: {error}"
            lines.append(f"configured quant.modules target {name!r}: {verdict}" + (f" [x{count}]" if count > 1 else ""))
        if not self.checked_inputs:
            lines.append("(no example inputs: traced graphs were not run; set example_input_array to check them)")
        return "\n".join(lines).rstrip() + "\n"


def _group(rows: Sequence[tuple[str, Any]], universe: Sequence[str]) -> list[tuple[str, Any, int]]:
    """Merge rows that differ only in a ModuleList index (layer.0.x, layer.1.x, ...) into one glob row."""
    out: list[tuple[str, Any, int]] = []
    index: dict[tuple[str, Any], int] = {}
    members: dict[int, list[str]] = {}
    for name, payload in rows:
        key = (re.sub(r"\.\d+(?=\.|$)", ".#", name), payload)
        if "#" in key[0] and key in index:
            members[index[key]].append(name)
            continue
        index[key] = len(out)
        members[len(out)] = [name]
        out.append((name, payload, 1))
    result = []
    for i, (name, payload, _) in enumerate(out):
        group = members[i]
        if len(group) > 1:
            patterns = compress(group, universe)
            name = patterns[0] if len(patterns) == 1 else ", ".join(patterns)
        result.append((name or "(model)", payload, len(group)))
    return result


def _indent(text: str, by: str = "    ") -> str:
    return "\n".join(by + line if line else line for line in text.rstrip().splitlines())


def custom_module_hint(f: Finding) -> str:
    """How to quantize a module that no tracing route reaches: a custom module pair (or dynamic, for LSTM).

    Args:
        f: the module's finding.
    """
    if "LSTM" in f.cls or any("LSTM" in n for n in f.notes):
        return ("static int8 nn.LSTM goes through torch.ao's quantizable LSTM as a custom module pair "
                "(call it as lstm(x, (h0, c0)), FX needs the hidden state):\n"
                "    prepare: {float_to_observed: {static: {torch.nn.LSTM: torch.ao.nn.quantizable.LSTM}}}\n"
                "    convert: {observed_to_quantized: {static: {torch.ao.nn.quantizable.LSTM: torch.ao.nn.quantized.LSTM}}}\n"
                "    or dynamic: qconfig_mapping: {global: default, object_type: [{type: torch.nn.LSTM, qconfig: dynamic}]}")
    return (f"write an observed class (classmethod from_float) and a quantized class (classmethod from_observed) for "
            f"{f.cls}, then\n    prepare: {{float_to_observed: {{static: {{{f.cls}: <Observed class>}}}}}}\n"
            f"    convert: {{observed_to_quantized: {{static: {{<Observed class>: <Quantized class>}}}}}}\n"
            "    (see qlightning/examples/custom_modules.py: ElmanRNN)")


# --------------------------------------------------------------------------- tracing


class _LeafTracer(torch.fx.Tracer):
    """symbolic_trace's tracer, with extra modules (by identity) kept as leaves."""

    def __init__(self, leaves: Iterable[nn.Module] = ()) -> None:
        super().__init__()
        self.extra_leaves = {id(m) for m in leaves}

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return id(m) in self.extra_leaves or super().is_leaf_module(m, module_qualified_name)


def trace(module: nn.Module, leaves: Iterable[nn.Module] = ()) -> torch.fx.GraphModule:
    """``torch.fx.symbolic_trace`` with ``leaves`` not traced into.

    Args:
        module: the module to trace.
        leaves: modules kept as calls, not traced into.
    """
    tracer = _LeafTracer(leaves)
    with quiet(all_warnings=True):
        graph = tracer.trace(module)
    return torch.fx.GraphModule(tracer.root, graph, type(module).__name__)


def _user_frame(exc: BaseException) -> Optional[traceback.FrameSummary]:
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if not f.filename.startswith(_TORCH_DIR) and not f.filename.startswith("<")
            and os.path.abspath(f.filename) != os.path.abspath(__file__)]
    return user[-1] if user else None


def _signature_kind(module: nn.Module) -> Optional[str]:
    forward = type(module).forward
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return "variadic"
    if any(p.kind == p.KEYWORD_ONLY for p in params):
        return "keyword_only"
    return None


def classify(exc: BaseException, source: Optional[str], module: nn.Module) -> str:
    """The kind of trace breaker behind ``exc`` (a key of :data:`BREAKERS`).

    Args:
        exc: what tracing raised.
        source: the user's source line where it was raised, if known.
        module: the module that failed to trace.
    """
    kind = classify_plain(exc, source)
    if kind != "other":
        return kind
    message = str(exc)
    decorated = inspect.unwrap(type(module).forward) is not type(module).forward
    if decorated or _signature_kind(module) == "variadic" or "co_varnames" in message \
            or "does not support item assignment" in message:
        return "variadic"
    return "other"


def _statement(filename: str, lineno: int, limit: int = 8) -> str:
    """The whole Python statement starting at ``lineno`` (calls spread over several lines included)."""
    import linecache

    text, depth = "", 0
    for offset in range(limit):
        line = linecache.getline(filename, lineno + offset)
        if not line:
            break
        text += (" " if text else "") + line.strip()
        depth += line.count("(") + line.count("[") - line.count(")") - line.count("]")
        if depth <= 0:
            break
    return text


def _describe_frame(frame: Optional[traceback.FrameSummary], module: nn.Module) -> tuple[Optional[str], Optional[str]]:
    if frame is not None:
        source = _statement(frame.filename, frame.lineno or 0) or (frame.line or "").strip()
        return f"{_short(frame.filename)}:{frame.lineno}", source[:300] or None
    try:
        forward = inspect.unwrap(type(module).forward)
        _, line = inspect.getsourcelines(forward)
        return f"{_short(inspect.getsourcefile(forward) or '?')}:{line}", f"def forward{inspect.signature(forward)}"
    except (TypeError, OSError):
        return None, None


def _short(path: str) -> str:
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    cwd = os.getcwd() + os.sep
    return path[len(cwd):] if path.startswith(cwd) else path


def _lstm_without_state(module: nn.Module) -> Optional[str]:
    """An ``nn.LSTM`` called as ``lstm(x)``: FX's static LSTM custom module needs ``lstm(x, (h0, c0))``."""
    try:
        graph = trace(module).graph
    except Exception:
        return None
    named = dict(module.named_modules())
    for node in graph.nodes:
        if node.op == "call_module" and isinstance(named.get(str(node.target)), nn.LSTM) and len(node.args) + len(node.kwargs) < 2:
            return (f"{node.target} (nn.LSTM) is called without its hidden state: dynamic int8 works, but static int8 "
                    "through the quantizable LSTM custom module fails at convert ('Expected LSTM custom module inputs "
                    "to be (input, (hidden0, hidden1))'); pass (h0, c0) explicitly, e.g. zeros (route 2.a)")
    return None


def _shape_arithmetic(module: nn.Module) -> Optional[str]:
    """A traced ``x.size()[:-1] + (h, d)``: an ``operator.add`` that torch.ao's default mapping fake-quantizes."""
    import operator

    try:
        graph = trace(module).graph
    except Exception:
        return None
    shape_nodes = set()
    for node in graph.nodes:
        from_shape = (node.op == "call_method" and node.target == "size") or \
                     (node.op == "call_function" and node.target is getattr and len(node.args) > 1 and node.args[1] == "shape")
        from_item = node.op == "call_function" and node.target is operator.getitem and node.args and node.args[0] in shape_nodes \
            and isinstance(node.args[1], slice)
        if from_shape or from_item:
            shape_nodes.add(node)
            continue
        if node.op == "call_function" and node.target in (operator.add, operator.mul) and any(a in shape_nodes for a in node.args):
            return ("shape arithmetic (x.size()[:-1] + (...)) traces as operator.add, which torch.ao's default qconfig "
                    "mapping fake-quantizes: the first training step fails with 'must be Tensor, not torch.Size'. Build "
                    "the shape from x.size(i) (x.view(b, t, h, d)), or use a mapping that does not quantize add "
                    "(e.g. Linear-only)")
    return None


def _attempt(module: nn.Module, leaves: Iterable[nn.Module] = ()) -> Optional[BaseException]:
    try:
        trace(module, leaves)
    except Exception as exc:  # every trace failure is a finding
        return exc
    return None


def _unwrapped_attempt(module: nn.Module, leaves: Iterable[nn.Module]) -> Optional[BaseException]:
    """Trace the forward behind a decorator, to find the next breaker in the module's own code."""
    cls = type(module)
    raw = inspect.unwrap(cls.forward)
    if raw is cls.forward:
        return None
    sub = type(cls.__name__, (cls,), {"forward": raw, "__module__": cls.__module__})
    try:
        module.__class__ = sub
        return _attempt(module, leaves)
    finally:
        module.__class__ = cls


def _is_leaf(module: nn.Module) -> bool:
    return torch.fx.Tracer().is_leaf_module(module, "") and not isinstance(module, nn.Sequential)


def _has_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward and not isinstance(module, (nn.ModuleList, nn.ModuleDict))


def _skipped(module: nn.Module) -> bool:
    return type(module).__module__.startswith(("torchmetrics", "lightning"))


def _count_quantizable(module: nn.Module) -> int:
    return sum(isinstance(m, QUANTIZABLE) for m in module.modules())


def _rel(name: str, prefix: str) -> str:
    return name[len(prefix) + 1:] if prefix else name


def compress(names: Sequence[str], universe: Sequence[str]) -> list[str]:
    """Replace runs of ``a.0.b, a.1.b, ...`` by a glob that matches exactly those names in ``universe``.

    Args:
        names: the names to list.
        universe: every submodule name (a glob may match no other).
    """
    groups: dict[str, list[str]] = {}
    for name in names:
        key = re.sub(r"\.\d+(?=\.|$)", ".#", name)
        groups.setdefault(key, []).append(name)
    out: list[str] = []
    universe = list(dict.fromkeys(list(universe) + list(names)))
    for key, members in groups.items():
        if len(members) < 2 or "#" not in key:
            out.extend(members)
            continue
        for wildcard in ("*", "?", "[0-9]", "[0-9][0-9]"):
            pattern = key.replace("#", wildcard)
            matched = set(fnmatch.filter(universe, pattern))
            if matched == set(members):
                out.append(pattern)
                break
        else:
            out.extend(members)
    return out


def diagnose(model: nn.Module, example_inputs: Optional[Any] = None, check_inputs: bool = True,
             name: Optional[str] = None) -> Report:
    """Trace ``model`` and its submodules top down and say what traces, what does not, and why.

    Args:
        model: any ``nn.Module`` (a LightningModule too; its ``example_input_array`` is used).
        example_inputs: inputs of ``model`` (a tensor, tuple or dict) to run traced graphs on.
        check_inputs: run every traced graph on the inputs its module really receives.
        name: what the report calls the model (default: its class path).
    """
    findings: dict[str, Finding] = {}
    order: list[str] = []
    modules = dict(model.named_modules())

    def visit(qualname: str, module: nn.Module) -> Finding:
        cls_path = f"{type(module).__module__}.{type(module).__qualname__}"
        finding = Finding(qualname, cls_path, traces=True, quantizable=_count_quantizable(module))
        if qualname and not _has_forward(module):  # ModuleList / ModuleDict: their items are the candidates
            for child_name, child in module.named_children():
                if not _skipped(child):
                    visit(f"{qualname}.{child_name}", child)
            finding.traces, finding.kind = False, "container"
            return finding
        order.append(qualname)
        findings[qualname] = finding
        if _is_leaf(module):
            finding.leaf = True
            if isinstance(module, RECURRENT):
                finding.notes.append("nn.LSTM/GRU/RNN: dynamic int8 works as is; static int8 needs a custom module "
                                     "pair (route 2.b)")
            return finding
        exc = _attempt(module)
        if exc is None:
            for note in (_shape_arithmetic(module), _lstm_without_state(module)):
                if note:
                    finding.notes.append(note)
            kind = _signature_kind(module)
            if kind == "keyword_only":
                finding.notes.append("forward has keyword-only parameters: FX turns them into positional tensor "
                                     "inputs and fixes `is None` checks at trace time")
            return finding
        finding.traces = False
        children = _descendant_candidates(qualname, module)
        for child_name, child in children:
            if not _skipped(child):
                visit(child_name, child)
        # breakers inside: the failing descendants whose own code stops FX
        inner = [n for n in order if n.startswith(qualname + "." if qualname else "") and n != qualname
                 and findings[n].breaks_itself and not _inside_any(n, qualname)]
        inner += [n for n, m in children if _skipped(m)]
        if inner and _attempt(module, [modules[n] for n in inner]) is None:
            finding.skip = [_rel(n, qualname) for n in inner]
            finding.kind = None
            return finding
        own_exc = _attempt(module, [modules[n] for n in inner]) if inner else exc
        own_exc = own_exc or exc
        finding.location, finding.source = _describe_frame(_user_frame(own_exc), module)
        finding.kind = classify(own_exc, finding.source, module)
        finding.error = f"{type(own_exc).__name__}: {_first_line(own_exc)}"
        behind = _unwrapped_attempt(module, [modules[n] for n in inner])
        if behind is not None and _describe_frame(_user_frame(behind), module)[0] != finding.location:
            loc, src = _describe_frame(_user_frame(behind), module)
            finding.notes.append(f"behind the decorator, FX next stops at {loc}: {src} "
                                 f"({BREAKERS[classify_plain(behind, src)]})")
        return finding

    def _inside_any(n: str, root: str) -> bool:
        # a module inside another self-breaking module (below root) is covered by the outer one
        parts = n.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            parent = ".".join(parts[:cut])
            if parent == root:
                break
            if parent in findings and findings[parent].breaks_itself:
                return True
        return False

    visit("", model)
    report_findings = [findings[n] for n in order]
    checked = False
    if check_inputs:
        checked = _check_on_inputs(model, report_findings, modules, example_inputs)
    # the route for every module that does not trace on its own
    for f in report_findings:
        if not f.traces:
            _choose_route(f, findings, modules)
    label = name or f"{type(model).__module__}.{type(model).__qualname__}"
    return Report(label, report_findings, checked_inputs=checked)


def classify_plain(exc: BaseException, source: Optional[str]) -> str:
    """The kind of trace breaker behind ``exc`` from its message and source line alone (``"other"`` if none).

    Args:
        exc: what tracing raised.
        source: the user's source line where it was raised, if known.
    """
    message, source = str(exc), source or ""
    if "cannot be used as inputs to control flow" in message:
        return "control_flow"
    if "'len' is not supported" in message:
        return "len"
    if "Proxy object cannot be iterated" in message:
        if re.search(r"\*\*?(args|kwargs)\b|\*\*\w", source):
            return "variadic"
        if re.search(r"[(,]\s*\*\w", source) and re.search(r"shape|size|view|reshape|expand", source):
            return "view_unpack"
        if re.search(r"\bfor\b|\bin\b|\blist\(|\btuple\(|\bzip\(|\benumerate\(", source):
            return "iteration"
        return "other"
    if "cannot be interpreted as an integer" in message:
        return "iteration"
    return "other"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:240] if text else ""


def _descendant_candidates(qualname: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(f"{qualname}.{n}" if qualname else n, m) for n, m in module.named_children()]


def _choose_route(f: Finding, findings: dict[str, Finding], modules: dict[str, nn.Module]) -> None:
    """Pick the route of the FX guide that fits a module that does not trace on its own."""
    module = modules[f.name]
    prefix = f.name + "." if f.name else ""
    inside = [n for n, g in findings.items() if n.startswith(prefix) and n != f.name and g.traces and g.quantizable]
    parts = compress([_rel(n, f.name) for n in inside], [_rel(n, f.name) for n in findings if n.startswith(prefix)])
    alt_1a = f"1.a: quantize {parts} on their own" if inside else ""
    if f.skip:
        stay_float = [s for s in f.skip if _count_quantizable(modules[prefix + s])]
        f.route = "1.b"
        f.advice = (f"quantize {f.name or 'the model'} with {f.skip} kept in float (non_traceable_module_names)"
                    + (f"; the layers inside {stay_float} then stay float" if stay_float else ""))
        return
    # the nearest ancestor that traces once this module is skipped
    cover = next((g for g in sorted(findings.values(), key=lambda g: -len(g.name))
                  if g.name and g.skip and f.name.startswith(g.name + ".") and _rel(f.name, g.name) in g.skip), None)
    direct = [m for m in module.children() if isinstance(m, QUANTIZABLE)]
    if f.kind in ("view_unpack", "len", "keyword_only", "specialised"):
        f.route, f.advice = "2.a", FIXES[f.kind] + (f"; or {alt_1a}" if alt_1a else "")
    elif f.kind in ("iteration", "control_flow") and cover is not None:
        f.route = "1.b"
        f.advice = (f"keep it in float inside the quantized {cover.name}: QuantizationAwareTraining(modules=[{cover.name!r}], "
                    f"prepare_custom_config={{'non_traceable_module_names': [{_rel(f.name, cover.name)!r}]}})"
                    + ("; if its layers must be int8 too: 2.b, a custom module pair (from_float / from_observed)"
                       if f.quantizable else ""))
    elif f.kind in ("iteration", "control_flow") and direct and set(inside) <= {prefix + n for n, m in module.named_children()}:
        f.route = "2.b"
        f.advice = ("the loop/branch must stay and its layers need int8: a custom module pair (from_float / "
                    "from_observed); or 2.a: " + FIXES[f.kind] + (f"; or {alt_1a}" if alt_1a else ""))
    elif inside:
        f.route = "1.a"
        f.advice = f"quantize the parts that trace: {parts}" + (f" (or 2.a: {FIXES[f.kind]})" if f.kind in FIXES else "")
    elif f.quantizable:
        f.route = "2.b" if f.kind in ("control_flow", "iteration") else "2.a"
        f.advice = ("its layers must be quantized inside the non-traceable code: a custom module pair "
                    "(from_float / from_observed)" if f.route == "2.b" else FIXES.get(f.kind or "other", ""))
    else:
        f.route = "1.b"
        f.advice = "nothing to quantize inside: keep it in float by listing it in its parent's non_traceable_module_names"


def _example_of(model: nn.Module, example_inputs: Any) -> Optional[Inputs]:
    value = example_inputs if example_inputs is not None else getattr(model, "example_input_array", None)
    if value is None:
        return None
    if isinstance(value, Inputs):
        return value
    if isinstance(value, torch.Tensor):
        return Inputs((value,))
    if isinstance(value, dict):
        return Inputs((), dict(value))
    return Inputs(tuple(value))


def _check_on_inputs(model: nn.Module, findings: list[Finding], modules: dict[str, nn.Module], example_inputs: Any) -> bool:
    """Run each traced graph on the inputs its module receives in a real forward; report mismatches."""
    inputs = _example_of(model, example_inputs)
    if inputs is None:
        return False
    candidates = [f for f in findings if f.traces and not f.leaf and f.quantizable]
    if not candidates:
        return True
    names = [f.name for f in candidates if f.name]
    seen = capture_inputs(model, names, lambda: model(*inputs.args, **inputs.kwargs)) if names else {}
    if any(f.name == "" for f in candidates):
        seen[""] = inputs
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()
        for f in candidates:
            if f.name not in seen:
                f.notes.append("not called in a forward of the model with its example inputs")
                continue
            module, got = modules[f.name], seen[f.name]
            try:
                with torch.no_grad(), quiet(all_warnings=True, stderr=True):
                    graph = trace(module)
                    bound = positional_args(module, got)
                    expected = module(*got.args, **got.kwargs)
                    actual = graph(*bound)
                same = _same(expected, actual)
                problem = None if same else "the traced graph's output differs from the module's"
            except Exception as exc:  # the traced graph fails on the real inputs
                problem = f"{type(exc).__name__}: {_first_line(exc)}"
            if problem:
                f.traces = False
                f.kind = "keyword_only" if _signature_kind(module) == "keyword_only" else "specialised"
                f.error = f"traces, but on the inputs of a real forward: {problem}"
                f.location, f.source = _describe_frame(None, module)
    finally:
        for m, mode in modes.items():
            m.training = mode
    return True




def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if hasattr(a, "to_tuple") and hasattr(b, "to_tuple"):
        return _same(a.to_tuple(), b.to_tuple())
    return type(a) is type(b)


def check_targets(model: nn.Module, targets: Sequence[str], non_traceable_names: Sequence[str] = (),
                  non_traceable_classes: Sequence[type] = ()) -> list[dict[str, Any]]:
    """Whether each configured target traces, with its configured non-traceable names/classes kept as leaves.

    Args:
        model: the model.
        targets: the configured submodule names.
        non_traceable_names: configured non-traceable submodule names (kept as leaves).
        non_traceable_classes: configured non-traceable classes (kept as leaves).
    """
    out = []
    for target in targets:
        module = model.get_submodule(target)
        leaves = [module.get_submodule(n) for n in non_traceable_names if _has_submodule(module, n)]
        leaves += [m for m in module.modules() if non_traceable_classes and isinstance(m, tuple(non_traceable_classes))
                   and m is not module]
        exc = _attempt(module, leaves)
        out.append({"name": target, "traces": exc is None,
                    "error": None if exc is None else f"{type(exc).__name__}: {_first_line(exc)}"})
    return out


def _has_submodule(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
        return True
    except AttributeError:
        return False


def load_target(spec: str) -> nn.Module:
    """``pkg.module:Name``: a module class (built without arguments), a factory, or a module object.

    Args:
        spec: ``pkg.module:Name``.
    """
    import importlib

    module_path, sep, attr = spec.partition(":")
    if not sep or not module_path or not attr:
        raise ValueError(f"{spec!r}: expected an import path pkg.module:ClassName")
    obj: Any = importlib.import_module(module_path)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if isinstance(obj, nn.Module):
        return obj
    if callable(obj):
        built = obj()
        if isinstance(built, nn.Module):
            return built
    raise ValueError(f"{spec!r}: is not an nn.Module, a module class or a factory returning one")

