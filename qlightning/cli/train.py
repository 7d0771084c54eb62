"""`qlightning train`: a thin Hydra wrapper around :func:`qlightning.run.app.train`."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from qlightning import recipes_registry
from qlightning.config import store
from qlightning.config.allowlist import trusted_from_overrides
from qlightning.errors import ConfigError, QLightningError

_state: dict = {}


def prepare_overrides(overrides: Sequence[str]) -> tuple[list[str], Optional[recipes_registry.Recipe]]:
    """Resolve ``recipe=NAME|PATH``: check the recipe as data and register it for Hydra.

    Args:
        overrides: the ``qlightning train`` command line; a ``recipe=`` item is rewritten to the recipe's
            name, and ``~model`` / ``~data`` are added for groups the recipe replaces (unless chosen).

    Returns:
        ``(overrides for Hydra, the recipe or None)``.
    """
    out, recipe = [], None
    chosen = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    for item in overrides:
        if item.startswith("recipe="):
            recipe = recipes_registry.find(item.split("=", 1)[1])
            trusted = trusted_from_overrides(overrides)
            store.register(recipe, trusted)
            out += [f"~{g}" for g in store.replaced_groups(recipe, trusted) if g not in chosen]
            item = f"recipe={recipe.name}"
        out.append(item)
    if recipe is None:
        store.register()
    return out, recipe


@hydra.main(version_base="1.3", config_path="pkg://qlightning.conf", config_name="train")
def _hydra_main(cfg: DictConfig) -> None:
    from qlightning.cli.console import route_logging
    from qlightning.run.app import train

    route_logging()
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    provenance = recipes_registry.provenance(_state.get("recipe"))
    try:
        train(cfg, run_dir, provenance=provenance)
    except ConfigError as exc:
        print(f"qlightning: configuration error\n{exc}", file=sys.stderr)
        sys.exit(2)
    except QLightningError as exc:  # e.g. a parity breach; report.json is already written
        print(f"qlightning: {exc}", file=sys.stderr)
        sys.exit(1)
    except Exception as exc:
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        from qlightning.cli.console import debugging, internal_error

        if isinstance(exc, MisconfigurationException) and not debugging():  # Lightning refusing a Trainer setting
            print(f"qlightning: configuration error\n{' '.join(str(exc).split())}", file=sys.stderr)
            sys.exit(2)
        sys.exit(internal_error(exc))


def _precheck(overrides: Sequence[str], recipe: Optional[recipes_registry.Recipe]) -> None:
    """Compose once like Hydra will, to report every schema error at once (single runs only)."""
    from qlightning.config.compose import compose_config

    plain = [o for o in overrides if not o.startswith(("-", "recipe=", "hydra.", "~")) and "=" in o]
    compose_config(plain, recipe=str(recipe.path) if recipe is not None else None)


def main(argv: Sequence[str]) -> int:
    """``qlightning train``: check the overrides (all schema errors at once), then run the Hydra app.

    Args:
        argv: Hydra overrides and flags (``-m``, ``--help``, ``--cfg``, ... skip the precheck).

    Returns:
        0 after the Hydra app returns; 2 on a configuration error found before it starts (errors inside
        the app exit the process with their own status).
    """
    try:
        overrides, recipe = prepare_overrides(argv)
        if not any(a in ("-m", "--multirun", "--help", "-h", "--hydra-help", "--info") or a.startswith("--cfg") for a in argv):
            _precheck(overrides, recipe)
    except ConfigError as exc:
        print(f"qlightning: configuration error\n{exc}", file=sys.stderr)
        return 2
    _state["recipe"] = recipe
    # sys.argv[0] is a real file: Lightning's ddp strategy re-launches `python sys.argv[0] sys.argv[1:]`
    # for the other local ranks (or `python -m qlightning.cli.__main__ ...` under `python -m`)
    sys.argv = [str(Path(__file__).with_name("__main__.py")), *overrides]
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")  # --debug (qlightning.cli.main) sets it to 1
    _hydra_main()
    return 0
