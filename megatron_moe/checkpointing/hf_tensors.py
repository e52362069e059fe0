"""HuggingFace tensor names of the families (`hf_families.py`) <-> megatron_moe's: one table of rows per layer part.

`rows(cfg, ...)` yields, per layer, `Row`s for `cfg`'s family: each our tensor(s) <-> HF tensor(s) with an exact
split and merge, so that a round trip is bit-identical. The families share the rows where they agree (norms,
o_proj, the router, the experts) and differ in the attention rows (GQA's fused QKV, its bias and query/key norms;
or MLA's projections and latent norms) and the MoE block (prefix, expert names, shared expert and its gate, the
correction bias). Inputs: our single-process (TP=PP=EP=1) state dict, or HF tensors (published per-expert names, or
transformers 5's fused `experts.gate_up_proj` / `down_proj`). Padded vocabulary rows are dropped on export and zero
on import. DeepSeek-V3's MTP layers go after the decoder's, as DeepSeek publishes them (`model.layers.{L+k}`:
enorm, hnorm, eh_proj, shared_head and a decoder layer's tensors); transformers ignores them.
Legend (docs/shapes.md): E experts, F expert ffn width, H hidden, V vocab, A key/value groups, M query heads per
group, D head dim. How each side lays out QKV, the experts and the vocabulary: docs/internals/checkpointing.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch

from megatron_moe.checkpointing.hf_families import DEEPSEEK_V3, MLP_NAMES, Family, family_of
from megatron_moe.config import RunConfig


@dataclasses.dataclass(frozen=True)
class Row:
    """Our tensors `ours` <-> HF tensors `hf` (full names), `to_hf(*ours) -> hf tuple`, `from_hf(*hf) -> ours
    tuple`. `imported=False`: a copy HF keeps that ours shares (the MTP layers' embedding and head)."""

    ours: tuple[str, ...]
    hf: tuple[str, ...]
    to_hf: Callable = lambda *t: t
    from_hf: Callable = lambda *t: t
    imported: bool = True


def _split(sizes: list[int], dim: int = 0) -> Callable:
    return lambda t: tuple(torch.split(t, sizes, dim=dim))


def _cat(dim: int = 0) -> Callable:
    return lambda *ts: (torch.cat(ts, dim=dim),)


def _qkv_rows(cfg: RunConfig, ours: str, hf: str, kind: str) -> Row:
    """megatron-core's fused QKV ([A, (M + 2) D] rows, a group's queries then its key and value) <-> q/k/v_proj."""
    m = cfg.model
    A = m.num_query_groups or m.num_attention_heads
    M, D = m.num_attention_heads // A, m.head_dim

    def to_hf(w):
        q, k, v = torch.split(w.reshape(A, (M + 2) * D, -1), [M * D, D, D], dim=1)
        return tuple(t.reshape(-1, *w.shape[1:]) for t in (q, k, v))

    def from_hf(q, k, v):
        rest = q.shape[1:]
        merged = torch.cat([q.reshape(A, M * D, -1), k.reshape(A, D, -1), v.reshape(A, D, -1)], dim=1)
        return (merged.reshape(-1, *rest),)

    names = tuple(f"{hf}self_attn.{p}_proj.{kind}" for p in "qkv")
    return Row((f"{ours}self_attention.linear_qkv.{kind}",), names, to_hf, from_hf)


def _attention_rows(cfg: RunConfig, f: Family, ours: str, hf: str) -> list[Row]:
    m = cfg.model
    a, h = f"{ours}self_attention.", f"{hf}self_attn."
    rows = [Row((f"{ours}input_layernorm.weight",), (f"{hf}input_layernorm.weight",))]
    if f.mla:
        if m.q_lora_rank:
            rows += [
                Row((f"{a}linear_q_down_proj.weight",), (f"{h}q_a_proj.weight",)),
                Row((f"{a}q_layernorm.weight",), (f"{h}q_a_layernorm.weight",)),
                Row((f"{a}linear_q_up_proj.weight",), (f"{h}q_b_proj.weight",)),
            ]
        else:
            rows.append(Row((f"{a}linear_q_proj.weight",), (f"{h}q_proj.weight",)))
        rows += [
            Row((f"{a}linear_kv_down_proj.weight",), (f"{h}kv_a_proj_with_mqa.weight",)),
            Row((f"{a}kv_layernorm.weight",), (f"{h}kv_a_layernorm.weight",)),
            Row((f"{a}linear_kv_up_proj.weight",), (f"{h}kv_b_proj.weight",)),
        ]
    else:
        rows.append(_qkv_rows(cfg, ours, hf, "weight"))
        if m.add_qkv_bias:
            rows.append(_qkv_rows(cfg, ours, hf, "bias"))
        if m.qk_layernorm:
            rows += [
                Row((f"{a}q_layernorm.weight",), (f"{h}q_norm.weight",)),
                Row((f"{a}k_layernorm.weight",), (f"{h}k_norm.weight",)),
            ]
    rows.append(Row((f"{a}linear_proj.weight",), (f"{h}o_proj.weight",)))
    return rows


def _mlp_rows(cfg: RunConfig, f: Family, ours: str, hf: str, is_moe: bool) -> list[Row]:
    m, moe = cfg.model, cfg.moe
    rows = [Row((f"{ours}pre_mlp_layernorm.weight",), (f"{hf}post_attention_layernorm.weight",))]
    if not is_moe:  # a dense layer: megatron-core's MLP, fc1 = [gate; up]
        names = tuple(f"{hf}mlp.{p}.weight" for p in MLP_NAMES)
        rows.append(Row((f"{ours}mlp.linear_fc1.weight",), names[:2], _split([m.ffn_width] * 2), _cat()))
        return rows + [Row((f"{ours}mlp.linear_fc2.weight",), names[2:])]
    block, E, F = f"{hf}{f.moe}", moe.num_experts, moe.expert_ffn_width(m)
    gate, up, down = f.experts
    rows.append(Row((f"{ours}mlp.gate.weight",), (f"{block}gate.weight",)))
    if f is DEEPSEEK_V3:  # zero where the run has none: the same choices
        bias = (f"{block}gate.e_score_correction_bias",)
        if moe.moe_router_enable_expert_bias:
            rows.append(Row((f"{ours}mlp.gate.expert_bias",), bias))
        else:
            rows.append(Row((), bias, lambda: (torch.zeros(E),), imported=False))
    gate_up = tuple(f"{block}experts.{e}.{p}.weight" for e in range(E) for p in (gate, up))
    rows.append(Row((f"{ours}mlp.experts.weight1",), gate_up, _experts_to_hf(F), _experts_from_hf))
    downs = tuple(f"{block}experts.{e}.{down}.weight" for e in range(E))
    rows.append(Row((f"{ours}mlp.experts.weight2",), downs, lambda w: tuple(w.unbind(0)), lambda *w: (torch.stack(w),)))
    if moe.moe_shared_expert_ffn_hidden_size:
        s, width = f"{block}{f.shared}", moe.moe_shared_expert_ffn_hidden_size
        names = tuple(f"{s}{p}.weight" for p in MLP_NAMES)
        rows += [
            Row((f"{ours}mlp.shared_expert.weight1",), names[:2], _split([width] * 2), _cat()),
            Row((f"{ours}mlp.shared_expert.weight2",), names[2:]),
        ]
        if moe.moe_shared_expert_gate:
            rows.append(Row((f"{ours}mlp.shared_expert.gate_weight",), (f"{block}shared_expert_gate.weight",)))
    return rows


def _experts_to_hf(F: int) -> Callable:
    def to_hf(w1_EFH):  # [E, 2F, H]: each expert's gate then up
        return tuple(t for e in w1_EFH.unbind(0) for t in torch.split(e, [F, F]))

    return to_hf


def _experts_from_hf(*gate_up):
    return (torch.stack([torch.cat(gate_up[i : i + 2]) for i in range(0, len(gate_up), 2)]),)


def _vocab_rows(vocab: int, padded: int, ours: str, hf: str, imported: bool = True) -> Row:
    def pad(w_VH):
        out = w_VH.new_zeros(padded, w_VH.shape[1])
        out[: w_VH.shape[0]] = w_VH
        return (out,)

    return Row((ours,), (hf,), lambda w: (w[:vocab],), pad, imported)


def rows(cfg: RunConfig, vocab: int, padded: int) -> Iterator[tuple[int | None, list[Row]]]:
    """(layer or None, its rows): the embeddings, final norm and head first, then each decoder layer, then each MTP
    layer (numbered after the decoder's), for `cfg`'s family."""
    f = family_of(cfg)
    m, pattern = cfg.model, cfg.moe.layer_pattern(cfg.model.num_layers)
    embedding, head = "embedding.word_embeddings.weight", "output_layer.weight"
    yield (
        None,
        [
            _vocab_rows(vocab, padded, embedding, "model.embed_tokens.weight"),
            Row(("decoder.final_layernorm.weight",), ("model.norm.weight",)),
            _vocab_rows(vocab, padded, head, "lm_head.weight"),
        ],
    )
    for i in range(m.num_layers):
        ours, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        yield i, _attention_rows(cfg, f, ours, hf) + _mlp_rows(cfg, f, ours, hf, bool(pattern[i]))
    for k in range(m.mtp_layers):  # DeepSeek-V3's layout; the layer is the decoder's last layer's kind
        ours, hf, layer = f"mtp.layers.{k}.", f"model.layers.{m.num_layers + k}.", f"mtp.layers.{k}.transformer_layer."
        yield (
            m.num_layers + k,
            [
                *(Row((f"{ours}{n}.weight",), (f"{hf}{n}.weight",)) for n in ("enorm", "hnorm", "eh_proj")),
                Row((f"{ours}final_layernorm.weight",), (f"{hf}shared_head.norm.weight",)),
                _vocab_rows(vocab, padded, embedding, f"{hf}embed_tokens.weight", imported=False),
                _vocab_rows(vocab, padded, head, f"{hf}shared_head.head.weight", imported=False),
                *_attention_rows(cfg, f, layer, hf),
                *_mlp_rows(cfg, f, layer, hf, bool(pattern[-1])),
            ],
        )


def to_hf(ours: dict[str, torch.Tensor], cfg: RunConfig, vocab_size: int):
    """Yield (layer or None, {hf name: tensor}) groups, embedding first, in the family's published names."""
    for layer, group in rows(cfg, vocab_size, vocab_size):
        tensors = {}
        for row in group:
            tensors.update(zip(row.hf, row.to_hf(*(ours[name] for name in row.ours)), strict=True))
        yield layer, tensors


def from_hf(hf: dict[str, torch.Tensor], cfg: RunConfig, padded_vocab: int) -> dict[str, torch.Tensor]:
    """Our single-process state dict from HF tensors (published or transformers' fused expert names)."""
    hf = published(hf, family_of(cfg), cfg)
    ours = {}
    for _, group in rows(cfg, padded_vocab, padded_vocab):
        for row in group:
            if row.imported and row.ours:
                ours.update(zip(row.ours, row.from_hf(*(hf[name] for name in row.hf)), strict=True))
    return ours


def published(hf: dict[str, torch.Tensor], f: Family, cfg: RunConfig) -> dict[str, torch.Tensor]:
    """`hf` with transformers 5's fused experts (`...mlp.experts.gate_up_proj` [E, 2F, H], `down_proj` [E, H, F])
    in the family's published per-expert names."""
    out, F = {}, cfg.moe.expert_ffn_width(cfg.model)
    gate, up, down = f.experts
    for name, tensor in hf.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            block = name.removesuffix("mlp.experts.gate_up_proj") + f.moe
            for e, w in enumerate(tensor.unbind(0)):
                out[f"{block}experts.{e}.{gate}.weight"], out[f"{block}experts.{e}.{up}.weight"] = w.split([F, F])
        elif name.endswith(".mlp.experts.down_proj"):
            block = name.removesuffix("mlp.experts.down_proj") + f.moe
            out.update({f"{block}experts.{e}.{down}.weight": w for e, w in enumerate(tensor.unbind(0))})
        elif f.moe != "mlp." and name.endswith(".mlp.gate.weight"):  # Mixtral's router beside its fused experts
            out[name.removesuffix("mlp.gate.weight") + f"{f.moe}gate.weight"] = tensor
        else:
            out[name] = tensor
    return out
