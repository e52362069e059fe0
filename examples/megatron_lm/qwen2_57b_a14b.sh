#!/bin/bash
# Test fixture: Megatron-LM's own Qwen2-57B-A14B model flags, as written, in a pretraining launch. Source: NVIDIA/Megatron-LM
# examples/post_training/modelopt/conf/Qwen/Qwen3-30B-A3B.sh (commit d98e8a64dd): its MODEL_ARGS, verbatim but for sizes; the
# rest (data, training, parallel and logging flags, the torchrun line) is Megatron-LM's
# examples/mixtral/train_mixtral_8x7b_distributed.sh's, the pretraining script the MODEL_ARGS files are used with.
# Changed, sizes, degrees and paths only:
#   Megatron-LM has no Qwen2-MoE script: this is its closest, the Qwen3-30B-A3B MODEL_ARGS, with
#   Qwen2-57B-A14B's own settings (its HuggingFace config.json: query/key/value biases (--add-qkv-bias), no
#   query/key norm, a shared expert of 20480 with its sigmoid gate (--moe-shared-expert-gate), 64 experts of
#   2560, top-8 without normalising, RoPE base 1e6, RMSNorm 1e-6), then shrunk: --num-layers 28 -> 2;
#   --hidden-size 3584 -> 64; --ffn-hidden-size 18944 -> 192; --num-attention-heads 28 -> 4;
#   --num-query-groups 4 -> 2; --num-experts 64 -> 16; --moe-ffn-hidden-size 2560 -> 24;
#   --moe-shared-expert-intermediate-size 20480 -> 96; --seq-length 32768 -> 64;
#   the launch: 4 processes (GPUS_PER_NODE 8 -> 4), --pipeline-model-parallel-size 4 -> 2,
#   --expert-model-parallel-size 8 -> 2, --global-batch-size 256 -> 4, --train-iters 500000 -> 4,
#   --lr-decay-iters 320000 -> 4, --lr-warmup-iters 500 -> 1, --save-interval 10000 -> 2,
#   --eval-interval 1000 -> 2, --eval-iters 10 -> 1; the tokenizer's path and --data-path are the arguments.
# tests/distributed/test_megatron_lm_family_scripts.py trains it on CPU processes (gloo), saves, resumes, validates.
#
#   DRY_RUN=1 bash examples/megatron_lm/qwen2_57b_a14b.sh CHECKPOINT_DIR TOKENIZER_DIR DATA_PREFIX

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
    --add-qkv-bias \
    --untie-embeddings-and-output-weights \
    --position-embedding-type rope \
    --no-rope-fusion \
    --normalization RMSNorm \
    --norm-epsilon 1e-6 \
    --swiglu \
    --num-layers 2 \
    --hidden-size 64 \
    --ffn-hidden-size 192 \
    --num-attention-heads 4 \
    --group-query-attention \
    --num-query-groups 2 \
    --num-experts 16 \
    --moe-ffn-hidden-size 24 \
    --moe-router-topk 8 \
    --moe-shared-expert-intermediate-size 96 \
    --moe-shared-expert-gate \
    --moe-router-dtype fp32 \
    --moe-aux-loss-coeff 1e-3 \
    --moe-token-dispatcher-type alltoall \
    --moe-router-load-balancing-type aux_loss \
    --seq-length 64 \
    --max-position-embeddings 32768 \
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
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 2
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
