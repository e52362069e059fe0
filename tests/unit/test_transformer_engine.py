"""transformer-engine: the version range megatron-core 0.16.1 supports, and checkpoints that move
between the local and the transformer-engine layer specs, on CPU without transformer-engine.

transformer-engine is a GPU build, so its modules are stood in for by megatron-core's local ones with what sets
them apart in a checkpoint, as written in megatron-core 0.16.1's extensions/transformer_engine.py and
extensions/transformer_engine_spec_provider.py, and in transformer-engine's TransformerEngineBaseModule:

- TEColumnParallelLinear / TERowParallelLinear: parameters `weight` and `bias`, sharded as megatron-core's
  ColumnParallelLinear / RowParallelLinear shard theirs ({"weight": 0, "bias": 0} and {"weight": 1}), plus an
  `_extra_state` (transformer-engine's FP8 metadata: a uint8 tensor; None loads as "nothing");
- TELayerNormColumnParallelLinear: the same plus `layer_norm_weight` (and `layer_norm_bias` for LayerNorm), what
  TESpecProvider.column_parallel_layer_norm_linear() gives when fuse_layernorm_and_linear() is True;
- TEDotProductAttention: an `_extra_state` in its module state dict, none in its sharded state dict (it shards
  only a learnable softmax offset).
"""

import ast
import importlib.metadata
import os
import pickle

import pytest
import torch
from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention
from packaging.requirements import Requirement

from megatron_moe.config import parse_args
from tests.conftest import ROOT

VOCAB = 128
FLAGS = [
    "--data-path", "d", "--tokenizer-model", "t", "--num-layers", "2", "--hidden-size", "64",
    "--num-attention-heads", "4", "--seq-length", "32", "--num-experts", "4", "--moe-layer-freq", "2",
    "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2",
]  # fmt: skip


class TEExtraState:
    """transformer-engine's `_extra_state`: a serialized byte tensor out, whatever comes in is recorded."""

    loaded: list = []

    def get_extra_state(self):
        return torch.frombuffer(bytearray(pickle.dumps({"fp8": False})), dtype=torch.uint8)

    def set_extra_state(self, state):
        TEExtraState.loaded.append(state)


class TEColumnParallelLinear(TEExtraState, ColumnParallelLinear):
    pass


class TERowParallelLinear(TEExtraState, RowParallelLinear):
    pass


class TELayerNormColumnParallelLinear(TEExtraState, ColumnParallelLinear):
    """transformer-engine's fused norm + column-parallel linear: the norm's parameters live in the linear."""

    def __init__(self, input_size, output_size, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size))
        if config.normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(torch.zeros(input_size))

    def forward(self, x):
        normed = torch.nn.functional.layer_norm(x, x.shape[-1:], self.layer_norm_weight, self.layer_norm_bias)
        return super().forward(normed)


class TEDotProductAttention(TEExtraState, DotProductAttention):
    pass


class TESpecProvider(BackendSpecProvider):
    """TESpecProvider's choices, with the stand-ins above."""

    def linear(self):
        return TEColumnParallelLinear

    def column_parallel_linear(self):
        return TEColumnParallelLinear

    def row_parallel_linear(self):
        return TERowParallelLinear

    def fuse_layernorm_and_linear(self):
        return True

    def column_parallel_layer_norm_linear(self):
        return TELayerNormColumnParallelLinear

    def layer_norm(self, rms_norm=False, for_qk=False):
        raise AssertionError("the layer spec keeps its own norms")

    def core_attention(self):
        return TEDotProductAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm, moe_use_legacy_grouped_gemm):
        return LocalSpecProvider().grouped_mlp_modules(moe_use_grouped_gemm, moe_use_legacy_grouped_gemm)

    def activation_func(self):
        return None


@pytest.fixture
def te_layers(monkeypatch):
    """Models built from now on use the transformer-engine spec, with the stand-ins; returns a switch back."""
    from megatron_moe.model import builder, spec

    def use(te: bool):
        monkeypatch.setattr(builder, "use_transformer_engine", lambda cfg: te)
        provider = {True: TESpecProvider, False: LocalSpecProvider}
        monkeypatch.setattr(spec, "backend_provider", lambda use_te: provider[use_te]())

    use(True)
    return use


def build(*flags, root=None):
    from megatron_moe.model import transformer_config
    from megatron_moe.training.setup import build_ddp_model, build_optimizer, build_scheduler

    cfg = parse_args([*FLAGS, *flags, *(["--save", str(root), "--load", str(root)] if root else [])])
    cfg.validate(world_size=1)
    model = build_ddp_model(cfg, transformer_config(cfg), VOCAB)
    optimizer = build_optimizer(cfg, model)
    return cfg, model, optimizer, build_scheduler(cfg, optimizer)


