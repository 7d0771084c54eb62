"""What a config may name as code: a recipe is data, never a way to run arbitrary code.

Every ``_target_`` (and every class path) must live under an allowed module prefix. Built-in
prefixes cover torch, torchao, torchmetrics, lightning and qlightning itself; a user widens the
list on the command line (``trusted_modules=[mypkg]``) or through ``QLIGHTNING_TRUSTED_MODULES``,
never from inside a recipe.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Iterator, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

BUILTIN_PREFIXES = (
    "qlightning.",
    "torch.nn.",
    "torch.ao.",
    "torch.optim.",
    "torchao.",
    "torchmetrics.",
    "lightning.pytorch.callbacks.",
    "lightning.pytorch.loggers.",
)
# Never allowed, whatever a user trusts: names that run code, touch the system or deserialize.
DENIED_PREFIXES = ("os.", "sys.", "subprocess.", "builtins.", "importlib.", "pickle.", "shutil.", "socket.",
                   "ctypes.", "runpy.", "code.", "marshal.", "posix.", "pty.", "torch.hub.", "hydra.utils.")
ENV_VAR = "QLIGHTNING_TRUSTED_MODULES"
CLASS_KEYS = ("_target_",)


def trusted_prefixes(user_modules: Iterable[str] = ()) -> tuple[str, ...]:
    extra = [m for m in os.environ.get(ENV_VAR, "").replace(",", " ").split() if m]
    extra.extend(user_modules)
    return BUILTIN_PREFIXES + tuple(m.rstrip(".") + "." for m in extra)


def is_allowed(path: str, prefixes: Iterable[str]) -> bool:
    path = str(path)
    if path.startswith(DENIED_PREFIXES) or "." not in path:
        return False
    return any(path.startswith(p) for p in prefixes)


def iter_class_paths(node: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """Yield ``(key path, class path)`` for every ``_target_`` in a config tree (without resolving it)."""
    if isinstance(node, DictConfig):
        for key in node.keys():
            value = node._get_node(key)
            path = f"{prefix}.{key}" if prefix else str(key)
            if key in CLASS_KEYS:
                yield path, str(OmegaConf.to_container(node, resolve=False)[key]) if value is not None else ""
            else:
                yield from iter_class_paths(node[key] if not OmegaConf.is_missing(node, key) else None, path)
    elif isinstance(node, ListConfig):
        for i, item in enumerate(node):
            yield from iter_class_paths(item, f"{prefix}[{i}]")
    elif isinstance(node, dict):
        for key, value in node.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            if key in CLASS_KEYS:
                yield path, str(value)
            else:
                yield from iter_class_paths(value, path)
    elif isinstance(node, list):
        for i, item in enumerate(node):
            yield from iter_class_paths(item, f"{prefix}[{i}]")


def check_class_paths(cfg: Any, user_modules: Iterable[str] = (), source: Optional[str] = None) -> list[str]:
    """Every ``_target_`` outside the allowlist, as one error message each."""
    prefixes = trusted_prefixes(user_modules)
    where = f" in {source}" if source else ""
    return [
        f"{key}={value!r}{where}: not an allowed class; allowed module prefixes: "
        f"{sorted(p.rstrip('.') for p in prefixes)} (trust more with trusted_modules=[...] on the command line "
        f"or {ENV_VAR}; a recipe cannot widen this list)"
        for key, value in iter_class_paths(cfg)
        if not is_allowed(value, prefixes)
    ]
