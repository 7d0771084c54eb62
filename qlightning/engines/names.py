"""What a plain-data quantization spec may name as code, resolved by identity, not by spelling.

A dotted path in a qconfig mapping or a custom config (an ``object_type``, a non-traceable or
custom-module class, an observer) is resolved without side effects and accepted only when the object
found is one of the explicit set of its kind or defined in a module the user trusts; the rules are
those of :mod:`qlightning.config.allowlist`, which adds the kinds a Hydra config names (``model``,
``data``) and the checks of Hydra's instantiation keys. The engines resolve the classes their plain-data
specs name through this module, whichever route (config or Python API) the spec came by.

1. the longest module prefix is taken from ``sys.modules`` or imported only when it lies in a trusted
   package; the rest of the path is looked up in the namespaces (``vars``) of that module and of
   classes only, never through another module, a property or a module ``__getattr__``;
2. the object must belong to the set of its kind (a ``torch.nn.Module`` class of torch / torchao /
   qlightning.examples, an observer class, an operator pattern of torch.ao's backend configs), or be
   defined in a module the user trusts (``trusted_modules=[mypkg]`` on the command line,
   ``QLIGHTNING_TRUSTED_MODULES``, or ``trusted_modules=`` in Python; never from inside a recipe);
3. the path must be the object's own name (``__module__`` + ``__qualname__``) or its re-export by a
   parent package (``torch.nn.Linear``).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import operator
import os
import sys
import types
from typing import Any, Callable, Iterable, Mapping, Optional

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from qlightning.engines.fx.ao import backend_config_callables, observer_base_classes

ENV_VAR = "QLIGHTNING_TRUSTED_MODULES"
# Packages a path may make us import (their import has no side effects beyond loading code). Any
# other module is looked up only if something already imported it.
IMPORTABLE = ("qlightning.examples", "torch.nn", "torch.ao", "torchao", "torchmetrics", "lightning.pytorch")
# Where built-in objects of each kind may be defined.
MODULE_CLASS_HOMES = ("torch.nn.", "torch.ao.", "torchao.", "qlightning.examples.")
KINDS = ("module_class", "object_type", "observer")
KIND_TEXT = {
    "module_class": "a torch.nn.Module class of torch.nn, torch.ao, torchao or qlightning.examples",
    "object_type": "a torch.nn.Module class or an operator/function that torch.ao's backend configs quantize",
    "observer": "an observer or fake-quantize class of torch.ao",
}
#: ``kind -> (is of the kind, what the kind is in words)`` for kinds another layer adds (the config's model, data)
ExtraKinds = Mapping[str, tuple[Callable[[Any], bool], str]]


class NotAllowed(Exception):
    """A path that does not name an allowed object; the message says why."""


class Unresolved(NotAllowed):
    """A path that names nothing (a typo): reported as such, not as a refusal."""


def user_trusted(user_modules: Iterable[str] = ()) -> tuple[str, ...]:
    """Module names the user trusts: ``QLIGHTNING_TRUSTED_MODULES`` plus ``user_modules``.

    Args:
        user_modules: modules trusted on the command line or in Python (``trusted_modules``).
    """
    extra = [m for m in os.environ.get(ENV_VAR, "").replace(",", " ").split() if m]
    extra.extend(str(m) for m in user_modules)
    return tuple(m.strip().strip("'\"").rstrip(".") for m in extra if m.strip().strip("'\"").rstrip("."))


def _under(name: str, packages: Iterable[str]) -> bool:
    return any(name == p.rstrip(".") or name.startswith(p.rstrip(".") + ".") for p in packages)


def _module(name: str, trusted: tuple[str, ...]) -> Optional[types.ModuleType]:
    """``name`` as a module without side effects: already imported, or inside a trusted package."""
    module = sys.modules.get(name)
    if isinstance(module, types.ModuleType):
        return module
    if not _under(name, IMPORTABLE + trusted):
        return None
    try:
        spec = importlib.util.find_spec(name)
    except Exception:  # a parent is not a package, or its import failed
        return None
    if spec is None:
        return None
    try:
        return importlib.import_module(name)
    except Exception:
        return None


def _lookup(owner: Any, name: str) -> Any:
    """``owner.name`` from the namespace itself: no module ``__getattr__``, no descriptor runs."""
    if isinstance(owner, types.ModuleType):
        namespace = vars(owner)
        if name not in namespace:
            raise Unresolved(f"{owner.__name__} has no attribute {name!r}")
        return namespace[name]
    try:
        value = inspect.getattr_static(owner, name)
    except AttributeError:
        raise Unresolved(f"{owner.__qualname__} has no attribute {name!r}") from None
    return value


def _canonical(obj: Any) -> str:
    return f"{getattr(obj, '__module__', None)}.{getattr(obj, '__qualname__', None)}"


_PATTERNS: dict[int, tuple[Any, set[str]]] = {}


def pattern_objects() -> dict[int, tuple[Any, set[str]]]:
    """Functions and classes that torch.ao's backend configs quantize, with their public spellings.

    Built-in functions (``torch.add``, ``torch.nn.functional.linear``) carry no reliable
    ``__module__``/``__qualname__``, so their accepted spellings are where torch exposes them.
    """
    if _PATTERNS:
        return _PATTERNS
    found = {id(obj): obj for obj in backend_config_callables()}
    namespaces = {"torch": torch, "torch.nn.functional": torch.nn.functional, "operator": operator}
    for oid, obj in found.items():
        names = {f"{m}.{n}" for m, ns in namespaces.items() for n, v in vars(ns).items() if v is obj}
        if isinstance(obj, type):
            names.add(_canonical(obj))
        _PATTERNS[oid] = (obj, names)
    return _PATTERNS


def _in_kind(obj: Any, kind: str, trusted: tuple[str, ...], extra: Optional[ExtraKinds] = None) -> bool:
    """Whether ``obj`` is in the explicit set of ``kind`` (or defined in a trusted module)."""
    module = getattr(obj, "__module__", None)
    if isinstance(module, str) and trusted and _under(module, trusted) and (isinstance(obj, type) or inspect.isfunction(obj)):
        return True
    if not isinstance(obj, type):
        return kind == "object_type" and id(obj) in pattern_objects()
    if extra and kind in extra:
        return extra[kind][0](obj)
    if kind in ("module_class", "object_type"):
        return (issubclass(obj, torch.nn.Module) and _under(module, MODULE_CLASS_HOMES)) or (
            kind == "object_type" and id(obj) in pattern_objects())
    if kind == "observer":
        return issubclass(obj, observer_base_classes()) and _under(module, ("torch.ao.", "torchao."))
    return False


def _spelled_right(path: str, module_name: str, obj: Any) -> bool:
    """The path is the object's own name, its re-export by a parent package, or a public pattern spelling."""
    canonical = _canonical(obj)
    if path == canonical:
        return True
    own_module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(own_module, str) and own_module.startswith(module_name + ".") and path == f"{module_name}.{qualname}":
        return True
    entry = pattern_objects().get(id(obj)) if not isinstance(obj, type) else None
    return entry is not None and path in entry[1]


