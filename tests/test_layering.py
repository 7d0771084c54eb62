"""The package's shape: layers that each know only the one below.

Built from the source with ``ast`` (every import, module level and function local alike), so a
function-local import can no longer hide a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "qlightning"

# The layers, bottom up. An arrow may point down or stay inside a layer, never up.
LAYERS = [
    ("errors",),
    ("core.schedule", "core.inputs", "core.metrics", "core.quiet"),  # primitives every layer uses
    ("engines",),
    ("quantize",),
    ("core.session", "core"),
    ("callbacks",),
    ("run",),
    ("config", "recipes_registry"),
    ("run.app",),  # train(cfg): builds the callback from a config
    ("cli", "examples", "qconfigs", "equalization"),
    ("",),  # qlightning/__init__.py: the public API
]

# Which third-party libraries each part of the package may import.
ONLY_UNDER = {
    "torch.ao": ("engines.fx", "engines.pt2e", "examples"),
    "torchao": ("engines.pt2e",),
    "lightning": ("callbacks", "run", "cli", "config", "examples"),
}




def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports() -> dict[str, list[tuple[str, int]]]:
    """``{module: [(imported name, line)]}`` for every import statement anywhere in the module."""
    found: dict[str, list[tuple[str, int]]] = {}
    for path in ROOT.rglob("*.py"):
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        out: list[tuple[str, int]] = []
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ("qlightning." + package).split(".") if package else ["qlightning"]
                    base = base[: len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                out.append((target, node.lineno))
                out.extend((f"{target}.{alias.name}", node.lineno) for alias in node.names)
            elif isinstance(node, ast.Import):
                out.extend((alias.name, node.lineno) for alias in node.names)
        found[name] = out
    return found


MODULES = _imports()


def _internal(target: str) -> str | None:
    """The qlightning module an import names (``qlightning.a.b.C`` -> ``a.b`` if that is a module)."""
    if target != "qlightning" and not target.startswith("qlightning."):
        return None
    parts = target.split(".")[1:]
    while parts and ".".join(parts) not in MODULES:
        parts = parts[:-1]
    return ".".join(parts)


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, imports in MODULES.items():
        for target, _ in imports:
            dep = _internal(target)
            if dep is None or dep == module or dep == "":
                continue
            # a submodule always runs its package's __init__ first; that is an arrow only when it takes a
            # name defined there (``from qlightning.cli import internal_error`` inside cli.train), which a
            # package __init__ importing that submodule turns into a cycle
            if module.startswith(dep + ".") and target == f"qlightning.{dep}":
                continue
            graph[module].add(dep)
    return graph


def _layer(module: str) -> int:
    best, rank = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (p == "" and module == "") or (p and (module == p or module.startswith(p + "."))):
                if len(p) > best:
                    best, rank = len(p), i
    return rank


def test_no_import_cycle_inside_the_package():
    graph = _graph()
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_every_import_arrow_points_down_the_layers():
    upward = []
    for module, deps in _graph().items():
        for dep in deps:
            if _layer(dep) > _layer(module):
                upward.append(f"{module} ({LAYERS[_layer(module)][0] or 'api'}) -> {dep} ({LAYERS[_layer(dep)][0]})")
    assert not upward, "imports that point up a layer:\n" + "\n".join(sorted(upward))


@pytest.mark.parametrize("library", sorted(ONLY_UNDER))
def test_quantization_and_lightning_libraries_are_imported_only_by_their_layer(library):
    allowed = ONLY_UNDER[library]
    offenders = []
    for module, imports in MODULES.items():
        if any(module == a or module.startswith(a + ".") for a in allowed):
            continue
        for target, line in imports:
            if target == library or target.startswith(library + "."):
                offenders.append(f"qlightning/{module.replace('.', '/')}.py:{line} imports {target}")
    assert not offenders, f"{library} imported outside {allowed}:\n" + "\n".join(sorted(set(offenders)))


def test_engines_never_read_config_nor_name_config_keys():
    offenders = []
    for path in (ROOT / "engines").rglob("*.py"):
        text = path.read_text()
        for lineno, line in enumerate(text.splitlines(), 1):
            if "quant." in line and ("quant.engine" in line or "quant.modules" in line or "quant.qconfig" in line):
                offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    for module, imports in MODULES.items():
        if module.startswith("engines"):
            offenders += [f"{module} imports {t}" for t, _ in imports if t.startswith("qlightning.config")]
    assert not offenders, "\n".join(offenders)


def test_private_lightning_access_lives_in_one_module():
    offenders = []
    for path in ROOT.rglob("*.py"):
        if path.name == "lightning_compat.py":
            continue
        text = path.read_text()
        for needle in ("_MultiProcessingLauncher", "._data_source", "._parameters_to_prune", "._original_layers",
                       "_set_sampler_epoch", "._apply_batch_transfer_handler", "_recover_results_in_main_process",
                       "._start_method", "_WorkerOutput", "worker_output.", "._data_connector", "._parameter_names",
                       "_should_skip_saving_checkpoint", "._monitor_candidates", "._save_topk_checkpoint",
                       "._save_last_checkpoint", '"_trainer"', "._trainer"):
            if needle in text:
                offenders.append(f"{path.relative_to(ROOT)} uses {needle}")
    assert not offenders, "\n".join(offenders)


def test_engine_messages_name_arguments_and_the_config_layer_names_keys():
    """The Python API says ``engine='fx'``; the same problem from a recipe says ``quant.engine=fx``."""
    from qlightning import ConfigError, QuantizationAwareTraining
    from qlightning.config.build import build_callback
    from qlightning.config.compose import compose_config

    with pytest.raises(ConfigError) as python_api:
        QuantizationAwareTraining(engine="pt2e", backend="qnnpack")
    assert "backend='qnnpack'" in str(python_api.value) and "quant." not in str(python_api.value)
    cfg = compose_config(["quant.engine=pt2e", "quant.backend=qnnpack"])
    with pytest.raises(ConfigError) as from_config:
        build_callback(cfg)
    text = str(from_config.value)
    assert "quant.backend=qnnpack" in text or "quant.backend='qnnpack'" in text
    assert "quant.engine=fx" in text


ENGINE_NAMES = ("fx", "pt2e")


def _engine_name_literals(node: ast.AST) -> list[str]:
    """The engine names a comparison holds as string literals (``x == "fx"``, ``x in ("fx", "pt2e")``)."""
    found = []
    for side in [node.left, *node.comparators]:  # type: ignore[attr-defined]
        items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
        found += [i.value for i in items if isinstance(i, ast.Constant) and i.value in ENGINE_NAMES]
    return found


def test_no_module_outside_the_engines_compares_an_engine_name_to_a_literal():
    """Adding a third engine touches one folder: elsewhere an engine is asked (its class attributes), not named."""
    from qlightning.engines import ENGINES

    assert set(ENGINES) <= set(ENGINE_NAMES), "add the new engine's name to ENGINE_NAMES"
    offenders = []
    for path in ROOT.rglob("*.py"):
        if _module_name(path).startswith("engines"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Compare) and _engine_name_literals(node):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} compares with {_engine_name_literals(node)}")
    assert not offenders, "\n".join(sorted(offenders))
