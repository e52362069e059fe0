#!/usr/bin/env bash
# Pretrain a Mixtral-8x7B-shaped model on GPUs: 32 layers, hidden 4096, FFN
# 14336, 32 heads with 8 key/value groups (GQA), an MoE in every layer (8
# experts, top-2), RMSNorm, SwiGLU, RoPE base 1e6, no linear biases, untied
# output layer, 4096-token sequences, bf16.
#
# Sized for 8 nodes x 8 GPUs (64): TP=2 with sequence parallelism, PP=4
# (8 layers a stage), EP=8 (one expert per GPU), DP=8, the distributed
# optimizer, full activation recompute. Per pipeline stage 16 GPUs =
# TP 2 x DP 8 for attention, EP 8 x expert-DP 2 for the experts.
#
#   sbatch --nodes=8 --gpus-per-node=8 \
#       --export=ALL,EXAMPLE=pretrain_mixtral_8x7b,DATA_PATH=...,TOKENIZER_MODEL=/models/mixtral/tokenizer.model \
#       examples/slurm/pretrain_gpt_moe.sbatch
#   DRY_RUN=1 NNODES=8 GPUS_PER_NODE=8 DATA_PATH=x TOKENIZER_MODEL=y examples/pretrain_mixtral_8x7b.sh
#
# Environment: DATA_PATH and its tokenizer (required: TOKENIZER_MODEL, or
# VOCAB_FILE and MERGE_FILE for GPT-2's BPE, see data_from_env in common.sh; Mixtral's own
# tokenizer.model is a SentencePiece model and works); RUN_DIR (default
# REPO/runs/mixtral_8x7b); TP (2), PP (4), EP (8), ETP (1); and the launcher
# variables of examples/common.sh. Resumes from RUN_DIR/checkpoints. Extra
# arguments override the flags below.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

RUN_DIR="${RUN_DIR:-$REPO_ROOT/runs/mixtral_8x7b}"
TP="${TP:-2}"
PP="${PP:-4}"
EP="${EP:-8}"
ETP="${ETP:-1}"  # experts whole on each rank (unset, Megatron-LM shards them over TP)
data_from_env

MODEL_ARGS=(
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 14336
    --num-attention-heads 32
    --num-query-groups 8
    --seq-length 4096
    --position-embedding-type rope
    --rotary-base 1000000
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --init-method-std 0.01
    --hidden-dropout 0.0
    --attention-dropout 0.0
)
MOE_ARGS=(
    --num-experts 8
    --moe-router-topk 2
    --moe-layer-freq 1               # every layer is an MoE layer
    --moe-aux-loss-coeff 0.01
    --moe-router-load-balancing-type aux_loss
)
DATA_ARGS=(
    --data-path "${DATA_PATHS[@]}"
    "${TOKENIZER_ARGS[@]}"
    --split 99990,8,2
)
TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 256          # 1 x DP 8 x 32 micro-batches on 64 GPUs (~1M tokens)
    --train-iters 250000
    --lr 1e-4
    --min-lr 1e-5
    --lr-warmup-iters 2000
    --lr-decay-style cosine
    --weight-decay 0.1
    --clip-grad 1.0
    --bf16
    --recompute-granularity full
    --eval-interval 1000
    --eval-iters 10
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    --expert-model-parallel-size "$EP"
    --expert-tensor-parallel-size "$ETP"
    --use-distributed-optimizer
)
if [[ "$TP" -gt 1 ]]; then
    PARALLEL_ARGS+=(--sequence-parallel)  # MoE with TP>1 needs it
fi
LOGGING_ARGS=(
    --log-interval 1
    --tensorboard-dir "$RUN_DIR/tensorboard"
)
CHECKPOINT_ARGS=(
    --save "$RUN_DIR/checkpoints"
    --load "$RUN_DIR/checkpoints"
    --save-interval 500
)

resolve_launcher "$(gpus_on_node 8)"
launch_pretrain \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" \
    "${PARALLEL_ARGS[@]}" "${LOGGING_ARGS[@]}" "${CHECKPOINT_ARGS[@]}" "$@"