def resolve_object(path: Any, kind: str, user_modules: Iterable[str] = (), extra_kinds: Optional[ExtraKinds] = None) -> Any:
    """The object ``path`` names, if it is in the explicit set of ``kind``; else :class:`NotAllowed`.

    Nothing is called and no module outside the trusted packages is imported.

    Args:
        path: the dotted path, e.g. ``torch.nn.Linear``.
        kind: one of :data:`KINDS` or of ``extra_kinds``.
        user_modules: modules the user trusts besides ``QLIGHTNING_TRUSTED_MODULES``.
        extra_kinds: kinds another layer adds (``{kind: (is of the kind, words)}``).
    """
    if kind not in KINDS and kind not in (extra_kinds or {}):
        raise ValueError(f"unknown kind {kind!r}")
    if not isinstance(path, str) or "." not in path or not all(p.isidentifier() for p in path.split(".")):
        raise NotAllowed("give a dotted path of identifiers such as qlightning.examples.DigitsClassifier")
    trusted = user_trusted(user_modules)
    parts = path.split(".")
    module = None
    for cut in range(len(parts) - 1, 0, -1):
        module = _module(".".join(parts[:cut]), trusted)
        if module is not None:
            break
    if module is None:
        raise NotAllowed("no trusted module to look it up in")
    module_name = ".".join(parts[:cut])
    obj: Any = module
    for i, name in enumerate(parts[cut:]):
        try:
            obj = _lookup(obj, name)
        except Unresolved as exc:
            if _under(module_name, IMPORTABLE + trusted):
                raise  # a typo inside a trusted package: say so
            raise NotAllowed(f"{exc}; only trusted packages are imported to look a name up") from None
        if isinstance(obj, types.ModuleType):
            # e.g. torch.nn.modules.module.torch.load: a walk through what a module imported
            raise NotAllowed(f"{'.'.join(parts[:cut + i + 1])} is a module reached as an attribute, not imported")
        if i < len(parts) - cut - 1 and not isinstance(obj, type):
            raise NotAllowed(f"{'.'.join(parts[:cut + i + 1])} is not a class")
    if not _in_kind(obj, kind, trusted, extra_kinds):
        raise NotAllowed(f"resolves to {_canonical(obj)}, which is not {_kind_text(kind, extra_kinds)}")
    # a trusted module's namespace is the user's choice: its re-exports of allowed objects count as spellings
    if not _spelled_right(path, module_name, obj) and not (trusted and _under(module_name, trusted)):
        raise NotAllowed(f"resolves to {_canonical(obj)} through another module; write that name instead")
    return obj


