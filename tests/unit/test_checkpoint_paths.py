"""Which checkpoint --load resolves to, and the errors when it resolves to nothing."""

import os

import pytest

from megatron_moe.checkpointing import TRACKER, check_compatible, latest_checkpoint, resolve_load_dir
from megatron_moe.checkpointing import publish as publish_pointer
from megatron_moe.config import ConfigError, parse_args


def cfg(*flags):
    return parse_args(["--data-path", "d", "--tokenizer-model", "t", *flags])


def publish(root, iteration):
    os.makedirs(os.path.join(root, f"iter_{iteration:07d}"))
    open(os.path.join(root, f"iter_{iteration:07d}", "metadata.json"), "w").close()
    publish_pointer(str(root), iteration)


def test_load_pointing_at_nothing(tmp_path):
    with pytest.raises(ConfigError, match=r"--load=.*nowhere: no such directory"):
        resolve_load_dir(cfg("--load", str(tmp_path / "nowhere")))
    with pytest.raises(ConfigError, match=f"no {TRACKER} there"):
        resolve_load_dir(cfg("--load", str(tmp_path)))


def test_auto_resume_starts_fresh_when_nothing_saved(tmp_path):
    assert resolve_load_dir(cfg("--load", str(tmp_path), "--save", str(tmp_path))) is None
    new = str(tmp_path / "not_created_yet")
    assert resolve_load_dir(cfg("--load", new, "--save", new)) is None


def test_killed_save_keeps_previous_checkpoint(tmp_path):
    publish(tmp_path, 10)
    # A save of iteration 20 killed mid-write: its files exist only under the .tmp name.
    os.makedirs(tmp_path / "iter_0000020.tmp")
    (tmp_path / "iter_0000020.tmp" / "half_written.distcp").write_bytes(b"\0" * 10)
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "iter_0000010")
    publish(tmp_path, 20)
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "iter_0000020")
    assert (tmp_path / TRACKER).read_text() == "20"
    assert not [name for name in os.listdir(tmp_path) if name.startswith(TRACKER + ".tmp")]


def test_load_a_single_iteration_directory(tmp_path):
    publish(tmp_path, 3)
    path = str(tmp_path / "iter_0000003")
    assert resolve_load_dir(cfg("--load", path)) == path


def test_corrupt_pointer(tmp_path):
    (tmp_path / TRACKER).write_text("latest")
    with pytest.raises(ConfigError, match="not an iteration number"):
        latest_checkpoint(str(tmp_path))
    (tmp_path / TRACKER).write_text("7")
    with pytest.raises(ConfigError, match="names iteration 7 but .*iter_0000007 is missing"):
        latest_checkpoint(str(tmp_path))


def test_model_shape_mismatch_names_each_flag():
    saved = cfg("--num-layers", "4", "--hidden-size", "256").to_dict()
    with pytest.raises(ConfigError, match=r"--num-layers: checkpoint 4, now 6; --hidden-size: checkpoint 256, now 128"):
        check_compatible(saved, cfg("--num-layers", "6", "--hidden-size", "128"), "ckpt")


def test_checkpoint_of_another_model_definition_is_refused_by_name(megatron_world1, tmp_path, monkeypatch):
    """Tensors the model needs but the checkpoint lacks (e.g. a pre-modular-layer checkpoint): a ConfigError
    naming --load and examples of both sides, before megatron-core's loader fails deep inside."""
    from megatron_moe.checkpointing import TrainState, load_checkpoint, save_checkpoint
    from megatron_moe.model import transformer_config
    from megatron_moe.moe.experts import FFNExperts
    from megatron_moe.training.setup import build_ddp_model, build_optimizer, build_scheduler

    run = cfg(
        "--num-layers",
        "1",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--num-experts",
        "4",
        "--seq-length",
        "32",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "2",
        "--train-iters",
        "2",
    )
    run.validate(world_size=1)
    model = build_ddp_model(run, transformer_config(run), 128)
    optimizer = build_optimizer(run, model)
    scheduler = build_scheduler(run, optimizer)
    path = save_checkpoint(str(tmp_path), run, model, optimizer, scheduler, TrainState())
    assert load_checkpoint(path, run, model, optimizer, scheduler).iteration == 0  # the same definition loads

    original = FFNExperts.sharded_state_dict

    def renamed(self, prefix="", *args, **kwargs):  # this code names the expert weights differently
        state = original(self, prefix, *args, **kwargs)
        for tensor in state.values():
            tensor.key = tensor.key.replace("weight1", "w_in")
        return state

    monkeypatch.setattr(FFNExperts, "sharded_state_dict", renamed)
    with pytest.raises(
        ConfigError,
        match=r"--load=.*iter_0000000: the checkpoint lacks 1 of this model's \d+ "
        r"tensors \(e\.g\. decoder\.layers\.0\.mlp\.experts\.w_in\) and holds 1 "
        r"this model does not have \(e\.g\. decoder\.layers\.0\.mlp\.experts\.weight1\)",
    ):
        load_checkpoint(path, run, model, optimizer, scheduler)


