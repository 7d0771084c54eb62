"""Compose the config the way `qlightning train` does, without running anything (validate, tests)."""

from __future__ import annotations

import difflib
from typing import Any, Optional, Sequence

from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from qlightning import recipes_registry
from qlightning.config import store
from qlightning.config.allowlist import trusted_from_overrides
from qlightning.config.schema import TrainConfig
from qlightning.config.validate import describe, static_problems, validate_config
from qlightning.errors import ConfigError


def compose_config(overrides: Sequence[str] = (), recipe: Optional[str] = None) -> DictConfig:
    """The composed ``train`` config for ``overrides`` (+ a recipe by name or path).

    Schema errors (unknown keys, wrong types, bad enum values) become :class:`ConfigError`.

    Args:
        overrides: Hydra command-line overrides (``key=value``, ``+key=value``, ``~key``).
        recipe: a recipe's name or path; its groups replace the defaults that ``overrides`` do not choose.
    """
    overrides = list(overrides)
    if recipe is not None:
        found = recipes_registry.find(recipe)
        trusted_list = trusted_from_overrides(overrides)
        store.register(found, trusted_list)
        chosen = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
        overrides += [f"~{g}" for g in store.replaced_groups(found, trusted_list) if g not in chosen]
        overrides.append(f"recipe={found.name}")
    else:
        store.register()
    try:
        return _compose(overrides)
    except ConfigError:
        raise
    except Exception as exc:  # hydra's ConfigCompositionException, OmegaConf validation errors
        first = describe(exc)
    # The schema stops at its first error; compose again without it and check every value alone,
    # so the user sees all of them at once.
    cs = ConfigStore.instance()
    cs.store(name=store.SCHEMA_NAME, node={})
    groups = ("data", "model", "recipe")
    forced = [o if o.startswith(("+", "~")) or o.split("=", 1)[0] in groups else f"++{o}" for o in overrides]
    try:
        untyped = _compose(forced)
    except Exception:
        raise ConfigError(first) from None
    finally:
        store.register()
    problems, bad = schema_errors(untyped, with_paths=True)
    # the semantic checks that need no schema (targets, Trainer values, interpolations) in the same round
    try:
        problems += [p for p in static_problems(untyped) if p not in problems]
    except Exception:  # an untyped config can hold anything; the schema errors above are the news
        pass
    # ... and those that need a typed config (callback arguments, schedule order, module names), on the
    # config without its ill-typed values, so that a user fixes every problem in one round (validate_config
    # checks every _target_ against the allowlist before it builds anything)
    try:
        semantic, _, _ = validate_config(_typed_without(untyped, bad), dry_run=False)
        problems += [p for p in semantic if p not in problems]
    except Exception:  # the schema errors above are the news
        pass
    raise ConfigError(problems or [first]) from None


def _typed_without(untyped: DictConfig, bad_paths: list[str]) -> DictConfig:
    """``untyped`` merged into the schema, leaving out the values at ``bad_paths`` (their defaults stay)."""
    container = OmegaConf.to_container(untyped, resolve=False)
    container.pop("hydra", None)
    for path in bad_paths:
        *parents, leaf = path.split(".")
        node: Any = container
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return OmegaConf.merge(OmegaConf.structured(TrainConfig), container)


def _compose(overrides: list[str]) -> DictConfig:
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="qlightning.conf", version_base="1.3"):
            return compose(config_name="train", overrides=overrides)
    finally:
        GlobalHydra.instance().clear()


def _leaves(node: Any, schema: Any, path: str) -> list[tuple[str, Any]]:
    if isinstance(node, dict) and isinstance(schema, DictConfig) and OmegaConf.get_type(schema) not in (dict, None):
        out = []
        for key, value in node.items():
            child = schema._get_node(key) if key in schema else None
            out.extend(_leaves(value, child, f"{path}.{key}" if path else str(key)))
        return out
    return [(path, node)]


def schema_errors(untyped: DictConfig, with_paths: bool = False) -> Any:
    """Check each value of an untyped config against :class:`TrainConfig` on its own.

    Returns the problems, or with ``with_paths`` ``(problems, key paths of the bad values)``.

    Args:
        untyped: the config composed without the schema (its ``hydra`` node is ignored).
        with_paths: also return the dotted key paths of the values that failed.
    """
    schema = OmegaConf.structured(TrainConfig)
    container = OmegaConf.to_container(untyped, resolve=False)
    container.pop("hydra", None)
    problems, bad = [], []
    for path, value in _leaves(container, schema, ""):
        nested: Any = value
        for part in reversed(path.split(".")):
            nested = {part: nested}
        try:
            OmegaConf.merge(schema, nested)
        except Exception as exc:
            message = describe(exc)
            parent_path, _, key = path.rpartition(".")
            parent = OmegaConf.select(schema, parent_path) if parent_path else schema
            if "not in" in message and isinstance(parent, DictConfig):
                hint = difflib.get_close_matches(key, [str(k) for k in parent.keys()], n=1)
                message += f" (did you mean {hint[0]!r}?)" if hint else f"; valid keys: {sorted(parent.keys())}"
            problems.append(message)
            bad.append(path)
    return (problems, bad) if with_paths else problems
