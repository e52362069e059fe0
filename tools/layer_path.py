"""The path of a token through one MoE layer: which of our files and frames a forward and backward run.

Runs the demo's layer shape (Mixtral: 8 experts, top-2, SwiGLU, hidden 256, experts 512 wide) once under
`sys.setprofile` and prints one JSON line per pass (forward, backward, both):
- `files`: the distinct megatron_moe files whose functions ran between MoELayer.forward's entry and its return
  (backward: between `backward()`'s call and its return);
- `frames`: the distinct (file, function) pairs among them;
- `path_files` / `path_frames`: those on a stack at an expert GEMM or at a ROW all-to-all (the token's way there
  and back): an all-to-all issued (`comm.core.issue`) under one of `ROW_PURPOSES`, the dispatch and combine and
  under ESP their all-gather and reduce-scatter, forward or reverse (`--files`: `path_frame_list`);
- `counts_frames`: the frames on a stack at another all-to-all (the counts exchange: it moves counts, not rows)
  and not on the path;
- `deepest`: the most megatron_moe frames on one stack; `at_gemm` / `at_all_to_all`: the most at an expert GEMM
  (a matmul called from our code) and at a row all-to-all (none in one process).

    python -m tools.layer_path                        # EP = 1, one process
    torchrun --nproc-per-node 2 -m tools.layer_path   # EP = 2 over gloo (rank 0 prints)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

PACKAGE = os.path.join("megatron_moe", "")
EXPERT_FRAMES = ("Expert", "GroupedMLP", "Pipeline")
"""Our functions whose qualified names hold one of these compute experts (a GEMM under them is an expert GEMM)."""
GEMM_FUNCTIONS = {"onednn_linear"}
"""Python functions that are one GEMM (the platform's oneDNN linear)."""
ROW_PURPOSES = {"dispatch_all_to_all", "combine_all_to_all", "esp_all_gather", "esp_reduce_scatter"}
"""The purposes (`comm.Collective.purpose`) of the all-to-alls that move the token's rows."""
GEMMS = {"mm", "bmm", "matmul", "_grouped_mm", "addmm", "baddbmm", "linear"}


class PathRecorder:
    """A profile function that records our frames while `active`."""

    def __init__(self):
        self.active = False
        self.files: set[str] = set()
        self.frames: set[tuple[str, str]] = set()
        self.deepest = self.at_gemm = self.at_all_to_all = 0
        self.path: set[tuple[str, str]] = set()
        """Our frames on a stack at an expert GEMM or a row all-to-all: the token's path to the experts and back."""
        self.counts: set[tuple[str, str]] = set()
        """Our frames on a stack at a planning all-to-all (the counts exchange): off the token's path."""

    @staticmethod
    def _ours(frame) -> str | None:
        path = frame.f_code.co_filename
        i = path.rfind(PACKAGE)
        return path[i:] if i >= 0 else None

    def _depth(self, frame, into: set | None = None) -> int:
        depth = 0
        while frame is not None:
            name = self._ours(frame)
            if name is not None:
                depth += 1
                if into is not None:
                    into.add((name, frame.f_code.co_qualname))
            frame = frame.f_back
        return depth

    def _purpose(self, frame) -> str | None:
        """The purpose of the collective being issued on this stack (`comm.core.issue`'s `collective`), if any."""
        while frame is not None:
            if frame.f_code.co_name == "issue" and (self._ours(frame) or "").endswith(os.path.join("comm", "core.py")):
                return getattr(frame.f_locals.get("collective"), "purpose", None)
            frame = frame.f_back
        return None

    def __call__(self, frame, event, arg):
        if not self.active:
            return
        if event == "call":
            name = self._ours(frame)
            if name is not None:
                self.files.add(name)
                self.frames.add((name, frame.f_code.co_qualname))
                self.deepest = max(self.deepest, self._depth(frame))
            if frame.f_code.co_name in GEMM_FUNCTIONS and self._in_experts(frame):
                self.at_gemm = max(self.at_gemm, self._depth(frame, self.path))
            if frame.f_code.co_name.startswith("all_to_all"):  # ours (comm/transport.py) or torch.distributed's
                if self._purpose(frame) in ROW_PURPOSES:
                    self.at_all_to_all = max(self.at_all_to_all, self._depth(frame, self.path))
                else:
                    self._depth(frame, self.counts)
        elif event == "c_call" and getattr(arg, "__name__", "") in GEMMS and self._in_experts(frame):
            self.at_gemm = max(self.at_gemm, self._depth(frame, self.path))

    def _in_experts(self, frame) -> bool:
        """Whether an experts' frame is on the stack (not the router's GEMM)."""
        while frame is not None:
            if self._ours(frame) is not None and any(k in frame.f_code.co_qualname for k in EXPERT_FRAMES):
                return True
            frame = frame.f_back
        return False

    def report(self, label: str, world: int) -> dict:
        return {
            "pass": label,
            "ep": world,
            "files": len(self.files),
            "frames": len(self.frames),
            "deepest": self.deepest,
            "at_gemm": self.at_gemm,
            "at_all_to_all": self.at_all_to_all,
            "path_files": len({f for f, _ in self.path}),
            "path_frames": len(self.path),
            "counts_frames": len(self.counts - self.path),
            "file_list": sorted(self.files),
            "path_file_list": sorted({f for f, _ in self.path}),
            "path_frame_list": sorted(f"{f}:{q}" for f, q in self.path),
        }


def build_layer(world: int):
    """The demo's MoE layer (examples/pretrain_gpt_moe_tiny_cpu.sh), over the world as its EP group."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    from megatron_moe.moe import MoELayer, MoELayerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=256,
        ffn_hidden_size=512,
        num_attention_heads=4,
        num_moe_experts=8,
        moe_router_topk=2,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=True,
    )
    moe = MoELayerConfig(
        num_experts=8, hidden_size=256, ffn_hidden_size=512, topk=2, expert_type="swiglu", aux_loss_coeff=0.01
    )
    group = torch.distributed.group.WORLD if world > 1 else None
    return MoELayer(config, moe, ep_group=group, layer_number=1)


def measure(layer, x, world: int) -> list[dict]:
    """One warm-up forward and backward, then one recorded."""
    out, _ = layer(x)
    out.sum().backward()
    forward, backward = PathRecorder(), PathRecorder()
    sys.setprofile(forward)
    forward.active = True
    out, _ = layer(x)
    forward.active = False
    sys.setprofile(backward)
    backward.active = True
    out.sum().backward()
    backward.active = False
    sys.setprofile(None)
    both = PathRecorder()
    both.files, both.frames = forward.files | backward.files, forward.frames | backward.frames
    both.path, both.counts = forward.path | backward.path, forward.counts | backward.counts
    both.deepest = max(forward.deepest, backward.deepest)
    both.at_gemm = max(forward.at_gemm, backward.at_gemm)
    both.at_all_to_all = max(forward.at_all_to_all, backward.at_all_to_all)
    return [r.report(label, world) for r, label in ((forward, "forward"), (backward, "backward"), (both, "both"))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="sequence x micro-batch tokens (default 256)")
    parser.add_argument("--files", action="store_true", help="list the files in each line")
    args = parser.parse_args(argv)
    import torch  # after --help: it answers without torch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        torch.distributed.init_process_group("gloo")
    torch.manual_seed(0)
    layer = build_layer(world)
    x = torch.randn(args.tokens, 1, 256, requires_grad=True)
    reports = measure(layer, x, world)
    if world == 1 or torch.distributed.get_rank() == 0:
        for report in reports:
            if not args.files:
                report.pop("file_list")
                report.pop("path_file_list")
                report.pop("path_frame_list")
            print(json.dumps(report))
    if world > 1:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
