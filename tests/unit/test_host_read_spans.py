"""Every read of device values by the host in the training step runs inside `comm.host_read`.

On NCCL a collective's `wait()` does not block the host: a peer that never joins shows as the host blocked in its
next read of a device value. The watchdog names that read only when it runs inside a `host_read` span, so:

- the scan (ast) fails on an explicit read (`.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `.to("cpu")`,
  `to_host(...)`, `synchronize()`) in megatron_moe outside a `with host_read(...)` block, unless it sits in a
  private helper whose every call in its module is covered (`metrics._layer_figures`), or in a module that does not
  run in the step (`EXEMPT`, each with its reason);
- a training run in one process (the step, validation, the exit check, the logging) under the host-sync counter
  (platform/host_sync.py) fails on any read outside a span, also the implicit ones the scan cannot see
  (`if tensor:`, `float(tensor)`, megatron-core's own: its loss is spanned by a tap in comm/megatron_core.py,
  whose probe is checked here too).
"""

from __future__ import annotations

import ast
import pathlib
import textwrap
import traceback

import pytest
import torch

from megatron_moe import comm
from tests.unit.one_rank_run import one_rank_trainer

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "megatron_moe"

READ_METHODS = frozenset({"item", "tolist", "cpu", "numpy"})
READ_FUNCTIONS = frozenset({"to_host", "synchronize"})
EXEMPT = {
    "platform/": "the layer below the spans: `to_host`, `synchronize` and the CUDA stand-ins are what they wrap",
    "checkpointing/": "between steps (save, load, conversion); on NCCL left to its own timeout (docs/troubleshooting)",
    "data/": "the tokenizer's and the datasets' values are host data",
    "overlap/profiler.py": "the cost-model profiler runs before the first step, timed with `synchronize()`",
    "overlap/measure.py": "the profiler's micro-benchmarks (split out of profiler.py), before the first step",
    "training/summary.py": "the start-up summary's parameter count, before the first step",
}


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _read_name(call: ast.Call) -> str | None:
    """The read a call makes, or None."""
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr in READ_METHODS:
        return func.attr
    if isinstance(func, ast.Attribute) and func.attr == "to":
        targets = [*call.args, *(k.value for k in call.keywords if k.arg == "device")]
        if any(isinstance(t, ast.Constant) and t.value == "cpu" for t in targets):
            return 'to("cpu")'
    name = _dotted(func)
    if name is not None and name.rsplit(".", 1)[-1] in READ_FUNCTIONS:
        return name.rsplit(".", 1)[-1]
    return None


def _is_span(item: ast.withitem) -> bool:
    expr = item.context_expr
    return isinstance(expr, ast.Call) and (_dotted(expr.func) or "").rsplit(".", 1)[-1] == "host_read"


def _in_span(node: ast.AST, parents: dict) -> bool:
    """Inside a `with host_read(...)` block of the same function."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.With) and any(_is_span(item) for item in node.items):
            return True
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return False
    return False


def _function_of(node: ast.AST, parents: dict) -> ast.FunctionDef | None:
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return node
    return None


def _covered_helpers(tree: ast.Module, parents: dict) -> set[str]:
    """Private functions (and methods) whose every call in the module is inside a span or a covered helper."""
    calls: dict[str, list[ast.Call]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = (_dotted(node.func) or "").removeprefix("self.")
            if name.startswith("_") and "." not in name:
                calls.setdefault(name, []).append(node)
    covered: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, sites in calls.items():
            if name in covered:
                continue
            if all(_in_span(c, parents) or getattr(_function_of(c, parents), "name", None) in covered for c in sites):
                covered.add(name)
                changed = True
    return covered


def violations(source: str, filename: str) -> list[str]:
    """'file:line read' for each explicit host read outside a span."""
    tree = ast.parse(source, filename)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    covered = _covered_helpers(tree, parents)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or (read := _read_name(node)) is None:
            continue
        function = _function_of(node, parents)
        if _in_span(node, parents) or (function is not None and function.name in covered):
            continue
        found.append(f"{filename}:{node.lineno} {read}")
    return found


def scan_package(root: pathlib.Path = PACKAGE) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if any(relative.startswith(prefix) for prefix in EXEMPT):
            continue
        found += violations(path.read_text(), f"megatron_moe/{relative}")
    return found


def test_every_host_read_in_megatron_moe_runs_inside_a_host_read_span():
    assert scan_package() == []


def test_the_scan_sees_the_reads_it_allows():
    """If the step's modules held no read inside a span, the test above would prove nothing."""
    allowed = 0
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        allowed += sum(1 for n in ast.walk(tree) if isinstance(n, ast.Call) and _read_name(n) and _in_span(n, parents))
    assert allowed >= 8


@pytest.mark.parametrize(
    "source",
    [
        "x = t.item()",
        "def f(t):\n    return t.tolist()",
        "def f(t):\n    return to_host(t)[0]",
        "def f(t):\n    return t.to('cpu')",
        "def f(t):\n    return t.to(device='cpu').numpy()",
        "def f():\n    platform.synchronize()",
        "def f(t):\n    with host_read('x'):\n        pass\n    return t.item()",  # after the block
        "def f(t):\n    with host_read('x'):\n        def g():\n            return t.item()\n    return g",  # later
        "def _helper(t):\n    return t.item()\ndef f(t):\n    with host_read('x'):\n        _helper(t)\n    _helper(t)",
        "def _helper(t):\n    return t.item()",  # never called here: from elsewhere, uncovered
    ],
)
def test_a_read_outside_a_span_is_caught(source):
    assert violations(source, "x.py")


