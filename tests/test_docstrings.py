"""Every argument of the public callbacks is documented: the Args section of the class docstring
names each parameter of ``__init__``, and nothing that is not one."""

from __future__ import annotations

import inspect
import re

import pytest

from qlightning import PostTrainingQuantization, QuantizationAwareTraining


def documented_args(cls: type) -> list[str]:
    """The names in the Google-style ``Args:`` section of ``cls``'s docstring (``a / b:`` counts both)."""
    doc = inspect.getdoc(cls) or ""
    section = re.search(r"^Args:\n((?:(?:    .*)?\n)+?)(?=^\S|\Z)", doc + "\n", re.M)
    assert section, f"{cls.__name__} has no Args section"
    names = []
    for line in section.group(1).splitlines():
        match = re.match(r"^    (\w+(?:\s*/\s*\w+)*)(?: \(.*?\))?:", line)
        if match:
            names += [n.strip() for n in match.group(1).split("/")]
    return names


@pytest.mark.parametrize("cls", [QuantizationAwareTraining, PostTrainingQuantization], ids=lambda c: c.__name__)
def test_the_callback_docstring_lists_every_init_argument(cls):
    params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    documented = documented_args(cls)
    assert not set(params) - set(documented), f"undocumented: {sorted(set(params) - set(documented))}"
    assert not set(documented) - set(params), f"documented but not arguments: {sorted(set(documented) - set(params))}"
    assert len(documented) == len(set(documented)), "an argument documented twice"


# Modules whose every public function, class and method documents all its arguments (Google style); a
# module joins the list once it does, and does not leave it.
DOCUMENTED = [
    "callbacks/*.py", "core/*.py", "engines/__init__.py",
    "engines/base.py", "engines/names.py", "engines/fx/*.py", "engines/pt2e/engine.py",
    "quantize/*.py",
    "run/*.py", "config/*.py", "cli/*.py",
]


def _params(fn: "ast.FunctionDef") -> list[str]:
    args = fn.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg not in ("self", "cls")]
    return names + [a.arg for a in (args.vararg, args.kwarg) if a is not None]


def _args_section(doc: str) -> list[str]:
    section = re.search(r"^\s*Args:\n((?:(?:[ \t]+.*)?\n)+?)(?=^\s*\S+:\s*$|^\S|\Z)", doc + "\n", re.M)
    if section is None:
        return []
    return [n.strip() for line in section.group(1).splitlines()
            for m in [re.match(r"^\s+(\w+(?:\s*/\s*\w+)*)(?: \(.*?\))?:", line)] if m for n in m.group(1).split("/")]


def _undocumented(path: "Path") -> list[str]:
    import ast

    problems = []

    def check(fn: ast.FunctionDef, where: str) -> None:
        doc = ast.get_docstring(fn)
        if not doc:
            problems.append(f"{where}: no docstring")
            return
        missing = [p for p in _params(fn) if p not in _args_section(doc)]
        if missing:
            problems.append(f"{where}: Args does not list {missing}")

    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            check(node, f"{path.name}:{node.lineno} {node.name}")
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            if not ast.get_docstring(node):
                problems.append(f"{path.name}:{node.lineno} class {node.name}: no docstring")
            for item in node.body:
                overrides = any(getattr(d, "id", getattr(d, "attr", "")) in ("override", "property", "setter")
                                for d in item.decorator_list) if isinstance(item, ast.FunctionDef) else True
                if isinstance(item, ast.FunctionDef) and not item.name.startswith("_") and not overrides:
                    check(item, f"{path.name}:{item.lineno} {node.name}.{item.name}")
    return problems


def test_public_functions_of_the_documented_modules_list_all_their_arguments():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "qlightning"
    paths = sorted({p for pattern in DOCUMENTED for p in root.glob(pattern)})
    assert len(paths) >= len(DOCUMENTED)
    problems = [p for path in paths for p in _undocumented(path)]
    assert not problems, "\n".join(problems)
