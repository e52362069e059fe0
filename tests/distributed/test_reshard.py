"""`tools/checkpoint/convert.py reshard`: a resharded checkpoint resumes exactly like the original.

A tiny GPT-MoE trains steps 1-2 on one process and saves (`src`); resuming
it for steps 3-4 in its own layout is the reference. The CLI reshards src to
EP=2; the worker then hops EP2 -> TP2+SP -> PP2 -> TP1/PP1/EP1, EP2 -> ESP2 -> EP2 and PP2 -> PP2 x VPP2 ->
PP1 with the same converter, and src -> EP2 + distributed optimizer without optimizer state. PP=2 x VPP=2 also
trains from the initial weights on 2 ranks as one process does.
Every result resumed in its target layout must give the reference's lm loss
(1e-5 relative) and grad norm (1e-4 relative), like test_training.py.
The refusals (existing destination, impossible layout, optimizer formats)
are checked in-process, without starting torchrun.
"""

import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.distributed.launcher import LOSS_RTOL, assert_matches, computed, descendants, left_behind, run_torchrun

WORKER = os.path.join(os.path.dirname(__file__), "reshard_worker.py")
CONVERT = ["-m", "tools.checkpoint.convert"]  # run from the repository root
TRACKER = "latest_checkpointed_iteration.txt"


