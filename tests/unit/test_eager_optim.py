"""torch.optim runs eager while dynamo is not loaded (`megatron_moe.platform.eager_optim`): a training process's
optimizer never imports torch._dynamo, and its numbers are torch's own, bit for bit."""

import json
import subprocess
import sys

import pytest
import torch

from megatron_moe.platform import eager_optim
from tests.conftest import ROOT

STEPS = """
import json, sys
if sys.argv[1] == "dynamo_first":
    import torch._dynamo  # torch's own guards then run: the reference
from megatron_moe.platform import init_platform
init_platform()
import torch
out = {}
for name in ("Adam", "AdamW", "SGD"):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5, 3))
    kwargs = {"momentum": 0.9} if name == "SGD" else {}
    opt = getattr(torch.optim, name)([w], lr=0.1, weight_decay=0.01, **kwargs)
    for _ in range(3):
        opt.zero_grad()
        (w ** 2).sum().backward()
        opt.step()
    state = opt.state_dict()
    opt.load_state_dict(state)
    out[name] = [w.detach().tolist(), torch.is_grad_enabled()]
print(json.dumps({"steps": out, "dynamo": "torch._dynamo" in sys.modules}))
"""


def _run(mode: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", STEPS, mode], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_optimizers_step_without_dynamo_and_give_torchs_numbers():
    eager, reference = _run("eager"), _run("dynamo_first")
    assert eager["dynamo"] is False and reference["dynamo"] is True
    assert eager["steps"] == reference["steps"]  # the same floats, grad mode restored after each step


def test_the_torch_it_patches_is_probed():
    assert eager_optim.still_needed()  # torch 2.13's wrappers (the platform's upgrade alarm runs it too)


@pytest.mark.parametrize("loaded", [False, True])
def test_a_step_runs_in_the_grad_mode_torch_sets_and_defers_to_torch_once_dynamo_is_loaded(loaded, monkeypatch):
    seen = []

    def raw_step(self):
        seen.append(("raw", torch.is_grad_enabled()))

    def torch_wrapper(self):
        seen.append(("torch", torch.is_grad_enabled()))

    torch_wrapper.__wrapped__ = raw_step
    monkeypatch.setattr(eager_optim, "_dynamo_loaded", lambda: loaded)
    step = eager_optim._eager_step(torch_wrapper)
    holder = type("Opt", (), {"defaults": {"differentiable": False}})()
    with torch.enable_grad():
        step(holder)
        assert torch.is_grad_enabled()
    assert seen == ([("torch", True)] if loaded else [("raw", False)])
