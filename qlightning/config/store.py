"""Registers the schema and the recipes in Hydra's ConfigStore."""

from __future__ import annotations

from typing import Iterable, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from qlightning import recipes_registry
from qlightning.config.schema import TrainConfig

SCHEMA_NAME = "qlightning_schema"


def replaced_groups(recipe: Optional[recipes_registry.Recipe], user_trusted: Iterable[str] = ()) -> list[str]:
    """Groups (``model``, ``data``) whose class a recipe names: their default must be dropped, not merged into.

    Otherwise the default digits CNN's arguments (``channels``, ...) would reach another model class.

    Args:
        recipe: the selected recipe (loaded and checked as data); ``None`` replaces nothing.
        user_trusted: modules the user trusts, for the recipe's class-path check.
    """
    if recipe is None:
        return []
    node = recipes_registry.load(recipe, user_trusted)
    return [group for group in ("model", "data") if isinstance(node.get(group), DictConfig) and "_target_" in node[group]]


def register(extra_recipe: Optional[recipes_registry.Recipe] = None, user_trusted: Iterable[str] = ()) -> None:
    """Store the ``TrainConfig`` schema and every known recipe (group ``recipe``, package ``_global_``).

    Recipes are loaded (checked as data) only when they are the selected one, so a broken recipe
    elsewhere on the search path cannot stop another run.

    Args:
        extra_recipe: the selected recipe, loaded (checked as data) and stored under group ``recipe``;
            ``None`` stores the schema only.
        user_trusted: modules the user trusts, for the recipe's class-path check.
    """
    cs = ConfigStore.instance()
    cs.store(name=SCHEMA_NAME, node=TrainConfig)
    if extra_recipe is not None:
        node = recipes_registry.load(extra_recipe, user_trusted)
        node.pop("schema_version", None)
        cs.store(group="recipe", name=extra_recipe.name, node=node, package="_global_")
