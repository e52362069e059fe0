"""The package's layering: imports go down the layers (docs/project-layout.md), no import cycle between
megatron_moe's subpackages, a light config layer.

Every import statement counts, at module level or inside a function: an import
moved into a function still ties the two packages together, it only hides the
cycle until run time.
"""

import ast
import itertools
import os
import subprocess
import sys
from collections import defaultdict

from tests.conftest import ROOT

PACKAGE = os.path.join(ROOT, "megatron_moe")


def module_name(path: str) -> str:
    parts = os.path.relpath(path, ROOT)[: -len(".py")].split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: str):
    """(absolute module name, line) of every import statement in the file, wherever it is."""
    name = module_name(path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from its package, up level - 1
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            if module == "megatron_moe":  # `from megatron_moe import comm`: the subpackage comm
                yield from ((f"{module}.{alias.name}", node.lineno) for alias in node.names)
            else:
                yield module, node.lineno


def subpackage_edges(root: str = PACKAGE) -> dict[str, dict[str, str]]:
    """{subpackage: {subpackage it imports: 'file:line' of one such import}} for megatron_moe's subpackages."""
    edges = defaultdict(dict)
    for folder, _, files in os.walk(root):
        for file in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, file)
            parts = os.path.relpath(path, root).split(os.sep)
            if parts == ["__init__.py"]:  # belongs to no subpackage
                continue
            parts[0] = parts[0].removesuffix(".py")  # a top-level module (files.py) is a layer's member too
            for module, line in imported_modules(path):
                target = module.split(".")
                if target[0] == "megatron_moe" and len(target) > 1 and target[1] != parts[0]:
                    edges[parts[0]].setdefault(target[1], f"{os.path.relpath(path, ROOT)}:{line}")
    return edges


def find_cycle(edges: dict[str, dict[str, str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None."""
    state: dict[str, str] = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(edges.get(node, {})):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(edges):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


LAYERS = (
    ("config", "files", "failure", "lifetime", "import_hooks"),
    ("platform",),
    ("comm", "data", "activations"),
    ("moe",),
    ("overlap",),
    ("planning",),
    ("model",),
    ("checkpointing",),
    ("training",),
)
"""megatron_moe's layers, bottom first: a subpackage (or top-level module) imports only from layers below its own
(tools/ and tests/ sit on top of them all)."""


def upward_imports(edges: dict[str, dict[str, str]]) -> list[str]:
    """Each import of a layer's member from its own layer or one above, as a line naming both and the place."""
    level = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    members = set(edges) | {b for targets in edges.values() for b in targets}
    assert members <= set(level), (
        f"not in a layer: {sorted(members - set(level))}; add it to LAYERS and docs/project-layout.md"
    )
    return [
        f"{a} (layer {level[a]}) imports {b} (layer {level[b]}) at {where}"
        for a, targets in sorted(edges.items())
        for b, where in sorted(targets.items())
        if level[b] >= level[a]
    ]


def test_imports_go_down_the_layers():
    edges = subpackage_edges()
    assert "files" in edges["checkpointing"] and "comm" in edges["moe"]  # `from megatron_moe import comm` counts
    upward = upward_imports(edges)
    assert not upward, "imports that do not go down the layers:\n" + "\n".join(upward)


def test_an_upward_import_is_named(tmp_path):
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "rules.py").write_text("from megatron_moe import moe\n")
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "layer.py").write_text("from megatron_moe.config import rules\n")
    assert [line.split(" at ")[0] for line in upward_imports(subpackage_edges(str(tmp_path)))] == [
        "config (layer 0) imports moe (layer 3)"
    ]


def test_the_package_never_imports_tools():
    for folder, _, files in os.walk(PACKAGE):
        for file in (f for f in files if f.endswith(".py")):
            path = os.path.join(folder, file)
            tools = [line for module, line in imported_modules(path) if module and module.split(".")[0] == "tools"]
            assert not tools, f"{os.path.relpath(path, ROOT)}:{tools[0]} imports tools/, which sits above the package"


def test_no_import_cycle_between_subpackages():
    edges = subpackage_edges()
    assert "config" in edges["moe"] and "moe" in edges["training"]  # the walk sees what is there
    cycle = find_cycle(edges)
    where = [f"{a} -> {b} ({edges[a][b]})" for a, b in itertools.pairwise(cycle)] if cycle else []
    assert cycle is None, "import cycle: " + "; ".join(where)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b": ""}, "b": {"c": ""}, "c": {"a": ""}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": ""}, "b": {"c": ""}, "d": {"a": ""}}) is None


def test_config_is_the_bottom_layer():
    """megatron_moe.config imports only the standard library and itself, so anything can import it."""
    assert not subpackage_edges().get("config")
    for folder, _, files in os.walk(os.path.join(PACKAGE, "config")):
        for file in files:
            if file.endswith(".py"):
                for module, line in imported_modules(os.path.join(folder, file)):
                    top = module.split(".")[0]
                    assert top == "megatron_moe" or top in sys.stdlib_module_names, f"config/{file}:{line} {module}"
    heavy = "('torch', 'megatron', 'numpy')"
    probe = f"import sys, megatron_moe.config; print(sorted(m for m in sys.modules if m.split('.')[0] in {heavy}))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_training_process_imports_no_solver_it_does_not_run():
    """scipy.optimize (0.65 s of every process's import, hundreds of processes a test suite) comes in only where a
    plan is solved or a fit constrained (overlap.cost_model, grad_partition, fits), not with the trainer."""
    imports = "import sys, megatron_moe.training, pretrain_gpt_moe"
    probe = f"{imports}; print(sorted(m for m in sys.modules if m.startswith('scipy')))"
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