@pytest.mark.parametrize("tracker", ["200", "release", None])
def test_an_old_format_megatron_lm_checkpoint_is_named_with_how_to_convert_it(tmp_path, tracker):
    """Megatron-LM's torch format (iter_N/mp_rank_00/model_optim_rng.pt): before, megatron-core's raw "is not a
    distributed checkpoint" at load (with the pointer) or "none ... is complete" (without)."""
    name = "release" if tracker == "release" else "iter_0000200"
    os.makedirs(tmp_path / name / "mp_rank_00")
    (tmp_path / name / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"torch")
    if tracker:
        (tmp_path / TRACKER).write_text(tracker)
    with pytest.raises(ConfigError) as error:
        resolve_load_dir(cfg("--load", str(tmp_path)))
    text = str(error.value)
    assert text.startswith(f"--load={tmp_path}: {tmp_path / name} is an old-format Megatron-LM checkpoint"), text
    assert "--ckpt-convert-format torch_dist --ckpt-convert-save NEW_DIR" in text and "\n" not in text


@pytest.mark.parametrize("content", ["", '{"files": {"a": {"bytes": 1', "null", "[]", '{"files": [1]}'])
def test_a_truncated_or_foreign_checksums_file_is_named(tmp_path, content):
    """Before: json's JSONDecodeError (or a TypeError), naming neither the file nor the checkpoint."""
    from megatron_moe.checkpointing.integrity import MANIFEST, CheckpointError, verify_manifest, write_manifest

    (tmp_path / "a").write_bytes(b"x")
    write_manifest(str(tmp_path))
    assert verify_manifest(str(tmp_path))
    (tmp_path / MANIFEST).write_text(content)
    with pytest.raises(CheckpointError) as error:
        verify_manifest(str(tmp_path))
    assert str(error.value).startswith(f"--load={tmp_path}: its {MANIFEST} is unreadable (")
    assert str(error.value).endswith(f"delete {tmp_path / MANIFEST} to load the checkpoint unverified")


def test_a_resume_with_nothing_left_to_train_says_so_in_one_line_before_the_model(tmp_path, monkeypatch, caplog):
    """Before: the model built, a validation, the checkpoint saved again and "trained 0 iterations", unexplained (the
    README's rehearsal after `make demo`)."""
    import logging

    import megatron_moe.training as training

    publish(tmp_path, 200)
    monkeypatch.setattr(training, "build_tokenizer", lambda data: None)

    def no_model(*args, **kwargs):
        raise AssertionError("the model was set up")

    monkeypatch.setattr(training, "transformer_config", no_model)
    run = cfg("--load", str(tmp_path), "--save", str(tmp_path), "--train-iters", "200")
    with caplog.at_level(logging.INFO, logger="megatron_moe"):
        assert training._train(run, None, None) == []
    assert caplog.messages == [
        f"checkpoint at iteration 200 >= --train-iters 200: nothing to train ({tmp_path / 'iter_0000200'}); raise "
        "--train-iters to train on, or give another --load/--save to start a new run"
    ]
    with pytest.raises(AssertionError, match="the model was set up"):  # iterations left: on to the model
        training._train(cfg("--load", str(tmp_path), "--train-iters", "201"), None, None)