def run_convert(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """The real command line, in a subprocess; no process of it may outlive it."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    before = descendants()
    result = subprocess.run(
        [sys.executable, *CONVERT, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    leftovers = left_behind(before)
    assert not leftovers, f"processes outlived convert.py: {leftovers}"
    return result


@pytest.fixture(scope="module")
def runs(train_data, tmp_path_factory):
    data, tokenizer = train_data
    workdir = str(tmp_path_factory.mktemp("reshard"))
    source = run_torchrun(WORKER, 1, ["source", data, tokenizer, workdir])
    os.makedirs(os.path.join(workdir, "ep2"))
    open(os.path.join(workdir, "ep2", "stale.txt"), "w").close()  # --overwrite must replace it
    cli = run_convert(
        "reshard",
        "--load",
        os.path.join(workdir, "src"),
        "--save",
        os.path.join(workdir, "ep2"),
        "--target-expert-parallel-size",
        "2",
        "--overwrite",
    )
    assert cli.returncode == 0, f"convert.py failed:\n{cli.stdout[-6000:]}\n{cli.stderr[-6000:]}"
    chain = run_torchrun(WORKER, 2, ["chain", data, tokenizer, workdir])
    return {"workdir": workdir, "cli": cli, **source, **chain}


TARGETS = {  # name: (TP, PP, EP, sequence parallel, ESP, VPP)
    "ep2": (1, 1, 2, False, 1, 1),
    "tp2_sp": (2, 1, 1, True, 1, 1),
    "pp2": (1, 2, 1, False, 1, 1),
    "back_to_1": (1, 1, 1, False, 1, 1),
    "esp2": (1, 1, 1, False, 2, 1),
    "esp2_to_ep2": (1, 1, 2, False, 1, 1),
    "pp2_vpp2": (1, 2, 1, False, 1, 2),
    "vpp2_to_1": (1, 1, 1, False, 1, 1),
}


@pytest.mark.parametrize("name", list(TARGETS))
def test_resharded_checkpoint_resumes_like_the_original(runs, name):
    resumed = runs[name]["resumed"]
    assert [s["iteration"] for s in resumed] == [3, 4]
    assert [s["iteration"] for s in runs["reference"]] == [3, 4]
    assert_matches(resumed, runs["reference"])


@pytest.mark.parametrize("name", list(TARGETS))
def test_resharded_checkpoint_records_the_target_layout(runs, name):
    result, src = runs[name], runs["src"]
    tp, pp, ep, sp, esp, vpp = TARGETS[name]
    layout = {k: result["layout"][k] for k in ("tp", "pp", "ep", "esp", "vpp")}
    assert layout == {"tp": tp, "pp": pp, "ep": ep, "esp": esp, "vpp": vpp}
    p = result["parallel"]
    assert (
        p["tensor_model_parallel_size"],
        p["pipeline_model_parallel_size"],
        p["expert_model_parallel_size"],
        p["sequence_parallel"],
        p["expert_tensor_parallel_size"] or 1,
        p["num_virtual_stages_per_pipeline_rank"] or 1,
    ) == (tp, pp, ep, sp, esp, vpp)
    assert result["iteration"] == src["iteration"] == 2
    assert result["train_state"] == src["train_state"]
    assert result["scheduler"] == src["scheduler"]
    assert result["has_optimizer"] and not result["distributed_optimizer"]


def test_interleaved_pipeline_on_two_ranks_matches_one_process(runs):
    """PP=2 x VPP=2 on 2 ranks (each rank two model chunks) trains all 4 steps from the same initial weights
    as one process does, and resumes the one-process checkpoint of iteration 2 (resharded at load) likewise."""
    whole, direct = runs["pp2_vpp2_from_init"], runs["pp2_vpp2_direct"]
    assert [s["iteration"] for s in whole] == [1, 2, 3, 4] and [s["iteration"] for s in direct] == [3, 4]
    assert_matches(whole, runs["from_init"])
    assert_matches(direct, runs["reference"])


def test_reshard_uses_the_smallest_world_that_fits(runs):
    assert runs["tp2_sp"]["world_size"] == 2 and runs["pp2"]["world_size"] == 2
    assert runs["back_to_1"]["world_size"] == 1
    assert runs["esp2"]["world_size"] == 2  # ESP=2 needs two ranks, whatever EP
    assert runs["pp2_vpp2"]["world_size"] == 2 and runs["vpp2_to_1"]["world_size"] == 1
    assert "launching 2 CPU processes" in runs["cli"].stdout


def test_weights_only_conversion_to_the_distributed_optimizer(runs):
    result = runs["ep2_distopt_weights_only"]
    assert not result["has_optimizer"] and result["distributed_optimizer"]
    assert result["scheduler"] == runs["src"]["scheduler"]  # kept, though a weights-only resume ignores it
    # Same weights: step 3's loss and gradient match; fresh Adam moments change step 4.
    assert_matches(result["resumed"][:1], runs["reference"])
    assert result["resumed"][1]["lm loss"] != pytest.approx(runs["reference"][1]["lm loss"], rel=LOSS_RTOL)


def test_resharded_rng_is_what_a_direct_resume_in_that_layout_uses(runs):
    """With dropout on, the saved RNG states decide the losses: bit-identical runs prove they match."""
    direct, resharded = runs["dropout_direct"], runs["dropout_resharded"]
    assert [s["iteration"] for s in resharded] == [3, 4]
    assert computed(resharded) == computed(direct)
    assert resharded[0]["lm loss"] != runs["reference"][0]["lm loss"]  # dropout did change the loss


def test_cli_reports_progress_and_leaves_no_staging_directory(runs):
    out = runs["cli"].stdout
    for line in (
        "reshard: reading",
        "reshard: iteration 2, source layout",
        "optimizer state moves",
        "reshard: wrote",
        "reshard: done in",
    ):
        assert line in out, out
    assert sorted(os.listdir(runs["workdir"])) == sorted(["src", "init", *TARGETS, "ep2_distopt_weights_only"])
    assert sorted(os.listdir(os.path.join(runs["workdir"], "ep2"))) == ["iter_0000002", TRACKER]


def test_cli_filters_megatron_cores_notices_as_training_does(runs):
    """The workers' megatron-core notices that training drops (`MEGATRON_NOISE`: "Unknown MLP type", ...) stay
    out of the conversion's output; its own lines and megatron-core's real warnings do not."""
    from megatron_moe.failure import MEGATRON_NOISE

    err = runs["cli"].stderr
    lines = [line for line in err.splitlines() if "kernels: transformer_engine=" not in line]  # ours: what runs
    assert not [line for line in lines if any(pattern in line for pattern in MEGATRON_NOISE)], err[-3000:]
    assert "Unknown MLP type" not in err, err[-3000:]  # megatron-core's, once per rank before
    assert "reshard: building the model and optimizer" in err and "warnings.warn" not in err, err[-3000:]


# ---------------------------------------------------------------- refusals (no torchrun)


@pytest.fixture(scope="module")
def convert_main():
    """convert.py's main(), imported."""
    from tools.checkpoint.convert import main

    return main


def refusal(convert_main, capsys, src, dst, *flags) -> str:
    code = convert_main(["reshard", "--load", src, "--save", dst, *flags])
    err = capsys.readouterr().err
    assert code == 2, err
    assert not os.path.exists(dst) or os.listdir(dst) == ["keep.txt"], os.listdir(dst)
    return err


def test_refuses_an_existing_destination(runs, convert_main, capsys, tmp_path):
    dst = tmp_path / "taken"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    err = refusal(convert_main, capsys, os.path.join(runs["workdir"], "src"), str(dst))
    assert f"--save={dst}: already exists; choose a new directory or add --overwrite" in err
    assert (dst / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--target-expert-parallel-size", "3"],
            "--num-experts=4: must be a multiple of --target-expert-parallel-size=3",
        ),
        (["--target-pipeline-parallel-size", "3"], "--target-pipeline-parallel-size=3: must divide --num-layers=4"),
        (
            ["--target-tensor-parallel-size", "3"],
            "--target-tensor-parallel-size=3: must divide --num-attention-heads=4",
        ),
        (
            ["--target-tensor-parallel-size", "2", "--no-target-sequence-parallel"],
            "--target-sequence-parallel=False: MoE with --target-tensor-parallel-size=2 "
            "needs --target-sequence-parallel",
        ),
        (["--target-expert-parallel-size", "0"], "--target-expert-parallel-size=0: must be >= 1"),
        (
            ["--target-num-virtual-stages-per-pipeline-rank", "2"],
            "--target-num-virtual-stages-per-pipeline-rank=2: the interleaved pipeline splits each pipeline rank's "
            "layers into chunks; it needs --target-pipeline-parallel-size > 1 (now 1)",
        ),
        (
            ["--target-pipeline-parallel-size", "2", "--target-num-virtual-stages-per-pipeline-rank", "3"],
            "--target-num-virtual-stages-per-pipeline-rank=3: --num-layers=4 must be a multiple of "
            "--target-pipeline-parallel-size x chunks = 2 x 3, e.g. --target-num-virtual-stages-per-pipeline-rank 2",
        ),
    ],
)
def test_refuses_an_impossible_layout(runs, convert_main, capsys, tmp_path, flags, message):
    err = refusal(convert_main, capsys, os.path.join(runs["workdir"], "src"), str(tmp_path / "dst"), *flags)
    assert message in err


