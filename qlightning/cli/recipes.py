"""`qlightning recipes list | show NAME | validate NAME|PATH | cp NAME DEST | diff A B`."""

from __future__ import annotations

import argparse
import difflib
import shutil
import sys
from pathlib import Path
from typing import Sequence

from qlightning import recipes_registry
from qlightning.errors import ConfigError


def validate(name_or_path: str, overrides: Sequence[str] = ()) -> list[str]:
    """Every problem of a recipe, without training: schema, allowlist, schedule, module names.

    Builds the model (to check module names) but loads no data.

    Args:
        name_or_path: the recipe's name or file path.
        overrides: extra Hydra overrides, as for ``qlightning train``.

    Returns:
        The problems; empty when the recipe is valid.
    """
    from qlightning.config.compose import compose_config
    from qlightning.config.validate import validate_config

    try:
        cfg = compose_config(overrides, recipe=name_or_path)
    except ConfigError as exc:
        return exc.problems
    return validate_config(cfg)[0]


def from_checkpoint(path: str) -> str:
    """The resolved config, recipe identity and library versions stored in a QAT checkpoint, as YAML.

    Args:
        path: the checkpoint file (loaded with ``weights_only=True``); a missing file, or one without
            qlightning provenance, raises :class:`~qlightning.errors.ConfigError`.
    """
    import torch
    from omegaconf import OmegaConf

    from qlightning.callbacks.checkpoint import qat_state

    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ConfigError(f"--from {path!r}: no such file") from None
    try:
        provenance = dict(qat_state(checkpoint).get("provenance") or {})
    except Exception as exc:
        raise ConfigError(f"--from {path!r}: {exc}") from None
    if not provenance:
        raise ConfigError(f"--from {path!r}: the checkpoint carries no provenance (trained through the Python API?)")
    config = provenance.pop("config", {})
    header = [f"# recovered from {path}"]
    recipe = provenance.get("recipe") or {}
    if recipe:
        header.append(f"# recipe {recipe.get('name')} ({recipe.get('origin')}), sha256 {recipe.get('sha256')}")
    header.append("# versions: " + ", ".join(f"{k} {v}" for k, v in (provenance.get("versions") or {}).items()))
    return "\n".join(header) + "\n" + OmegaConf.to_yaml(OmegaConf.create(config))


def main(argv: Sequence[str]) -> int:
    """``qlightning recipes list | show | validate | cp | diff``.

    Args:
        argv: the command line after ``recipes``.

    Returns:
        0 on success; 1 when ``validate`` finds problems or ``cp`` would overwrite; 2 on a config error.
    """
    parser = argparse.ArgumentParser(prog="qlightning recipes", description="Shared recipes: list, show, validate, copy, diff.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="every recipe with where it comes from and the command that runs it")
    show = sub.add_parser("show", help="print a recipe, or with --from the resolved config a checkpoint was trained with")
    show.add_argument("recipe", nargs="?")
    show.add_argument("--from", dest="checkpoint", help="a checkpoint written by a QAT run")
    val = sub.add_parser("validate", help="check a recipe without training; exit 1 on any problem")
    val.add_argument("recipe")
    val.add_argument("overrides", nargs="*", default=[], help="extra Hydra overrides, as for `qlightning train`")
    cp = sub.add_parser("cp", help="copy a recipe to a file you can edit")
    cp.add_argument("recipe")
    cp.add_argument("dest")
    diff = sub.add_parser("diff", help="unified diff of two recipes")
    diff.add_argument("a")
    diff.add_argument("b")
    args = parser.parse_args(list(argv))
    try:
        if args.command == "list":
            for name, recipe in sorted(recipes_registry.discover().items()):
                print(f"{name:28s} {recipe.origin:12s} {recipe.command}")
        elif args.command == "show" and args.checkpoint:
            print(from_checkpoint(args.checkpoint), end="")
        elif args.command == "show":
            if not args.recipe:
                parser.error("show needs a recipe name or --from CHECKPOINT")
            print(recipes_registry.find(args.recipe).text, end="")
        elif args.command == "validate":
            problems = validate(args.recipe, args.overrides)
            if problems:
                print(f"{args.recipe}: {len(problems)} problem(s)", file=sys.stderr)
                for p in problems:
                    print(f"  - {p}", file=sys.stderr)
                return 1
            print(f"{args.recipe}: OK")
        elif args.command == "cp":
            recipe = recipes_registry.find(args.recipe)
            dest = Path(args.dest)
            if dest.is_dir():
                dest = dest / recipe.path.name
            if dest.exists():
                print(f"qlightning recipes cp: {dest} exists; not overwriting", file=sys.stderr)
                return 1
            shutil.copyfile(recipe.path, dest)
            print(f"copied {recipe.name} to {dest}; run it with: qlightning train recipe={dest}")
        elif args.command == "diff":
            a, b = recipes_registry.find(args.a), recipes_registry.find(args.b)
            sys.stdout.writelines(
                difflib.unified_diff(a.text.splitlines(True), b.text.splitlines(True), str(a.path), str(b.path))
            )
    except ConfigError as exc:
        print(f"qlightning recipes: {exc}", file=sys.stderr)
        return 2
    return 0
