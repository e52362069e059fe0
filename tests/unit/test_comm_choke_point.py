"""Every torch.distributed collective in megatron_moe starts inside megatron_moe/comm, through `issue`.

The scan reads the source (ast): outside megatron_moe/comm/ any reference to
a collective of torch.distributed fails; inside, it must sit in the `start`
lambda handed to `issue(collective, start)`, so the timers and the watchdog
that hook `issue` see every one. comm/transport.py is the layer below `issue`
(a collective in the form its backend runs best): it may call torch.distributed
anywhere, and its functions count as collectives everywhere else.
"""

from __future__ import annotations

import ast
import pathlib
import textwrap

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "megatron_moe"
COMM = PACKAGE / "comm"

COLLECTIVES = frozenset(
    """all_reduce all_reduce_coalesced all_gather all_gather_into_tensor all_gather_coalesced _all_gather_base
    reduce_scatter reduce_scatter_tensor _reduce_scatter_base all_to_all all_to_all_single broadcast barrier
    monitored_barrier send recv isend irecv batch_isend_irecv gather scatter reduce all_gather_object gather_object
    broadcast_object_list scatter_object_list send_object_list recv_object_list""".split()
)
DIST_MODULES = ("torch.distributed", "torch.distributed.distributed_c10d")
TRANSPORT = "megatron_moe.comm.transport"


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _dist_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(names bound to the torch.distributed module, names bound to one of its collectives)."""
    modules, functions = set(DIST_MODULES), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(a.asname for a in node.names if a.name in DIST_MODULES and a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module == TRANSPORT:
            functions.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module in ("torch", *DIST_MODULES):
            for a in node.names:
                if node.module == "torch" and a.name == "distributed":
                    modules.add(a.asname or a.name)
                elif node.module != "torch" and a.name in COLLECTIVES:
                    functions.add(a.asname or a.name)
    return modules, functions


def _is_start_of_issue(lam: ast.Lambda, parents: dict) -> bool:
    call = parents.get(lam)
    if isinstance(call, ast.keyword):
        call = parents.get(call)
    if not (isinstance(call, ast.Call) and _dotted(call.func) in ("issue", "core.issue")):
        return False
    return (len(call.args) > 1 and call.args[1] is lam) or any(
        k.arg == "start" and k.value is lam for k in call.keywords
    )


def violations(source: str, filename: str, *, in_comm: bool) -> list[str]:
    """'file:line name' for each collective reference not allowed where it is."""
    tree = ast.parse(source, filename)
    modules, functions = _dist_names(tree)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES and _dotted(node.value) in modules:
            name = node.attr
        elif isinstance(node, ast.Name) and node.id in functions and isinstance(node.ctx, ast.Load):
            name = node.id
        else:
            continue
        if in_comm:
            enclosing = parents.get(node)
            while enclosing is not None and not isinstance(enclosing, (ast.Lambda, ast.FunctionDef)):
                enclosing = parents.get(enclosing)
            if isinstance(enclosing, ast.Lambda) and _is_start_of_issue(enclosing, parents):
                continue
        found.append(f"{filename}:{node.lineno} {name}")
    return found


UPSTREAM_STAND_INS = {
    "platform/emerging_optimizers.py": "a port of the emerging_optimizers package megatron-core's Muon imports",
    "platform/layer_wise_gather.py": "swaps torch.distributed.all_gather inside megatron-core's layer-wise gather",
}
"""Upstream code (or a patch of it) that calls torch.distributed as megatron-core does. Like megatron-core's, those
calls reach the monitor through comm/megatron_core.py's tap 3, which replaces torch.distributed's functions: so
each must look its collective up on torch.distributed when it runs (`torch.distributed.all_reduce(...)`), never bind
one to a name of its own at import (which the tap could not reach)."""


def scan_package(root: pathlib.Path = PACKAGE) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        if path == root / "comm" / "transport.py":
            continue
        in_comm = (root / "comm") in path.parents
        lines = violations(path.read_text(), str(path.relative_to(root.parent)), in_comm=in_comm)
        if str(path.relative_to(root)) in UPSTREAM_STAND_INS:
            lines = [line for line in lines if not _looked_up_when_called(path, line)]
        found += lines
    return found


def _looked_up_when_called(path: pathlib.Path, line: str) -> bool:
    """The reference `line` names is `torch.distributed.<collective>` (an attribute read at run time)."""
    number, name = line.rsplit(":", 1)[1].split()
    text = path.read_text().splitlines()[int(number) - 1]
    return f"torch.distributed.{name}" in text and f"import {name}" not in text


def test_the_upstream_stand_ins_call_torch_distributed_at_run_time_only():
    assert all((PACKAGE / name).exists() for name in UPSTREAM_STAND_INS)
    bound = "from torch.distributed import all_reduce\nall_reduce(t)"
    assert violations(bound, "x.py", in_comm=False)  # a name bound at import: no tap reaches it
    from megatron_moe.comm.megatron_core import TAPPED_FUNCTIONS

    assert {"all_reduce", "all_gather"} <= set(TAPPED_FUNCTIONS)  # what the stand-ins call, tap 3 covers


def test_every_collective_in_megatron_moe_goes_through_comm_issue():
    assert scan_package() == []


def test_comm_package_has_collectives_to_check():
    """The scan must see the calls it allows; if comm/ held none, the test above would prove nothing."""
    seen = []
    for path in COMM.rglob("*.py"):
        tree = ast.parse(path.read_text())
        modules, _ = _dist_names(tree)
        seen += [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr in COLLECTIVES and _dotted(n.value) in modules
        ]
    assert len(seen) >= 8


@pytest.mark.parametrize(
    "source",
    [
        "import torch.distributed as dist\ndist.all_reduce(t)",
        "import torch.distributed as dist\ndist.barrier()",
        "import torch\ntorch.distributed.broadcast(t, 0)",
        "import torch\ntorch.distributed.distributed_c10d.all_gather_object(out, x)",
        "from torch import distributed as d\nd.all_to_all_single(a, b)",
        "from torch.distributed import batch_isend_irecv\nbatch_isend_irecv(ops)",
        "from torch.distributed import isend as send_it\nsend_it(t, 1)",
        "import torch.distributed as dist\nreduce = dist.reduce_scatter_tensor\nreduce(a, b)",
    ],
)
def test_a_collective_outside_comm_is_caught(source):
    assert violations(source, "x.py", in_comm=False)


def test_queries_and_setup_are_not_collectives():
    source = (
        "import torch.distributed as dist\n"
        "dist.get_rank(); dist.get_world_size(g); dist.new_group([0]); dist.ReduceOp.MAX"
    )
    assert violations(source, "x.py", in_comm=False) == []


def test_inside_comm_only_the_start_lambda_of_issue_may_call():
    ok = textwrap.dedent("""
        import torch.distributed as dist
        def f(t, g):
            issue(Collective("tp", "f", g), lambda: dist.all_reduce(t, group=g))
            issue(record, start=lambda: dist.barrier())
    """)
    assert violations(ok, "comm/x.py", in_comm=True) == []
    direct = "import torch.distributed as dist\ndef f(t):\n    dist.all_reduce(t)"
    other_lambda = "import torch.distributed as dist\nrun(lambda: dist.all_reduce(t))"
    nested = (
        "import torch.distributed as dist\n"
        "issue(r, lambda: helper(lambda: 0))\ndef helper(t):\n    return dist.barrier()"
    )
    for source in (direct, other_lambda, nested):
        assert violations(source, "comm/x.py", in_comm=True), source


def test_transport_functions_count_as_collectives():
    start = "from megatron_moe.comm.transport import all_to_all_single\nissue(r, lambda: all_to_all_single(a, b))"
    assert violations(start, "comm/x.py", in_comm=True) == []
    direct = "from megatron_moe.comm.transport import all_to_all_single as a2a\ndef f():\n    a2a(a, b)"
    assert violations(direct, "comm/x.py", in_comm=True)
    assert violations(
        "from megatron_moe.comm.transport import all_to_all_single\nall_to_all_single(a, b)", "x.py", in_comm=False
    )
