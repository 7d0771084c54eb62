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

from typing import Any, Iterable, Iterator, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

from qlightning.engines import names
from qlightning.engines.names import (  # noqa: F401  (re-exported: the rules are one, the config adds its kinds)
    ENV_VAR,
    IMPORTABLE,
    MODULE_CLASS_HOMES,
    NotAllowed,
    Unresolved,
    pattern_objects,
    user_trusted,
)

EXAMPLES_HOME = ("qlightning.examples.",)
HYDRA_KEYS = ("_target_", "_args_", "_partial_", "_recursive_", "_convert_")
TARGET_KEYS = ("model._target_", "data._target_")
KINDS = ("model", "data", *names.KINDS)
# Kept for callers that show the built-in set to a user.
BUILTIN_PREFIXES = tuple(p for p in MODULE_CLASS_HOMES)
DENIED_PREFIXES: tuple[str, ...] = ()  # nothing is denied by spelling any more: see resolve_object


def _example_subclass(base: str) -> Any:
    """Is-of-kind for ``model`` / ``data``: a ``lightning.pytorch`` ``base`` subclass defined in qlightning.examples."""

    def check(obj: Any) -> bool:
        import lightning.pytorch as pl  # lazy: heavy, and only a model/data _target_ needs it

        return issubclass(obj, getattr(pl, base)) and names._under(getattr(obj, "__module__", ""), EXAMPLES_HOME)

    return check


#: the kinds only a Hydra config names (a ``_target_``), beside the engines' (:data:`qlightning.engines.names.KINDS`)
CONFIG_KINDS = {
    "model": (_example_subclass("LightningModule"), "a LightningModule class of qlightning.examples"),
    "data": (_example_subclass("LightningDataModule"), "a LightningDataModule class of qlightning.examples"),
}
KIND_TEXT = {**{k: text for k, (_, text) in CONFIG_KINDS.items()}, **names.KIND_TEXT}


def resolve_object(path: Any, kind: str, user_modules: Iterable[str] = ()) -> Any:
    """The object ``path`` names, if it is in the explicit set of ``kind``; else :class:`NotAllowed`.

    Nothing is called and no module outside the trusted packages is imported
    (:func:`qlightning.engines.names.resolve_object`, with the config's ``model`` and ``data`` kinds).

    Args:
        path: the dotted path, e.g. ``qlightning.examples.DigitsClassifier``.
        kind: one of :data:`KINDS`.
        user_modules: modules the user trusts besides ``QLIGHTNING_TRUSTED_MODULES``.
    """
    return names.resolve_object(path, kind, user_modules, CONFIG_KINDS)


def not_allowed_message(key: str, path: Any, reason: Any, kind: str, source: Optional[str] = None) -> str:
    """The message of a refused (or unresolvable) path: key, value, why, what is expected.

    Args:
        key: the config key that holds the path.
        path: the path as given.
        reason: the :class:`NotAllowed` raised for it.
        kind: the kind the path was to name.
        source: the file it came from, if any.
    """
    return names.not_allowed_message(key, path, reason, kind, source, CONFIG_KINDS)


def trusted_from_overrides(overrides: Iterable[str]) -> list[str]:
    """The modules of a ``trusted_modules=[a,b]`` (or ``+``/``++``) command-line override.

    Args:
        overrides: the command line's Hydra overrides.
    """
    for item in overrides:
        if str(item).lstrip("+").startswith("trusted_modules="):
            value = str(item).split("=", 1)[1].strip().strip("[]")
            return [v.strip().strip("'\"") for v in value.split(",") if v.strip().strip("'\"")]
    return []


def trusted_prefixes(user_modules: Iterable[str] = ()) -> tuple[str, ...]:
    """The built-in homes plus the user's trusted modules, each ending in ``.`` (for messages).

    Args:
        user_modules: modules the user trusts besides ``QLIGHTNING_TRUSTED_MODULES``.
    """
    return BUILTIN_PREFIXES + tuple(m + "." for m in user_trusted(user_modules))


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
    """Yield ``(key path, class path)`` for every ``_target_`` in a config tree (without resolving it).

    Args:
        node: a config tree (OmegaConf node or plain containers).
        prefix: the key path of ``node`` in the whole config.
    """
    for path, key, value in _walk(_plain(node), prefix):
        if key == "_target_":
            yield path, value if isinstance(value, str) else repr(value)


def check_class_paths(cfg: Any, user_modules: Iterable[str] = (), source: Optional[str] = None) -> list[str]:
    """Every Hydra instantiation key that a config may not hold, as one error message each.

    ``_target_`` is allowed as ``model._target_`` (a LightningModule) and ``data._target_`` (a
    LightningDataModule) only, as a literal string; ``_args_``, ``_partial_``, ``_recursive_`` and
    ``_convert_`` nowhere. Nothing is instantiated or called.

    Args:
        cfg: the config tree to check.
        user_modules: modules the user trusts besides ``QLIGHTNING_TRUSTED_MODULES``.
        source: the file the config came from, for messages.
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