def checkpoint_entries(module) -> dict[str, tuple]:
    """{dist-checkpoint key: (kind, global shape)} of a model's sharded state dict."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {
        v.key: ("tensor", tuple(v.global_shape)) if isinstance(v, ShardedTensor) else ("object", None)
        for v in nested_values(module.sharded_state_dict())
    }


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear"],
        ["--qk-layernorm", "--kv-channels", "32", "--num-query-groups", "2"],  # Qwen3's attention
    ],
)
def test_the_te_and_local_specs_write_the_same_checkpoint_keys(megatron_world1, te_layers, flags):
    (te,) = build(*flags)[1]
    te_layers(False)
    (local,) = build(*flags)[1]
    assert checkpoint_entries(te.module) == checkpoint_entries(local.module)
    # Our norms are never fused into transformer-engine's linears: none of the names that megatron-core's own local
    # spec maps its norms onto for TE compatibility (sharded_state_dict_keys_map) appears in either model.
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    fused_names = get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map.values()
    assert set(fused_names) == {"self_attention.linear_qkv.layer_norm_", "mlp.linear_fc1.layer_norm_"}
    for key in checkpoint_entries(te.module):
        assert not any(name in key for name in fused_names), key
    # The module state dicts differ by transformer-engine's attention extra state only, which no checkpoint holds.
    extra = set(te.module.state_dict()) - set(local.module.state_dict())
    assert extra == {f"decoder.layers.{i}.self_attention.core_attention._extra_state" for i in (0, 1)}
    assert set(local.module.state_dict()) <= set(te.module.state_dict())


def test_a_checkpoint_saved_without_te_loads_with_te_and_back(megatron_world1, te_layers, tmp_path):
    from megatron_moe.checkpointing import TrainState, load_checkpoint, save_checkpoint

    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(32).expand(2, 32)

    def logits(model):
        with torch.no_grad():
            return model[0].module(tokens, positions, None)

    def randomize(model, seed):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model[0].module.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05 + (1.0 if p.dim() == 1 else 0.0))

    def weights(model):
        return {n: p.detach().clone() for n, p in model[0].module.named_parameters()}

    def adam_state(run):
        _, model, optimizer, _ = run
        state = {}
        for chained in optimizer.chained_optimizers:  # the dense parameters' and the experts'
            state.update(chained.optimizer.state)
        return {n: state[p]["exp_avg_sq"].clone() for n, p in model[0].module.named_parameters()}

    def train_step(run):
        """One optimizer step, so the checkpoint holds Adam's state too."""
        _, model, optimizer, _ = run
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        model[0](tokens, positions, None, labels=tokens).float().mean().backward()
        model[0].finish_grad_sync()
        assert optimizer.step()[0]

    te_layers(False)
    without = build(root=tmp_path / "without_te")
    train_step(without)
    randomize(without[1], 1)
    save_checkpoint(str(tmp_path / "without_te"), *without, TrainState(iteration=1))
    te_layers(True)
    with_te = build(root=tmp_path / "with_te")
    TEExtraState.loaded.clear()
    load_checkpoint(str(tmp_path / "without_te" / "iter_0000001"), *with_te[:4])
    assert TEExtraState.loaded and all(state is None for state in TEExtraState.loaded)  # transformer-engine: no-op
    assert weights(with_te[1]).keys() == weights(without[1]).keys()
    assert all(torch.equal(a, weights(without[1])[n]) for n, a in weights(with_te[1]).items())
    torch.testing.assert_close(logits(with_te[1]), logits(without[1]), rtol=0, atol=0)
    saved_adam = adam_state(without)
    assert all(torch.equal(a, saved_adam[n]) for n, a in adam_state(with_te).items())
    # ... and back: trained on with transformer-engine, saved, loaded without it.
    train_step(with_te)
    randomize(with_te[1], 2)
    save_checkpoint(str(tmp_path / "with_te"), *with_te, TrainState(iteration=2))
    te_layers(False)
    back = build(root=tmp_path / "with_te")
    load_checkpoint(str(tmp_path / "with_te" / "iter_0000002"), *back[:4])
    assert all(torch.equal(a, weights(with_te[1])[n]) for n, a in weights(back[1]).items())
    torch.testing.assert_close(logits(back[1]), logits(with_te[1]), rtol=0, atol=0)


def test_a_missing_entry_other_than_te_extra_state_is_still_refused(megatron_world1):
    from megatron_moe.checkpointing import load_model_state
    from megatron_moe.config import ConfigError

    module = torch.nn.Linear(2, 2)
    load_model_state(module, module.state_dict(), "ckpt")
    with pytest.raises(ConfigError, match=r"--load=ckpt: the loaded state lacks 1 .*\(e.g. bias\)"):
        load_model_state(module, {"weight": module.weight.detach()}, "ckpt")


def gpu_extra() -> list[str]:
    """The `gpu` extra of setup.py, read from its source."""
    tree = ast.parse(open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    extras = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "extras_require"))
    return extras["gpu"]


def test_the_gpu_extra_pins_the_transformer_engine_range_megatron_core_supports():
    ours = next(Requirement(r) for r in gpu_extra() if Requirement(r).name == "transformer-engine")
    mcore = next(
        Requirement(r)
        for r in importlib.metadata.requires("megatron-core")
        if Requirement(r).name == "transformer-engine" and 'extra == "dev"' in r
    )
    assert str(ours.specifier) == str(mcore.specifier) == "<2.12.0,>=2.9.0a0"
    assert "pytorch" in ours.extras
    assert not ours.specifier.contains("2.8.0") and ours.specifier.contains("2.10.0")
    assert not ours.specifier.contains("2.12.0")
