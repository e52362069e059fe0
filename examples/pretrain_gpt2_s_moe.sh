#!/usr/bin/env bash
# Pretrain GPT2-S-MoE on GPUs: GPT-2 small (12 layers, hidden 768, 12 heads,
# FFN 3072, learned positions, LayerNorm, GELU) with every other MLP replaced
# by 8 experts, top-2 routing; bf16. One node of 8 GPUs: EP=8 (one expert per
# GPU), DP=8 for the dense layers.
#
#   DATA_PATH=/data/corpus_text_document TOKENIZER_MODEL=/data/tokenizer.model \
#       examples/pretrain_gpt2_s_moe.sh
#   DRY_RUN=1 DATA_PATH=x TOKENIZER_MODEL=y examples/pretrain_gpt2_s_moe.sh   # print + check flags
#
# Environment: DATA_PATH and its tokenizer (required: TOKENIZER_MODEL, or
# VOCAB_FILE and MERGE_FILE for GPT-2's BPE; see data_from_env in common.sh); RUN_DIR (default
# REPO/runs/gpt2_s_moe: checkpoints/ and tensorboard/); EP (8); ETP (1); and the
# launcher variables of examples/common.sh (GPUS_PER_NODE defaults to the
# GPUs on this node). The run resumes from RUN_DIR/checkpoints when a
# checkpoint is there. Extra arguments override the flags below.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

RUN_DIR="${RUN_DIR:-$REPO_ROOT/runs/gpt2_s_moe}"
EP="${EP:-8}"
ETP="${ETP:-1}"  # experts whole on each rank (unset, Megatron-LM shards them over TP)
data_from_env

MODEL_ARGS=(
    --num-layers 12
    --hidden-size 768
    --ffn-hidden-size 3072
    --num-attention-heads 12
    --seq-length 1024
    --max-position-embeddings 1024
    --position-embedding-type learned_absolute
    --normalization LayerNorm
    --hidden-dropout 0.0
    --attention-dropout 0.0
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
    --micro-batch-size 8
    --global-batch-size 256          # 8 x DP 8 x 4 micro-batches on 8 GPUs
    --train-iters 40000              # ~10B tokens
    --lr 6e-4
    --min-lr 6e-5
    --lr-warmup-iters 2000
    --lr-decay-style cosine
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --clip-grad 1.0
    --bf16
    --eval-interval 1000
    --eval-iters 20
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
    --expert-model-parallel-size "$EP"
    --expert-tensor-parallel-size "$ETP"
    --use-distributed-optimizer
)
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