def _kind_text(kind: str, extra_kinds: Optional[ExtraKinds]) -> str:
    return extra_kinds[kind][1] if extra_kinds and kind in extra_kinds else KIND_TEXT[kind]


def not_allowed_message(key: str, path: Any, reason: Any, kind: str, source: Optional[str] = None,
                        extra_kinds: Optional[ExtraKinds] = None) -> str:
    """The message of a refused (or unresolvable) path: key, value, why, what is expected.

    Args:
        key: the key (or argument) that holds the path.
        path: the path as given.
        reason: the :class:`NotAllowed` raised for it.
        kind: the kind the path was to name.
        source: the file it came from, if any.
        extra_kinds: as in :func:`resolve_object`.
    """
    where = f" in {source}" if source else ""
    text = _kind_text(kind, extra_kinds)
    if isinstance(reason, Unresolved):
        return f"{key}={path!r}{where}: cannot be resolved ({reason}); expected {text}"
    return (f"{key}={path!r}{where}: not an allowed class ({reason}); expected {text} "
            f"(trust your own package with trusted_modules=[...] on the command line or {ENV_VAR}; "
            "a recipe cannot widen this set)")


def plain(node: Any) -> Any:
    """OmegaConf nodes and enums to plain Python containers (a spec may come from a config or from Python).

    Args:
        node: anything; OmegaConf containers are converted, everything else returned as is.
    """
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True, enum_to_str=True)
    return node


def close(value: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the choice closest to ``value``, else ``""``.

    Args:
        value: what was given.
        choices: the valid values.
    """
    match = difflib.get_close_matches(str(value), list(choices), n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def resolve_reference(path: Any, key: str, errors: list[str], trusted: Iterable[str] = (), object_type: bool = False,
                      kind: Optional[str] = None) -> Any:
    """The class or function ``a.b.C`` names, checked by identity (:func:`resolve_object`).

    ``kind`` is ``object_type`` (a qconfig key: module class or quantizable function),
    ``module_class`` (non-traceable / standalone / custom-module classes) or ``observer``; the
    object is imported without side effects and never called here.

    Args:
        path: the dotted path.
        key: the key (or argument) that holds it, for the message.
        errors: where a refusal is appended (then ``None`` is returned).
        trusted: modules the user trusts.
        object_type: shorthand for ``kind="object_type"``.
        kind: ``object_type``, ``module_class`` or ``observer``.
    """
    kind = kind or ("object_type" if object_type else "module_class")
    try:
        return resolve_object(path, kind, trusted)
    except NotAllowed as exc:
        errors.append(not_allowed_message(key, path, exc, kind))
        return None
