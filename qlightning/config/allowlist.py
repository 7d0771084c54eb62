"""What a config may name as code: a recipe is data, never a way to run arbitrary code.

A dotted path (a ``_target_``, a qconfig ``object_type``, a non-traceable or custom-module class,
an observer) is checked by **identity, not spelling**:

1. it is resolved without side effects: the longest module prefix is taken from ``sys.modules`` or
   imported only when it lies in a trusted package; the rest of the path is looked up in the
   namespaces (``vars``) of that module and of classes only, never through another module, a
   property or a module ``__getattr__``;
2. the object found must belong to the explicit set of its kind (a LightningModule or
   LightningDataModule class of ``qlightning.examples``, a ``torch.nn.Module`` class of torch /
   torchao / qlightning, an observer class, an operator pattern of torch.ao's backend configs), or
   be defined in a module the user trusts (``trusted_modules=[mypkg]`` on the command line,
   ``QLIGHTNING_TRUSTED_MODULES``, or ``trusted_modules=`` in Python; never from inside a recipe);
3. the path must be the object's own name (``__module__`` + ``__qualname__``) or its re-export by a
   parent package (``torch.nn.Linear``), so an object reached through another module's imports
   (``torch.nn.modules.module.torch.load``, ``qlightning.run.app.Path``) is refused even where the
   object itself would be harmless.

Hydra's instantiation keywords other than ``_target_`` (``_args_``, ``_partial_``,
``_recursive_``, ``_convert_``) are refused anywhere, and ``_target_`` is accepted only as
``model._target_`` and ``data._target_``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import types
from typing import Any, Iterable, Iterator, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

ENV_VAR = "QLIGHTNING_TRUSTED_MODULES"
# Packages a path may make us import (their import has no side effects beyond loading code). Any
# other module is looked up only if something already imported it.
IMPORTABLE = ("qlightning.examples", "torch.nn", "torch.ao", "torchao", "torchmetrics", "lightning.pytorch")
# Where built-in objects of each kind may be defined.
MODULE_CLASS_HOMES = ("torch.nn.", "torch.ao.", "torchao.", "qlightning.examples.")
EXAMPLES_HOME = ("qlightning.examples.",)
HYDRA_KEYS = ("_target_", "_args_", "_partial_", "_recursive_", "_convert_")
TARGET_KEYS = ("model._target_", "data._target_")
KINDS = ("model", "data", "module_class", "object_type", "observer")
# Kept for callers that show the built-in set to a user.
BUILTIN_PREFIXES = tuple(p for p in MODULE_CLASS_HOMES)
DENIED_PREFIXES: tuple[str, ...] = ()  # nothing is denied by spelling any more: see resolve_object
KIND_TEXT = {
    "model": "a LightningModule class of qlightning.examples",
    "data": "a LightningDataModule class of qlightning.examples",
    "module_class": "a torch.nn.Module class of torch.nn, torch.ao, torchao or qlightning.examples",
    "object_type": "a torch.nn.Module class or an operator/function that torch.ao's backend configs quantize",
    "observer": "an observer or fake-quantize class of torch.ao",
}


class NotAllowed(Exception):
    """A path that does not name an allowed object; the message says why."""


class Unresolved(NotAllowed):
    """A path that names nothing (a typo): reported as such, not as a refusal."""


def user_trusted(user_modules: Iterable[str] = ()) -> tuple[str, ...]:
    """Module names the user trusts: ``QLIGHTNING_TRUSTED_MODULES`` plus ``user_modules``."""
    extra = [m for m in os.environ.get(ENV_VAR, "").replace(",", " ").split() if m]
    extra.extend(str(m) for m in user_modules)
    return tuple(m.strip().strip("'\"").rstrip(".") for m in extra if m.strip().strip("'\"").rstrip("."))


def trusted_from_overrides(overrides: Iterable[str]) -> list[str]:
    """The modules of a ``trusted_modules=[a,b]`` (or ``+``/``++``) command-line override."""
    for item in overrides:
        if str(item).lstrip("+").startswith("trusted_modules="):
            value = str(item).split("=", 1)[1].strip().strip("[]")
            return [v.strip().strip("'\"") for v in value.split(",") if v.strip().strip("'\"")]
    return []


def trusted_prefixes(user_modules: Iterable[str] = ()) -> tuple[str, ...]:
    """The built-in homes plus the user's trusted modules, each ending in ``.`` (for messages)."""
    return BUILTIN_PREFIXES + tuple(m + "." for m in user_trusted(user_modules))


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
    import operator

    import torch

    from qlightning.engines.fx.ao import backend_config_callables  # lazy: imports torch.ao

    found = {id(obj): obj for obj in backend_config_callables()}
    namespaces = {"torch": torch, "torch.nn.functional": torch.nn.functional, "operator": operator}
    for oid, obj in found.items():
        names = {f"{m}.{n}" for m, ns in namespaces.items() for n, v in vars(ns).items() if v is obj}
        if isinstance(obj, type):
            names.add(_canonical(obj))
        _PATTERNS[oid] = (obj, names)
    return _PATTERNS


