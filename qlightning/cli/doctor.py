"""`qlightning doctor TARGET`: which submodules FX can trace, why the others cannot, which route fits.

TARGET is a model by import path (``pkg.module:Class``, built without arguments, or a factory) or
a recipe (``recipe=NAME``, a recipe name or a path to a YAML file; Hydra overrides may follow).
For a recipe the configured ``quant.modules`` are checked too, with the recipe's
non-traceable, standalone and custom module settings applied, and a dry prepare -> forward ->
convert -> int8 forward of a copy of the model on one batch (what ``qlightning recipes validate``
runs) finds what fails only at convert or in the int8 forward; by default on the fx engine (seconds;
PT2E's convert takes tens of seconds: ``--dry-run`` forces it). The exit status is 1 when a
configured module does not trace or the config or the dry run has a problem.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

from qlightning.errors import ConfigError


def _leaf_settings(callback: Any) -> tuple[list[str], list[type]]:
    """Names and classes FX keeps out of tracing under the callback's prepare custom config."""
    config = getattr(callback.spec, "prepare_custom_config", None) if callback is not None else None
    if config is None:
        return [], []
    names = list(config.non_traceable_module_names) + list(config.standalone_module_names)
    classes = list(config.non_traceable_module_classes) + list(config.standalone_module_classes)
    for mapping in config.float_to_observed_mapping.values():
        classes.extend(mapping)
    return names, classes


def _is_recipe(target: str) -> Optional[str]:
    if target.startswith("recipe="):
        return target.split("=", 1)[1]
    if ":" not in target and (target.endswith((".yaml", ".yml")) or Path(target).is_file()):
        return target
    if ":" not in target:
        from qlightning import recipes_registry

        try:
            recipes_registry.find(target)
            return target
        except Exception:
            return None
    return None


def main(argv: Sequence[str]) -> int:
    """``qlightning doctor``: report which submodules FX can trace and the route for the others.

    Args:
        argv: the command line after ``doctor``: ``pkg.mod:Class`` or ``recipe=NAME|PATH`` with its
            overrides, and ``--json``, ``--no-inputs``, ``--dry-run`` / ``--no-dry-run``.

    Returns:
        0 when all is well; 1 on a config problem or a configured submodule that does not trace; 2 when
        the target cannot be loaded or its config is invalid.
    """
    parser = argparse.ArgumentParser(
        prog="qlightning doctor",
        description="Trace every candidate submodule with torch.fx (top down) and say which route of the FX guide "
                    "fits each one that does not trace, with the config snippet for it.",
    )
    parser.add_argument("target", help="pkg.module:Class (a LightningModule or nn.Module), or recipe=NAME|PATH")
    parser.add_argument("overrides", nargs="*", default=[], help="Hydra overrides for a recipe, as for `qlightning train`")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-inputs", action="store_true",
                        help="do not run traced graphs on the model's example inputs")
    dry = parser.add_mutually_exclusive_group()
    dry.add_argument("--dry-run", action="store_true", default=None,
                     help="recipe: always dry-run prepare -> convert -> int8 forward (default: on the fx engine only)")
    dry.add_argument("--no-dry-run", dest="dry_run", action="store_false", help="recipe: skip the dry run")
    args = parser.parse_args(list(argv))

    from qlightning.quantize.doctor import check_targets, diagnose, load_target

    warnings.filterwarnings("ignore")
    recipe = _is_recipe(args.target)
    problems: list[str] = []
    callback = None
    dry_ran = False
    try:
        if recipe is not None:
            from qlightning.config.compose import compose_config
            from qlightning.config.validate import runs_dry, validate_config

            cfg = compose_config(args.overrides, recipe=recipe)
            problems, callback, model = validate_config(cfg, dry_run=args.dry_run)
            dry_ran = runs_dry(cfg, args.dry_run)
            if model is None:
                raise ConfigError(problems or ["model: could not be built"])
            label = f"recipe {recipe} (model {cfg.model.get('_target_')})"
            targets = list(callback.targets or []) if callback is not None else []
            if not targets:
                from qlightning.core.inputs import resolve_targets

                targets = resolve_targets(model, list(cfg.quant.modules), key="quant.modules")
        else:
            if args.overrides:
                parser.error("overrides are only accepted with a recipe")
            model = load_target(args.target)
            label, targets = args.target, []
    except ConfigError as exc:
        print(f"qlightning doctor: {exc}", file=sys.stderr)
        return 2
    except (ImportError, AttributeError, ValueError, TypeError) as exc:
        print(f"qlightning doctor: cannot load {args.target!r}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2

    report = diagnose(model, check_inputs=not args.no_inputs, name=label)
    if targets:
        names, classes = _leaf_settings(callback)
        report.configured = check_targets(model, targets, names, classes)
    if args.json:
        data = json.loads(report.to_json())
        data["config_problems"] = problems
        print(json.dumps(data, indent=2))
    else:
        print(report.to_text(), end="")
        for problem in problems:
            print(f"config problem: {problem}")
        if recipe is not None and not problems and dry_ran:
            print("dry run (prepare -> forward -> convert -> int8 forward on one batch): ok")
    return 1 if problems or any(not c["traces"] for c in report.configured) else 0
