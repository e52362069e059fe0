"""Export to / import from HuggingFace (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3), checked by logits with transformers.

All three run in one CPU process (TP=PP=EP=1, fp32): dist_checkpointing
reshards a checkpoint of any layout into it on load, and a checkpoint it saves
loads into any layout. The whole model sits in host memory once.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
from collections.abc import Callable

import torch
from megatron.core import dist_checkpointing

from megatron_moe.checkpointing import TrainState, hf_families, hf_tensors
from megatron_moe.checkpointing.hf_families import HF_DIRECTORY, read_hf_config
from megatron_moe.checkpointing.hf_tokenizer import tokenizer_flags_of, write_hf_tokenizer
from megatron_moe.config import ConfigError, DataConfig, RunConfig, parse_args
from megatron_moe.data.tokenizer import build_tokenizer
from megatron_moe.files import give_usual_permissions
from megatron_moe.platform.process import init_single_process

log = logging.getLogger("megatron_moe")
SINGLE = dict(
    tensor_model_parallel_size=1,
    pipeline_model_parallel_size=1,
    num_layers_per_virtual_pipeline_stage=None,
    num_virtual_stages_per_pipeline_rank=None,
    expert_model_parallel_size=1,
    expert_tensor_parallel_size=None,
    context_parallel_size=1,
    sequence_parallel=False,
    use_distributed_optimizer=False,
)
SINGLE_MOE = dict(
    moe_expert_capacity_factor=None,
    moe_pad_expert_input_to_capacity=False,
    moe_token_drop_policy=None,
    moe_pipeline_degree=1,
    moe_bp_pipeline_degree=1,
    moe_router_force_load_balancing=False,
    moe_router_force_biased=None,
)
"""Our MoE layer as transformers runs these families: dropless (a run trained with a capacity is compared with it,
and served, without one); not pipelined (one process has no all-to-all to hide; "auto" would say so once per
layer); routed by its router (a benchmark run's --moe-router-force-load-balancing / --moe-router-force-biased
replace the logits by random ones in training: what is exported, and checked, is the router the weights hold, as
Megatron-LM's own DeepSeek-V3 script trains with the first)."""


def build_single(cfg: RunConfig, vocab_size: int):
    from megatron_moe.model import build_model, transformer_config

    for name, value in SINGLE.items():
        setattr(cfg.parallel, name, value)
    for name, value in SINGLE_MOE.items():
        setattr(cfg.moe, name, value)
    cfg.training.bf16 = cfg.training.fp16 = False
    cfg.validate(world_size=1)
    return build_model(cfg, transformer_config(cfg), vocab_size).eval()


def load_single(ckpt: str, tokenizer_model: str | None = None):
    """(cfg, model, tokenizer) from a megatron_moe checkpoint directory of any layout. The tokenizer is the run's
    (its saved --tokenizer-type and files), or the one `tokenizer_model` holds (a .model, a tokenizer.json or a
    HuggingFace directory)."""
    from megatron_moe.checkpointing import resolve_load_dir

    init_single_process(backend="gloo")
    probe = parse_args(["--data-path", "x", "--tokenizer-model", "x", "--load", ckpt])
    path = resolve_load_dir(probe)
    common = dist_checkpointing.load_common_state_dict(path)
    cfg = RunConfig.from_dict(common["config"])
    if tokenizer_model is not None:
        cfg.data = tokenizer_flags_of(tokenizer_model, cfg.data)
    tokenizer = build_tokenizer(cfg.data)
    model = build_single(cfg, tokenizer.vocab_size)
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
    model.load_state_dict(state["model"])
    return cfg, model, tokenizer


@contextlib.contextmanager
def _fresh_dir(path: str, overwrite: bool, flag: str):
    """A new `path`.tmp to write into, renamed to `path` by the caller; removed on any error (a full disk, a
    read-only folder: `unwritable` names it), so that nothing partial is left, no `hf.tmp/`."""
    if os.path.exists(path) and os.listdir(path):
        if not overwrite:
            raise ConfigError(f"{flag}={path} exists and is not empty; choose a new directory or pass --overwrite")
        shutil.rmtree(path)
    tmp = path.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        yield tmp
    except OSError as error:
        raise unwritable(flag, path, error) from None
    except Exception as error:
        if "No space left on device" in str(error) or "StorageFull" in str(error):  # safetensors' own error type
            raise unwritable(flag, path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))) from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def unwritable(flag: str, path: str, error: OSError) -> ConfigError:
    """One line for an output that could not be written: the flag, the file, why, what to do."""
    where = error.filename or path
    return ConfigError(
        f"{flag}={path}: cannot write {where}: {error.strerror or error}; free space there or give a {flag} in a "
        f"writable folder with room (nothing was written)"
    )