def test_refuses_to_move_optimizer_state_between_formats(runs, convert_main, capsys, tmp_path):
    err = refusal(
        convert_main,
        capsys,
        os.path.join(runs["workdir"], "src"),
        str(tmp_path / "dst"),
        "--target-use-distributed-optimizer",
    )
    assert "--target-use-distributed-optimizer: the source's optimizer state was saved without" in err
    assert "add --no-optimizer" in err


def test_refuses_a_destination_inside_the_source(runs, convert_main, capsys):
    src = os.path.join(runs["workdir"], "src")
    err = refusal(convert_main, capsys, src, os.path.join(src, "inside"), "--overwrite")
    assert "must not be, contain or lie inside --load" in err


def test_failed_conversion_leaves_no_destination(runs, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(os.path.join(runs["workdir"], "src"), broken)
    shard = next(p for p in (broken / "iter_0000002").iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:100])
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    # Same layout (one process); --overwrite, yet the old destination must survive the failure.
    result = run_convert("reshard", "--load", str(broken), "--save", str(dst), "--overwrite")
    assert result.returncode == 2, result.stdout + result.stderr
    # the worker's own line names the broken file; the command's says nothing was written
    assert f"{dst} was not written (the conversion failed: the line above)" in result.stderr, result.stderr
    assert sorted(os.listdir(tmp_path)) == ["broken", "dst"]  # no staging directory left
    assert os.listdir(dst) == ["keep.txt"] and (dst / "keep.txt").read_text() == "mine"
