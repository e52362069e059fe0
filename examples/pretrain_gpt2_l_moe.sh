#!/usr/bin/env bash
# Pretrain GPT2-L-MoE on GPUs: GPT-2 large's shape (24 layers, hidden 1024,
# 16 heads, FFN 4096) with every other MLP replaced by 8 experts, top-2
# routing; RoPE, LayerNorm, GELU, bf16. Sized for 2 nodes of 8 GPUs: EP=8,
# DP=16 for the dense layers, expert data parallelism 2.
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 DATA_PATH=... TOKENIZER_MODEL=... \
#       examples/pretrain_gpt2_l_moe.sh           # and NODE_RANK=1 on node 1
#   sbatch --nodes=2 --gpus-per-node=8 --export=ALL,EXAMPLE=pretrain_gpt2_l_moe,DATA_PATH=...,TOKENIZER_MODEL=... \
#       examples/slurm/pretrain_gpt_moe.sbatch
#   DRY_RUN=1 NNODES=2 DATA_PATH=x TOKENIZER_MODEL=y examples/pretrain_gpt2_l_moe.sh
#
# Environment: DATA_PATH and its tokenizer (required: TOKENIZER_MODEL, or
# VOCAB_FILE and MERGE_FILE for GPT-2's BPE; see data_from_env in common.sh); RUN_DIR (default
# REPO/runs/gpt2_l_moe); TP (1), EP (8), ETP (1); and the launcher variables of
# examples/common.sh. Resumes from RUN_DIR/checkpoints. Extra arguments
# override the flags below.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

RUN_DIR="${RUN_DIR:-$REPO_ROOT/runs/gpt2_l_moe}"
TP="${TP:-1}"
EP="${EP:-8}"
ETP="${ETP:-1}"  # experts whole on each rank (unset, Megatron-LM shards them over TP)
data_from_env

MODEL_ARGS=(
    --num-layers 24
    --hidden-size 1024
    --ffn-hidden-size 4096
    --num-attention-heads 16
    --seq-length 2048
    --position-embedding-type rope
    --normalization LayerNorm
)
MOE_ARGS=(
    --num-experts 8
    --moe-router-topk 2
    --moe-layer-freq 2
    --moe-aux-loss-coeff 0.01
)
DATA_ARGS=(
    --data-path "${DATA_PATHS[@]}"
    "${TOKENIZER_ARGS[@]}"
    --split 969,30,1
)
TRAINING_ARGS=(
    --micro-batch-size 4
    --global-batch-size 512          # 4 x DP 16 x 8 micro-batches on 16 GPUs
    --train-iters 30000              # ~31B tokens
    --lr 3e-4
    --min-lr 3e-5
    --lr-warmup-iters 2000
    --lr-decay-style cosine
    --weight-decay 0.1
    --clip-grad 1.0
    --bf16
    --eval-interval 1000
    --eval-iters 10
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size 1
    --expert-model-parallel-size "$EP"
    --expert-tensor-parallel-size "$ETP"
    --use-distributed-optimizer
)
if [[ "$TP" -gt 1 ]]; then
    PARALLEL_ARGS+=(--sequence-parallel)  # MoE with TP>1 needs it
fi
LOGGING_ARGS=(
    --log-interval 10
    --tensorboard-dir "$RUN_DIR/tensorboard"
)
CHECKPOINT_ARGS=(
    --save "$RUN_DIR/checkpoints"
    --load "$RUN_DIR/checkpoints"
    --save-interval 1000
)

resolve_launcher "$(gpus_on_node 8)"
launch_pretrain \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" \
    "${PARALLEL_ARGS[@]}" "${LOGGING_ARGS[@]}" "${CHECKPOINT_ARGS[@]}" "$@"
