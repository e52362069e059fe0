"""The MoE package's shape: no private cross-module imports, files under 500 lines, docstrings as contracts."""

import ast
import pathlib

import megatron_moe

MOE = pathlib.Path(megatron_moe.__file__).parent / "moe"


def _modules():
    return sorted(MOE.glob("*.py"))


def test_no_module_of_the_moe_package_imports_another_modules_private_name():
    found = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron_moe"):
                found += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert found == []