def test_reads_inside_a_span_or_a_covered_helper_pass():
    source = textwrap.dedent("""
        def _figures(row):
            return {"min": row.min().item()}

        def _all(table):
            return [_figures(row) for row in table]

        def collect(table, t):
            comm.reduce(table)
            with comm.host_read("moe metrics"):
                figures = _all(table)
            with host_read("lm loss", layer=2):
                loss = t.item()
            return figures, loss

        class Trainer:
            def _scale(self):
                with comm.host_read("loss scale"):
                    return self.optimizer.get_loss_scale().item()

            def step(self):
                return self._scale()
    """)
    assert violations(source, "x.py") == []


def test_queries_and_uploads_are_not_reads():
    source = "def f(t, device):\n    return t.to(device), t.to(torch.float32), t.numel(), t.shape[0], t.float()"
    assert violations(source, "x.py") == []


def test_megatron_core_taps_still_match_its_source():
    """The upgrade alarm of the taps (the loss's host read among them): each probe reads megatron-core's source."""
    from megatron_moe.comm.megatron_core import TAPS

    assert [tap.name for tap in TAPS if not tap.still_needed()] == []
    assert "loss_read_tap" in [tap.name for tap in TAPS]


# -- the training run ---------------------------------------------------------------------------------------------

EXPECTED_SPANS = {
    "moe plan counts",
    "megatron-core cross-entropy (target mask)",
    "finite grads",
    "agreed non-finite flags",
    "optimizer step (found-inf, grad norm)",
    "params norm",
    "lm loss",
    "loss scale",
    "moe metrics",
    "comm timers",
    "exit flags",
}
NOT_DEVICE_READS = {
    "to": 'on CPU the platform device is the host, so every upload `.to(device)` counts; the scan covers `.to("cpu")`',
}
UNSPANNED = {
    ("megatron/core/tensor_parallel/random.py", "fork"): "compares CPU generator states: host tensors everywhere",
    ("megatron_moe/moe/grouped_gemm.py", "onednn_works"): "a CPU kernel probe, once per process",
    ("megatron_moe/moe/grouped_gemm.py", "mm_rows_independent"): "a CPU kernel probe on host tensors, once per process "
    "and weight shape (this test failed alone before it was named: the suite's earlier tests had run the probe)",
    ("megatron_moe/moe/grouped_gemm.py", "_batch_matches_mm"): "a CPU kernel probe on host tensors, once per process "
    "and weight shape",
    ("megatron_moe/moe/grouped_gemm.py", "_torch_grouped_mm_works"): "a kernel probe, once per process and dtype "
    "(in the first step; not named if a peer stalls there)",
}
"""Reads left outside spans: (file, function) of the innermost frame in megatron or megatron_moe -> why."""


class Spans:
    """A monitor that knows whether a host read is open, and the reads it saw."""

    def __init__(self):
        self.open: list[str] = []
        self.seen: set[str] = set()

    def issued(self, collective):
        return None

    def handle(self, token, work):
        pass

    def blocked(self, token):
        pass

    def unblocked(self, token, *, completed):
        pass

    def read_started(self, read):
        self.open.append(read.purpose)
        self.seen.add(read.purpose)
        return read.purpose

    def read_ended(self, token):
        self.open.remove(token)


def _root(filename: str) -> pathlib.Path:
    """The folder that holds the `megatron` or `megatron_moe` package of `filename`."""
    path = pathlib.Path(filename)
    return next(p.parent for p in path.parents if p.name in ("megatron", "megatron_moe"))


class Reads(list):
    """The host-sync counter's events, each with whether a span was open and where it happened."""

    def __init__(self, spans: Spans):
        super().__init__()
        self.spans, self.outside = spans, []

    def append(self, event):
        super().append(event)
        if self.spans.open or event in NOT_DEVICE_READS:
            return
        stack = traceback.extract_stack()[:-1]
        frames = [f for f in stack if "megatron" in f.filename and not f.filename.endswith("host_sync.py")]
        if frames and any(frames[-1].filename.endswith(path) and frames[-1].name == name for path, name in UNSPANNED):
            return
        where = [f"{pathlib.Path(f.filename).relative_to(_root(f.filename))}:{f.lineno}" for f in frames]
        self.outside.append(f"{event} at {' <- '.join(reversed(where[-4:]))}")


def test_every_host_read_of_a_training_run_is_inside_a_span(megatron_world1):
    from megatron_moe.comm.megatron_core import tap_megatron_core
    from megatron_moe.platform import count_host_syncs

    tap_megatron_core()  # as training/initialize.py does
    cfg, trainer = one_rank_trainer("--train-iters", "2", "--eval-interval", "1", "--eval-iters", "1")
    spans = Spans()
    with comm.monitoring(spans), count_host_syncs(torch.device("cpu")) as syncs:
        syncs.events = reads = Reads(spans)
        history = trainer.train()
    assert len(history) == 2 and len(reads) > 20
    # The history carries what benchmarks read (tools/bench_balance.py): each step's routed pairs per expert of
    # every MoE layer (the step's 4 x 32 tokens, top-k each) and the validation loss of each validated step.
    topk = cfg.moe.moe_router_topk
    for step in history:
        assert set(step["tokens_per_expert"]) == {1, 2} and all(len(c) == 4 for c in step["tokens_per_expert"].values())
        assert all(sum(c) == 4 * 32 * topk for c in step["tokens_per_expert"].values()), step["tokens_per_expert"]
        assert step["validation lm loss"] > 0  # --eval-interval 1: after either step
        # TP=1: megatron-core's collectives over the TP group (its cross-entropy's) are done locally, not issued
        assert step["comm"]["calls"]["tp"] == 0, step["comm"]["calls"]
    assert reads.outside == [], "\n".join(reads.outside)
    assert spans.seen >= EXPECTED_SPANS, EXPECTED_SPANS - spans.seen
