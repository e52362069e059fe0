#!/bin/bash
# Test fixture: Megatron-LM's own launch script, its flags as written. Source: the "MoE training example" of
# NVIDIA/Megatron-LM megatron/core/transformer/moe/README.md (commit 022bcb5afe88): Mixtral 8x7B with a
# pipeline and a virtual-pipeline flag. Changed, sizes and paths only:
#   GPUS_PER_NODE 8 -> 4; --seq-length 4096 -> 64; --num-layers 32 -> 4; --hidden-size 4096 -> 64;
#   --ffn-hidden-size 14336 -> 128; --num-attention-heads 32 -> 4; --num-query-groups 8 -> 2;
#   --expert-model-parallel-size 8 -> 2; --global-batch-size 128 -> 8; --train-iters 500000 -> 4;
#   --lr-decay-iters 320000 -> 4; --lr-warmup-iters 500 -> 1; --pipeline-model-parallel-size 4 -> 2;
#   --num-layers-per-virtual-pipeline-stage 8 -> 2 (a whole stage per chunk, as 8 of 32 layers on 4 stages was);
#   --save-interval 10000 -> 4; --eval-interval 1000 -> 4; --eval-iters 10 -> 1;
#   pretrain_gpt.py -> this repository's pretrain_gpt_moe.py.
# tests/unit/test_megatron_lm_scripts.py runs it with DRY_RUN=1 (flags and files checked, nothing trained; the
# start-up notes it prints are listed there); tests/distributed/test_megatron_lm_scripts.py trains it (CPU
# processes, gloo) on over 10,000 documents (the split 99990,8,2 gives validation one) and saves.
#
#   DRY_RUN=1 bash examples/megatron_lm/moe_readme_mixtral_8x7b.sh CHECKPOINT_DIR TOKENIZER.model DATA_PREFIX

# Runs Mixtral 8x7B model on 32 H100/A100 GPUs
# The Dropless MoE suffers from an imbalanced token distribution at the early stage of training (the first few hundred iterations), which may lead to poor performance and out-of-memory (OOM) issues.
# To check the performance of a Dropless MoE model, we should run the model for at least 500 iterations or resume from trained checkpoints.

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=4
# Change for multinode config
MASTER_ADDR=${MASTER_ADDR:-"localhost"}
MASTER_PORT=${MASTER_PORT:-"6000"}
NNODES=${NNODES:-"1"}
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
    --disable-bias-linear
    --seq-length 64
    --max-position-embeddings 32768
    --num-layers 4
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
)

MOE_ARGS=(
    --num-experts 8
    --expert-model-parallel-size 2
    --moe-router-load-balancing-type aux_loss # options: aux_loss, sinkhorn, None. Default is aux_loss.
    --moe-router-topk 2
    --moe-aux-loss-coeff 1e-2
    --moe-grouped-gemm
    --moe-permute-fusion
)

DATA_ARGS=(
    --tokenizer-type Llama2Tokenizer
    --tokenizer-model ${TOKENIZER_MODEL}
    --data-path $DATA_PATH
    --split 99990,8,2
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 8
    --lr 1e-4
    --train-iters 4
    --lr-decay-iters 4
    --lr-decay-style cosine
    --min-lr 1.0e-5
    --weight-decay 0.1
    --lr-warmup-iters 1
    --clip-grad 1.0
    --bf16
    --overlap-grad-reduce
    --overlap-param-gather
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 2
    --num-layers-per-virtual-pipeline-stage 2
    --sequence-parallel
    --use-distributed-optimizer
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
        --wandb-project ${WANDB_PROJECT:-"Mixtral-Finetuning"}
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
