#!/bin/bash
# Test fixture: Megatron-LM's own Qwen3-30B-A3B model flags, as written, in a pretraining launch. Source: NVIDIA/Megatron-LM
# examples/post_training/modelopt/conf/Qwen/Qwen3-30B-A3B.sh (commit d98e8a64dd): its MODEL_ARGS, verbatim but for sizes; the
# rest (data, training, parallel and logging flags, the torchrun line) is Megatron-LM's
# examples/mixtral/train_mixtral_8x7b_distributed.sh's, the pretraining script the MODEL_ARGS files are used with.
# Changed, sizes, degrees and paths only:
#   MODEL_ARGS: --num-layers 48 -> 2; --hidden-size 2048 -> 64; --ffn-hidden-size 6144 -> 192;
#   --num-attention-heads 32 -> 4; --num-query-groups 4 -> 2; --kv-channels 128 -> 32 (still not hidden / heads);
#   --num-experts 128 -> 32; --moe-ffn-hidden-size 768 -> 24; --seq-length 4096 -> 64;
#   --make-vocab-size-divisible-by 1187 -> 128 (the test tokenizer's vocabulary is 2,000; and here the multiple
#   must divide by TP, see docs/flags.md); the launch: 4 processes (GPUS_PER_NODE 8 -> 4),
#   --tensor-model-parallel-size 2, --expert-model-parallel-size 8 -> 2, --pipeline-model-parallel-size 4 -> 1,
#   --global-batch-size 256 -> 4, --train-iters 500000 -> 4, --lr-decay-iters 320000 -> 4,
#   --lr-warmup-iters 500 -> 1, --save-interval 10000 -> 2, --eval-interval 1000 -> 2, --eval-iters 10 -> 1;
#   the tokenizer's path (Qwen/Qwen3-30B-A3B) and --data-path are the arguments.
# tests/distributed/test_megatron_lm_family_scripts.py trains it on CPU processes (gloo), saves, resumes, validates.
#
#   DRY_RUN=1 bash examples/megatron_lm/qwen3_30b_a3b.sh CHECKPOINT_DIR TOKENIZER_DIR DATA_PREFIX

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=4
MASTER_ADDR=${MASTER_ADDR:-"localhost"}
MASTER_PORT=${MASTER_PORT:-"6000"}
NNODES=${SLURM_NNODES:-"1"}
NODE_RANK=${RANK:-"0"}

CHECKPOINT_PATH=$1
TOKENIZER_MODEL=$2
DATA_PATH=$3

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NNODES
    --node_rank $NODE_RANK
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

MODEL_ARGS=" \
    --save-interval 100000 \
    --micro-batch-size 1 \
    --bf16 \
    --no-masked-softmax-fusion \
    --disable-bias-linear \
    --untie-embeddings-and-output-weights \
    --position-embedding-type rope \
    --no-rope-fusion \
    --normalization RMSNorm \
    --swiglu \
    --num-layers 2 \
    --hidden-size 64 \
    --ffn-hidden-size 192 \
    --num-attention-heads 4 \
    --group-query-attention \
    --num-query-groups 2 \
    --kv-channels 32 \
    --qk-layernorm \
    --num-experts 32 \
    --moe-ffn-hidden-size 24 \
    --moe-router-topk 8 \
    --moe-router-dtype fp32 \
    --moe-aux-loss-coeff 1e-3 \
    --moe-token-dispatcher-type alltoall \
    --moe-router-load-balancing-type aux_loss \
    --seq-length 64 \
    --max-position-embeddings 40960 \
    --tokenizer-type HuggingFaceTokenizer \
    --make-vocab-size-divisible-by 128 \
    --use-mcore-models \
    --rotary-percent 1.0 \
    --rotary-base 1000000 \
    --no-bias-swiglu-fusion \
    --sequence-parallel \
"

DATA_ARGS=(
    --tokenizer-model ${TOKENIZER_MODEL}
    --data-path $DATA_PATH
    --split 99990,8,2
)

TRAINING_ARGS=(
    --global-batch-size 4
    --lr 1e-4
    --train-iters 4
    --lr-decay-iters 4
    --lr-decay-style cosine
    --min-lr 1.0e-5
    --weight-decay 0.1
    --lr-warmup-iters 1
    --clip-grad 1.0
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 1
    --expert-model-parallel-size 2
    --use-distributed-optimizer
)

LOGGING_ARGS=(
    --log-interval 1 \
    --save-interval 2 \
    --eval-interval 2 \
    --eval-iters 1 \
    --save $CHECKPOINT_PATH \
    --load $CHECKPOINT_PATH \
    --tensorboard-dir "${CHECKPOINT_PATH}/tensorboard" \
)

torchrun ${DISTRIBUTED_ARGS[@]} "$(dirname "$0")/../../pretrain_gpt_moe.py" \
    ${MODEL_ARGS} \
    ${DATA_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${LOGGING_ARGS[@]}
