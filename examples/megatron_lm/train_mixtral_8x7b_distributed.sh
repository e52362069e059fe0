#!/bin/bash
# Test fixture: Megatron-LM's own launch script, its flags as written. Source: NVIDIA/Megatron-LM
# examples/mixtral/train_mixtral_8x7b_distributed.sh (commit 9b8acfd0dbf7). Changed, sizes and paths only:
#   GPUS_PER_NODE 8 -> 2; --seq-length 4096 -> 64; --num-layers 32 -> 2; --hidden-size 4096 -> 64;
#   --ffn-hidden-size 14336 -> 128; --num-attention-heads 32 -> 4; --num-query-groups 8 -> 2;
#   --global-batch-size 256 -> 4; --train-iters 500000 -> 4; --lr-decay-iters 320000 -> 4;
#   --lr-warmup-iters 500 -> 1; --pipeline-model-parallel-size 4 -> 1; --expert-model-parallel-size 8 -> 2;
#   --save-interval 10000 -> 4; --eval-interval 1000 -> 4; --eval-iters 10 -> 1;
#   pretrain_gpt.py -> this repository's pretrain_gpt_moe.py.
# tests/unit/test_megatron_lm_scripts.py runs it with DRY_RUN=1 (flags and files checked, nothing trained; the
# start-up notes it prints are listed there); tests/distributed/test_megatron_lm_scripts.py trains it (CPU
# processes, gloo) on over 10,000 documents (the split 99990,8,2 gives validation one) and saves.
#
#   DRY_RUN=1 bash examples/megatron_lm/train_mixtral_8x7b_distributed.sh CHECKPOINT_DIR TOKENIZER.model DATA_PREFIX

# Runs Mixtral 8x7B model

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=2
# Change for multinode config
MASTER_ADDR=${MASTER_ADDR:-"localhost"}
MASTER_PORT=${MASTER_PORT:-"6000"}
NNODES=${SLURM_NNODES:-"1"}
NODE_RANK=${RANK:-"0"}
WORLD_SIZE=$(($GPUS_PER_NODE*$NNODES))

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

MODEL_ARGS=(
    --use-mcore-models
    --disable-bias-linear
    --seq-length 64
    --max-position-embeddings 32768
    --num-layers 2
    --hidden-size 64
    --ffn-hidden-size 128
    --num-attention-heads 4
    --init-method-std 0.01
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --normalization RMSNorm
    --position-embedding-type rope
    --swiglu
    --untie-embeddings-and-output-weights
    --group-query-attention
    --num-query-groups 2
    --no-masked-softmax-fusion
    --no-position-embedding
    --rotary-base 1000000
)

MOE_ARGS=(
    --num-experts 8
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
    --overlap-param-gather
    --overlap-grad-reduce
)

DATA_ARGS=(
    --tokenizer-type Llama2Tokenizer
    --tokenizer-model ${TOKENIZER_MODEL}
    --data-path $DATA_PATH
    --split 99990,8,2
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 4
    --lr 1e-4
    --train-iters 4
    --lr-decay-iters 4
    --lr-decay-style cosine
    --min-lr 1.0e-5
    --weight-decay 0.1
    --lr-warmup-iters 1
    --clip-grad 1.0
    --bf16
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
    --expert-model-parallel-size 2
    --use-distributed-optimizer
    --sequence-parallel
)

LOGGING_ARGS=(
    --log-interval 1 \
    --save-interval 4 \
    --eval-interval 4 \
    --eval-iters 1 \
    --save $CHECKPOINT_PATH \
    --load $CHECKPOINT_PATH \
    --tensorboard-dir "${CHECKPOINT_PATH}/tensorboard" \
    --no-load-optim \
    --no-load-rng
)

if [ -n "${WANDB_API_KEY}" ]; then
    LOGGING_ARGS+=(
        --wandb-project ${WANDB_PROJECT:-"Mixtral"}
        --wandb-exp-name ${WANDB_NAME:-"Mixtral_8x7B"}
    )
fi


torchrun ${DISTRIBUTED_ARGS[@]} "$(dirname "$0")/../../pretrain_gpt_moe.py" \
    ${MODEL_ARGS[@]} \
    ${MOE_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${LOGGING_ARGS[@]}
