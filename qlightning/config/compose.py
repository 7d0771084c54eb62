"""Compose the config the way `qlightning train` does, without running anything (validate, tests)."""

from __future__ import annotations

from typing import Optional, Sequence

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from qlightning import recipes_registry
from qlightning.config import store
from qlightning.errors import ConfigError


def compose_config(overrides: Sequence[str] = (), recipe: Optional[str] = None) -> DictConfig:
    """The composed ``train`` config for ``overrides`` (+ a recipe by name or path).

    Schema errors (unknown keys, wrong types, bad enum values) become :class:`ConfigError`.
    """
    overrides = list(overrides)
    trusted = [o.split("=", 1)[1].strip("[]") for o in overrides if o.startswith("trusted_modules=")]
    if recipe is not None:
        found = recipes_registry.find(recipe)
        store.register(found, [t.strip() for item in trusted for t in item.split(",") if t.strip()])
        overrides.append(f"recipe={found.name}")
    else:
        store.register()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="qlightning.conf", version_base="1.3"):
            return compose(config_name="train", overrides=overrides)
    except ConfigError:
        raise
    except Exception as exc:  # hydra's ConfigCompositionException, OmegaConf validation errors
        cause = exc.__cause__ or exc
        raise ConfigError(f"{type(cause).__name__}: {cause}".strip()) from None
    finally:
        GlobalHydra.instance().clear()
