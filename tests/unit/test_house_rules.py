"""House rules of megatron_moe, read from the source (ast and line counts), each failing with its offenders listed.

- No module imports another module's private name (`from megatron_moe.x import _name`, with or without `as`,
  or `import megatron_moe.x._name`): a helper two modules share is public, or lives where it is used.
- No library file is over 500 lines: a longer one is split by concept.
- A module docstring is a contract (what, inputs, outputs, invariants) of at most 15 lines, counted from its
  opening to its closing quotes; derivations, deviations from the papers and measured figures live in docs/.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_moe"
MAX_FILE_LINES = 500
MAX_DOCSTRING_LINES = 15


def _modules() -> list[pathlib.Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _rel(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_ours(node: ast.ImportFrom) -> bool:
    return node.level > 0 or (node.module or "").split(".")[0] == PACKAGE.name


def _private_imports(tree: ast.Module) -> list[str]:
    """`module.name` (or the dotted path) of every private name of megatron_moe that `tree` imports."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and _is_ours(node):
            where = "." * node.level + (node.module or "")
            found += [f"{where}.{a.name}" for a in node.names if _is_private(a.name)]
        elif isinstance(node, ast.Import):
            ours = [a.name for a in node.names if a.name.split(".")[0] == PACKAGE.name]
            found += [name for name in ours if any(_is_private(part) for part in name.split("."))]
    return found


def _docstring_lines(tree: ast.Module) -> int:
    first = tree.body[0] if tree.body else None
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)):
        return 0
    if not isinstance(first.value.value, str):
        return 0
    return first.end_lineno - first.lineno + 1


def _offenders(lines: list[str]) -> str:
    return "\n  " + "\n  ".join(lines)


def test_no_module_imports_another_modules_private_name():
    offenders = []
    for path in _modules():
        offenders += [f"{_rel(path)}: {name}" for name in _private_imports(ast.parse(path.read_text()))]
    assert not offenders, (
        f"{len(offenders)} private cross-module imports (make the name public, or move it where it is used):"
        + _offenders(offenders)
    )


def test_no_library_file_is_over_500_lines():
    lengths = {path: len(path.read_text().splitlines()) for path in _modules()}
    offenders = [f"{_rel(path)}: {n} lines" for path, n in lengths.items() if n > MAX_FILE_LINES]
    assert not offenders, f"{len(offenders)} files over {MAX_FILE_LINES} lines (split by concept):" + _offenders(
        offenders
    )


def test_every_module_docstring_is_at_most_15_lines():
    lengths = {path: _docstring_lines(ast.parse(path.read_text())) for path in _modules()}
    offenders = [f"{_rel(path)}: {n} lines" for path, n in lengths.items() if n > MAX_DOCSTRING_LINES]
    assert not offenders, (
        f"{len(offenders)} module docstrings over {MAX_DOCSTRING_LINES} lines (keep the contract: what, inputs, "
        "outputs, invariants; move derivations, paper deviations and measured figures to docs/):"
        + _offenders(offenders)
    )


def test_the_scans_see_what_they_look_for():
    """The rules' own probes: a private import in each form is found, a public one and a dunder are not."""
    tree = ast.parse(
        "from megatron_moe.moe.pipeline import _fc1, chunk\n"
        "from megatron_moe.moe import _save as save\n"
        "from .paths import _publish, __all__\n"
        "import megatron_moe.moe._impl as impl\n"
        "from torch.distributed import _functional_collectives\n"
    )
    assert _private_imports(tree) == [
        "megatron_moe.moe.pipeline._fc1",
        "megatron_moe.moe._save",
        ".paths._publish",
        "megatron_moe.moe._impl",
    ]
    assert _docstring_lines(ast.parse('"""one\n\ntwo\n"""\nx = 1\n')) == 4
    assert _docstring_lines(ast.parse("x = 1\n")) == 0
