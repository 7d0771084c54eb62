"""The README's configuration reference, generated from the schema (never hand-copied).

``python -m qlightning.config.reference`` prints it; ``--write README.md`` replaces the block
between the markers; a test fails when the README and the schema disagree.
"""

from __future__ import annotations

import argparse
import re
import dataclasses
import enum
import typing
from pathlib import Path
from typing import Any, Iterator

from qlightning.config.schema import TrainConfig

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _type_name(args[0]) + " \\| null" if len(args) == 1 else "any"
    if origin in (list, typing.List):
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    if origin in (dict, typing.Dict):
        return "mapping"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " \\| ".join(m.value for m in tp)
    return {int: "int", float: "float", str: "str", bool: "bool"}.get(tp, "any")


def _default(value: Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if dataclasses.is_dataclass(value):
        return ""
    if isinstance(value, list):
        value = [v.value if isinstance(v, enum.Enum) else v for v in value]
    return "null" if value is None else str(value).replace("'", "").replace("True", "true").replace("False", "false")


def rows(instance: Any = None, prefix: str = "") -> Iterator[tuple[str, str, str, str]]:
    """(key, type, default, help) of every leaf, defaults taken from a default instance.

    A nested dataclass yields a ``"section"`` row first, then its own fields.

    Args:
        instance: the config dataclass instance to walk; ``None`` uses ``TrainConfig()``.
        prefix: prepended to every key (``"quant."`` for a nested section).
    """
    instance = TrainConfig() if instance is None else instance
    hints = typing.get_type_hints(type(instance))
    for field in dataclasses.fields(instance):
        key = f"{prefix}{field.name}"
        value = getattr(instance, field.name)
        help_text = field.metadata.get("help", "")
        if dataclasses.is_dataclass(value):
            yield key, "section", "", help_text
            yield from rows(value, key + ".")
        else:
            yield key, _type_name(hints[field.name]), _default(value), help_text


def markdown() -> str:
    """The README's configuration reference: a markdown table of every leaf key, between its markers."""
    lines = [START, "", "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for key, tp, default, help_text in rows():
        if tp == "section":
            continue
        lines.append(f"| `{key}` | {tp} | {f'`{default}`' if default else ''} | {help_text} |")
    return "\n".join(lines + ["", END])


RECIPES_START, RECIPES_END = "<!-- recipe-table:start -->", "<!-- recipe-table:end -->"


def recipe_summary(text: str) -> str:
    """A recipe's header comment after its command line, up to the end of the first sentence.

    Args:
        text: the recipe file's text; its first line is skipped, and ``|`` is escaped for a table cell.
    """
    lines = []
    for line in text.splitlines()[1:]:
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    prose = " ".join(lines)
    end = re.search(r"(?<!\bal)\.\s+(?=[A-Z])", prose)  # "Nagel et al. 2019" is not a sentence end
    return (prose[: end.start() + 1] if end else prose).replace("|", "\\|")


def recipe_markdown() -> str:
    """The README's table of shipped recipes, from the recipes themselves."""
    from qlightning import recipes_registry

    lines = [RECIPES_START, "", "| recipe | what |", "| --- | --- |"]
    for name, recipe in sorted(recipes_registry.discover().items()):
        if recipe.origin == "qlightning":
            lines.append(f"| `{name}` | {recipe_summary(recipe.text)} |")
    return "\n".join(lines + ["", RECIPES_END])


def write(readme: Path) -> bool:
    """Replace the generated blocks (configuration reference, recipe table) in ``readme``.

    Args:
        readme: the README file, rewritten in place; it must hold both blocks' markers.

    Returns:
        Whether the text changed.
    """
    text = readme.read_text()
    new = text
    for (first, last), body in (((START, END), markdown()), ((RECIPES_START, RECIPES_END), recipe_markdown())):
        start, end = new.index(first), new.index(last) + len(last)
        new = new[:start] + body + new[end:]
    readme.write_text(new)
    return new != text


def main() -> None:
    """``python -m qlightning.config.reference``: print the reference table, or with ``--write README`` update it."""
    parser = argparse.ArgumentParser(prog="python -m qlightning.config.reference")
    parser.add_argument("--write", type=Path, help="replace the reference block in this README")
    args = parser.parse_args()
    if args.write:
        write(args.write)
    else:
        print(markdown())


if __name__ == "__main__":
    main()