def export_hf(
    ckpt: str,
    out: str,
    *,
    tokenizer_model: str | None = None,
    overwrite: bool = False,
    progress: Callable[[str], None] = log.info,
) -> str:
    """Write `ckpt` as an HF model directory of its family (config, safetensors, tokenizer); returns `out`."""
    cfg, model, tokenizer = load_single(ckpt, tokenizer_model)
    family = hf_families.check_exportable(cfg)
    progress(f"export: as HuggingFace {family.name} ({family.architecture})")
    with _fresh_dir(out, overwrite, "--save") as tmp:
        _write_hf(tmp, cfg, model, tokenizer, progress)
        os.replace(tmp, out)
    return out


def _write_hf(tmp: str, cfg: RunConfig, model, tokenizer, progress: Callable[[str], None]) -> None:
    from safetensors.torch import save_file

    ours = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    tensors = {}
    for layer, group in hf_tensors.to_hf(ours, cfg, tokenizer.vocab_size):
        tensors.update({k: v.contiguous().to("cpu", copy=True) for k, v in group.items()})
        progress(
            f"export: {'embeddings, final norm, lm head' if layer is None else f'layer {layer}'} ({len(group)} tensors)"
        )
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    bos = tokenizer.bos if tokenizer.bos >= 0 else None
    config = hf_families.hf_config(cfg, tokenizer.vocab_size, bos, tokenizer.eod)
    _write_json(os.path.join(tmp, "config.json"), config)
    _write_json(os.path.join(tmp, "generation_config.json"), {"bos_token_id": bos, "eos_token_id": tokenizer.eod})
    written = write_hf_tokenizer(tokenizer, tmp)
    progress(f"export: tokenizer {tokenizer.description} as {', '.join(written)}")
    give_usual_permissions(tmp)  # safetensors writes 0600


def _write_json(path: str, value: dict) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2)


