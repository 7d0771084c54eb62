"""One registry of recipes feeding `qlightning train recipe=...` and `qlightning recipes ...`.

A recipe is a YAML file of config values (no code): shipped ones live in ``recipes/`` (the
``qlightning.recipes`` package), other installed packages add theirs through the entry point
group ``qlightning.recipes`` (value: an importable package holding ``*.yaml`` files), and any
file path works too. Every recipe is checked as data before Hydra sees it.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.metadata
import importlib.resources
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

from omegaconf import DictConfig, OmegaConf

from qlightning.config.allowlist import check_class_paths
from qlightning.config.checkpoint_check import is_remote
from qlightning.config.safe_yaml import MAX_BYTES, load_mapping
from qlightning.config.schema import SCHEMA_VERSION
from qlightning.errors import ConfigError

ENTRY_POINT_GROUP = "qlightning.recipes"
# What each schema version changed, so a recipe of another version gets told what to fix.
SCHEMA_CHANGES = {1: "the first schema (quant.*, trainer.*, data, model, checkpoint, report, export, parity)"}
# Keys a recipe may not set: they would widen the allowlist, admit remote checkpoints or reach into
# Hydra itself (hydra.callbacks and hydra.job.env_set can run code or change the environment).
FORBIDDEN_KEYS = ("trusted_modules", "allow_remote_ckpt", "hydra", "defaults")


@dataclass(frozen=True)
class Recipe:
    name: str
    path: Path
    origin: str  # "qlightning", the providing package, or "file"

    @property
    def text(self) -> str:
        return self.path.read_text()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()

    @property
    def command(self) -> str:
        first = self.text.splitlines()[0] if self.text else ""
        return first.lstrip("# ").strip()


def _yaml_files(package: str) -> list[Path]:
    try:
        root = importlib.resources.files(package)
    except (ModuleNotFoundError, TypeError):
        return []
    return sorted(Path(str(p)) for p in root.iterdir() if p.name.endswith(".yaml"))


def discover() -> dict[str, Recipe]:
    """All recipes by name: shipped ones, then those of installed packages (first one wins)."""
    found: dict[str, Recipe] = {}
    for path in _yaml_files("qlightning.recipes"):
        found.setdefault(path.stem, Recipe(path.stem, path, "qlightning"))
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        for path in _yaml_files(ep.value):
            found.setdefault(path.stem, Recipe(path.stem, path, ep.dist.name if ep.dist else ep.value))
    return found


def find(name_or_path: str) -> Recipe:
    """A recipe by registered name or by path to a YAML file."""
    recipes = discover()
    if name_or_path in recipes:
        return recipes[name_or_path]
    path = Path(name_or_path).expanduser()
    if path.suffix in (".yaml", ".yml") or "/" in name_or_path:
        if not path.is_file():
            raise ConfigError(f"recipe={name_or_path!r}: no such file")
        if path.stat().st_size > MAX_BYTES:
            raise ConfigError(f"recipe={name_or_path!r}: {path.stat().st_size} bytes, above the limit of {MAX_BYTES} bytes for a recipe")
        return Recipe(path.stem, path.resolve(), "file")
    close = difflib.get_close_matches(name_or_path, list(recipes), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(f"recipe={name_or_path!r}: unknown recipe{hint}; available: {sorted(recipes)} (or give a path to a .yaml file)")


def load(recipe: Recipe, user_trusted: Iterable[str] = ()) -> DictConfig:
    """Parse and check a recipe as data; every problem is reported in one :class:`ConfigError`."""
    where = f"recipe {recipe.name!r} ({recipe.path})"
    data = load_mapping(recipe.path, where)  # bounded: size, nodes, aliases, depth; a mapping
    try:
        node = OmegaConf.create(data)
    except Exception as exc:  # values OmegaConf cannot hold (!!binary, dates, ...)
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise ConfigError(f"{where}: not a config OmegaConf can hold: {reason.split(' full_key:')[0]}") from None
    errors = [f"{where}: sets {key!r}, which a recipe may not set" for key in FORBIDDEN_KEYS if key in node]
    errors += check_class_paths(node, user_trusted, source=where)
    ckpt = node._get_node("ckpt_path")._value() if "ckpt_path" in node else None
    if ckpt is not None and (not isinstance(ckpt, str) or "${" in ckpt or is_remote(ckpt)):
        # a URL (or what an interpolation could turn into one) only from the command line, with allow_remote_ckpt=true
        errors.append(f"{where}: ckpt_path={ckpt!r}: a remote checkpoint is refused in a recipe; a recipe names a local file "
                      "(literal path); give a URL on the command line with allow_remote_ckpt=true")
    version = node.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        if isinstance(version, int) and version > SCHEMA_VERSION:
            what = f"it was written for a newer qlightning; upgrade qlightning, or rewrite it for version {SCHEMA_VERSION}"
        else:
            what = "; ".join(f"version {v}: {change}" for v, change in SCHEMA_CHANGES.items())
        errors.append(f"{where}: schema_version={version!r}, this qlightning reads schema_version {SCHEMA_VERSION} ({what})")
    if errors:
        raise ConfigError(errors)
    return node


def provenance(recipe: Optional[Recipe]) -> dict[str, Any]:
    """Versions of the libraries that shape a quantized model, plus the recipe's identity."""
    versions = {}
    for dist in ("torch", "lightning", "torchao", "qlightning", "hydra-core"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    info: dict[str, Any] = {"versions": versions, "recipe": None}
    if recipe is not None:
        info["recipe"] = {"name": recipe.name, "origin": recipe.origin, "path": str(recipe.path), "sha256": recipe.sha256}
    return info
