"""Bounded YAML: a recipe is parsed with limits before OmegaConf (which expands every alias) sees it.

``yaml.SafeLoader`` builds only plain data, but neither it nor OmegaConf bounds the work: a file
of a million keys, or a "billion laughs" chain of aliases (each expanding to ten copies of the
previous one), runs for minutes and takes gigabytes. :func:`load_mapping` refuses, within
milliseconds, a file above :data:`MAX_BYTES`, a document of more than :data:`MAX_NODES` nodes
*counting every alias expansion* (what OmegaConf would build), more than :data:`MAX_ALIASES`
alias uses, nesting deeper than :data:`MAX_DEPTH`, and any document that is not a mapping.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Union

import yaml

from qlightning.errors import ConfigError

MAX_BYTES = 1 << 20  # 1 MiB: the shipped recipes are under 3 KiB
MAX_NODES = 10_000  # scalars + mappings + sequences after expanding aliases; shipped recipes: < 300
MAX_ALIASES = 1_000
MAX_DEPTH = 64


class _Limit(Exception):
    pass


class BoundedSafeLoader(yaml.SafeLoader):
    """``SafeLoader`` that counts nodes, alias uses and depth while composing, and stops at the limits.

    Args:
        stream: the YAML text or file, as ``yaml.SafeLoader`` takes it.
    """

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._nodes = 0
        self._aliases = 0
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        """``SafeLoader.compose_node``, counting the node (or alias use) and the depth first; past a limit it raises.

        Args:
            parent: the parent node, passed on to ``SafeLoader``.
            index: the key or position in the parent, passed on to ``SafeLoader``.
        """
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise _Limit(f"more than {MAX_ALIASES} alias uses (*name)")
        else:
            self._nodes += 1
            if self._nodes > MAX_NODES:
                raise _Limit(f"more than {MAX_NODES} nodes (keys, values and list items)")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _Limit(f"nesting deeper than {MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _expanded_size(root: yaml.Node) -> int:
    """Nodes after expanding every alias (shared nodes counted once per use), stopping past the limit."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        sizes[id(node)] = MAX_NODES + 1  # a node that contains itself (recursive alias) is over any limit
        if isinstance(node, yaml.MappingNode):
            total = 1 + sum(size(k) + size(v) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            total = 1 + sum(size(v) for v in node.value)
        else:
            total = 1
        sizes[id(node)] = total = min(total, MAX_NODES + 1)
        return total

    return size(root)


def load_mapping(source: Union[str, os.PathLike], where: str) -> dict:
    """The mapping a YAML file (``Path``) or text (``str``) holds, within the limits; else :class:`ConfigError`.

    Args:
        source: a path to a file, or the YAML text itself.
        where: how to name the source in messages, e.g. ``recipe 'x' (/path/x.yaml)``.
    """
    if isinstance(source, os.PathLike):
        path = Path(source)
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise ConfigError(f"{where}: cannot read: {exc.strerror or exc}") from None
        if size > MAX_BYTES:
            raise ConfigError(f"{where}: {size} bytes, above the limit of {MAX_BYTES} bytes for a recipe")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{where}: cannot read as UTF-8 text: {exc}") from None
    else:
        text = str(source)
        if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
            raise ConfigError(f"{where}: above the limit of {MAX_BYTES} bytes for a recipe")
    loader = BoundedSafeLoader(text)
    try:
        try:
            root = loader.get_single_node()
            if root is not None and _expanded_size(root) > MAX_NODES:
                raise _Limit(f"more than {MAX_NODES} nodes once aliases are expanded")
            data = loader.construct_document(root) if root is not None else None
        finally:
            loader.dispose()
    except _Limit as exc:
        raise ConfigError(f"{where}: refused: {exc}; a recipe is limited to {MAX_BYTES} bytes, {MAX_NODES} nodes, "
                          f"{MAX_ALIASES} aliases and {MAX_DEPTH} levels") from None
    except yaml.YAMLError as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise ConfigError(f"{where}: not valid YAML: {reason}") from None
    except RecursionError:
        raise ConfigError(f"{where}: refused: nesting too deep (limit {MAX_DEPTH} levels)") from None
    if not isinstance(data, dict):
        got = "an empty document" if data is None else f"a {type(data).__name__} ({str(data)[:60]!r})"
        raise ConfigError(f"{where}: a recipe must be a mapping of config keys (key: value lines), got {got}")
    bad_keys = [k for k in data if not isinstance(k, str)]
    if bad_keys:
        raise ConfigError(f"{where}: top-level keys must be strings, got {bad_keys[:5]!r}")
    return data