def _in_kind(obj: Any, kind: str, trusted: tuple[str, ...]) -> bool:
    """Whether ``obj`` is in the explicit set of ``kind`` (or defined in a trusted module)."""
    module = getattr(obj, "__module__", None)
    if isinstance(module, str) and trusted and _under(module, trusted) and (isinstance(obj, type) or inspect.isfunction(obj)):
        return True
    if not isinstance(obj, type):
        return kind == "object_type" and id(obj) in pattern_objects()
    import lightning.pytorch as pl
    import torch

    if kind == "model":
        return issubclass(obj, pl.LightningModule) and _under(module, EXAMPLES_HOME)
    if kind == "data":
        return issubclass(obj, pl.LightningDataModule) and _under(module, EXAMPLES_HOME)
    if kind in ("module_class", "object_type"):
        return (issubclass(obj, torch.nn.Module) and _under(module, MODULE_CLASS_HOMES)) or (
            kind == "object_type" and id(obj) in pattern_objects())
    if kind == "observer":
        from qlightning.engines.fx.ao import observer_base_classes  # lazy: imports torch.ao

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


def resolve_object(path: Any, kind: str, user_modules: Iterable[str] = ()) -> Any:
    """The object ``path`` names, if it is in the explicit set of ``kind``; else :class:`NotAllowed`.

    Nothing is called and no module outside the trusted packages is imported.
    """
    if kind not in KINDS:
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
    if not _in_kind(obj, kind, trusted):
        raise NotAllowed(f"resolves to {_canonical(obj)}, which is not {KIND_TEXT[kind]}")
    # a trusted module's namespace is the user's choice: its re-exports of allowed objects count as spellings
    if not _spelled_right(path, module_name, obj) and not (trusted and _under(module_name, trusted)):
        raise NotAllowed(f"resolves to {_canonical(obj)} through another module; write that name instead")
    return obj


def not_allowed_message(key: str, path: Any, reason: Any, kind: str, source: Optional[str] = None) -> str:
    """The message of a refused (or unresolvable) path: key, value, why, what is expected."""
    where = f" in {source}" if source else ""
    if isinstance(reason, Unresolved):
        return f"{key}={path!r}{where}: cannot be resolved ({reason}); expected {KIND_TEXT[kind]}"
    return (f"{key}={path!r}{where}: not an allowed class ({reason}); expected {KIND_TEXT[kind]} "
            f"(trust your own package with trusted_modules=[...] on the command line or {ENV_VAR}; "
            "a recipe cannot widen this set)")


def _walk(node: Any, prefix: str = "") -> Iterator[tuple[str, str, Any]]:
    """``(key path, key, value)`` of every entry of a plain container tree."""
    if isinstance(node, dict):
        for key, value in node.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            yield path, str(key), value
            yield from _walk(value, path)
    elif isinstance(node, list):
        for i, item in enumerate(node):
            yield from _walk(item, f"{prefix}[{i}]")


def _plain(cfg: Any) -> Any:
    if isinstance(cfg, (DictConfig, ListConfig)):
        return OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)
    return cfg


def iter_class_paths(node: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """Yield ``(key path, class path)`` for every ``_target_`` in a config tree (without resolving it)."""
    for path, key, value in _walk(_plain(node), prefix):
        if key == "_target_":
            yield path, value if isinstance(value, str) else repr(value)


def check_class_paths(cfg: Any, user_modules: Iterable[str] = (), source: Optional[str] = None) -> list[str]:
    """Every Hydra instantiation key that a config may not hold, as one error message each.

    ``_target_`` is allowed as ``model._target_`` (a LightningModule) and ``data._target_`` (a
    LightningDataModule) only, as a literal string; ``_args_``, ``_partial_``, ``_recursive_`` and
    ``_convert_`` nowhere. Nothing is instantiated or called.
    """
    where = f" in {source}" if source else ""
    errors = []
    for path, key, value in _walk(_plain(cfg)):
        if key not in HYDRA_KEYS:
            continue
        if key != "_target_":
            errors.append(f"{path}{where}: {key} is a Hydra instantiation keyword a config may not use")
        elif path not in TARGET_KEYS:
            errors.append(f"{path}={value!r}{where}: _target_ is allowed only as model._target_ and data._target_ "
                          "(nested objects are built by your model's code, not by the config)")
        elif not isinstance(value, str):
            errors.append(f"{path}={value!r}{where}: not an allowed class (a _target_ is a literal dotted class path)")
        elif "${" in value:
            # resolved later, it could name anything: the path must be visible to this check
            errors.append(f"{path}={value!r}{where}: must be a literal dotted class path (no interpolation)")
        else:
            kind = path.split(".")[0]
            try:
                resolve_object(value, kind, user_modules)
            except NotAllowed as exc:
                errors.append(not_allowed_message(path, value, exc, kind, source))
    return errors