def read_hf_tensors(hf_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    if not files:
        raise ConfigError(f"--load={hf_dir}: no *.safetensors files; give {HF_DIRECTORY}")
    tensors = {}
    for name in files:
        tensors.update(load_file(os.path.join(hf_dir, name)))
    return tensors


def import_hf(
    hf_dir: str,
    out: str,
    *,
    extra_flags: list[str] = (),
    overwrite: bool = False,
    progress: Callable[[str], None] = log.info,
    tokenizer_home: str | None = None,
) -> str:
    """Write an HF model directory of one of the families as a megatron_moe checkpoint (iteration 0, no
    optimizer). Its tokenizer (tokenizer.model, else tokenizer.json) is copied into the checkpoint and recorded as
    the run's, as the copy in `tokenizer_home` (default `out`; `import-hf` into a layout names the resharded
    directory, which gets the copy, not this staging one). DeepSeek-V3's MTP layers come along where its
    safetensors carry them (said either way)."""
    config = read_hf_config(hf_dir)
    init_single_process(backend="gloo")
    data = tokenizer_flags_of(hf_dir, DataConfig(), flag="--load")
    tokenizer_flags = ["--tokenizer-type", data.tokenizer_type, "--tokenizer-model", data.tokenizer_model]
    hf = read_hf_tensors(hf_dir)
    mtp = _mtp_layers_carried(config, hf, progress)
    flags = hf_families.run_flags_from_hf(config, mtp)
    cfg = parse_args([*flags, "--data-path", "unset", *tokenizer_flags, *extra_flags])
    tokenizer = build_tokenizer(cfg.data)
    vocab = max(config["vocab_size"], tokenizer.vocab_size)
    model = build_single(cfg, vocab)
    from megatron_moe.model.builder import padded_vocab_size

    ours = hf_tensors.from_hf(hf, cfg, padded_vocab_size(vocab, cfg))
    progress(f"import: {len(hf)} HF tensors -> {len(ours)} megatron_moe tensors")
    missing, unexpected = model.load_state_dict(ours, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ConfigError(
            f"--load={hf_dir}: weights do not match the model: missing {missing}, unexpected {unexpected}"
        )
    with _fresh_dir(out, overwrite, "--save") as tmp:
        for path in (*tokenizer.files, *getattr(tokenizer, "config_files", ())):
            shutil.copyfile(path, os.path.join(tmp, os.path.basename(path)))
        home = os.path.abspath(tokenizer_home or out)
        cfg.data.tokenizer_model = os.path.join(home, os.path.basename(tokenizer.files[0]))
        save_single(tmp, cfg, model)
        os.replace(tmp, out)
    return out


def _mtp_layers_carried(config: dict, hf: dict, progress: Callable[[str], None]) -> int:
    """DeepSeek-V3's MTP layers that `hf` holds (its published `model.layers.{L+k}.eh_proj`), said when config.json
    announces more than it carries (transformers' own save_pretrained writes none)."""
    announced = config.get("num_nextn_predict_layers", 0) if config["model_type"] == "deepseek_v3" else 0
    layers = config["num_hidden_layers"]
    carried = 0
    while carried < announced and f"model.layers.{layers + carried}.eh_proj.weight" in hf:
        carried += 1
    if carried < announced:
        progress(
            f"import: config.json's num_nextn_predict_layers={announced}, its tensors carry {carried} MTP layers "
            f"(no model.layers.{layers + carried}.eh_proj.weight): imported with --mtp-num-layers {carried}"
        )
    return carried


def save_single(root: str, cfg: RunConfig, model) -> None:
    """Save a single-process model's weights as iteration 0 of a --save directory (no optimizer)."""
    from megatron_moe.checkpointing import save_checkpoint

    save_checkpoint(root, cfg, [_Unwrapped(model)], None, _NoScheduler(), TrainState())


class _Unwrapped:
    """What save_checkpoint expects of a DDP chunk: `.module`."""

    def __init__(self, module):
        self.module = module


class _NoScheduler:
    def state_dict(self):
        return {}


def probe_tokens(vocab_size: int, batch: int = 2, length: int = 24) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def max_logit_difference(model, hf_dir: str, tokens: torch.Tensor) -> float:
    """max |ours - transformers| over the logits of `tokens` [B, S] (first vocab_size entries)."""
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    hf_logits = hf_model(tokens).logits
    ours = logits(model, tokens.to(next(model.parameters()).device))  # ours may sit on the GPU
    return (ours[..., : hf_logits.shape[-1]].float().cpu() - hf_logits.float()).abs().max().item()


@torch.no_grad()
def logits(model, tokens_BS: torch.Tensor) -> torch.Tensor:
    """The main model's logits [B, S, V_pad] of `tokens_BS`, as transformers gives them: without the MTP layers,
    which are for training (megatron-core 0.16.1's GPTModel.forward runs them whenever it has them, and needs labels
    for that: `labels.clone()` of None)."""
    positions_BS = torch.arange(tokens_BS.shape[1], device=tokens_BS.device).expand_as(tokens_BS)
    kept = model.mtp_process, model.config.mtp_num_layers
    model.mtp_process, model.config.mtp_num_layers = False, None
    try:
        return model(tokens_BS, positions_BS, None)
    finally:
        model.mtp_process, model.config.mtp_num_layers = kept
