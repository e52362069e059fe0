#!/bin/bash
# Test fixture: Megatron-LM's own DeepSeek-V2-Lite model flags, as written, in a pretraining launch. Source: NVIDIA/Megatron-LM
# examples/post_training/modelopt/conf/deepseek-ai/DeepSeek-V2-Lite.sh (commit d98e8a64dd): its MODEL_ARGS, verbatim but for sizes; the
# rest (data, training, parallel and logging flags, the torchrun line) is Megatron-LM's
# examples/mixtral/train_mixtral_8x7b_distributed.sh's, the pretraining script the MODEL_ARGS files are used with.
# Changed, sizes, degrees and paths only:
#   MODEL_ARGS: --num-layers 27 -> 3 and --moe-layer-freq ([0]+[1]*26) -> ([0]+[1]*2); --hidden-size 2048 -> 64;
#   --ffn-hidden-size 10944 -> 160; --num-attention-heads 16 -> 4; --kv-lora-rank 512 -> 16; --v-head-dim and
#   --qk-head-dim 128 -> 16; --qk-pos-emb-head-dim 64 -> 8; --moe-ffn-hidden-size 1408 -> 16;
#   --moe-shared-expert-intermediate-size 2816 -> 32; --seq-length and --max-position-embeddings 1024 -> 64;
#   --make-vocab-size-divisible-by 3200 -> 128 (the test tokenizer's vocabulary is 2,000, not 102,400);
#   the launch: 2 processes (GPUS_PER_NODE 8 -> 2), --expert-model-parallel-size 8 -> 2, --global-batch-size
#   256 -> 4, --train-iters 500000 -> 4, --lr-decay-iters 320000 -> 4, --lr-warmup-iters 500 -> 1,
#   --save-interval 10000 -> 2, --eval-interval 1000 -> 2, --eval-iters 10 -> 1; the tokenizer's path and
#   --data-path are the arguments.
# tests/distributed/test_megatron_lm_family_scripts.py trains it on CPU processes (gloo), saves, resumes, validates.
#
#   DRY_RUN=1 bash examples/megatron_lm/deepseek_v2_lite.sh CHECKPOINT_DIR TOKENIZER_DIR DATA_PREFIX

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=2
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
    --attention-dropout 0.0 \
    --hidden-dropout 0.0 \
    --micro-batch-size 1 \
    --bf16 \
    --no-masked-softmax-fusion \
    --disable-bias-linear \
    --untie-embeddings-and-output-weights \
    --position-embedding-type rope \
    --no-rope-fusion \
    --normalization RMSNorm \
    --norm-epsilon 1e-6 \
    --swiglu \
    --num-layers 3 \
    --hidden-size 64 \
    --ffn-hidden-size 160 \
    --num-attention-heads 4 \
    --kv-channels 16 \
    --multi-latent-attention \
    --kv-lora-rank 16 \
    --v-head-dim 16 \
    --qk-head-dim 16 \
    --qk-layernorm \
    --qk-pos-emb-head-dim 8 \
    --num-experts 64 \
    --moe-layer-freq ([0]+[1]*2) \
    --moe-ffn-hidden-size 16 \
    --moe-grouped-gemm \
    --moe-router-score-function softmax \
    --moe-router-topk 6 \
    --moe-router-topk-scaling-factor 1.0 \
    --moe-router-pre-softmax \
    --moe-shared-expert-intermediate-size 32 \
    --moe-aux-loss-coeff 1e-3 \
    --moe-token-dispatcher-type alltoall \
    --moe-token-drop-policy probs \
    --moe-router-load-balancing-type seq_aux_loss \
    --seq-length 64 \
    --max-position-embeddings 64 \
    --tokenizer-type HuggingFaceTokenizer \
    --make-vocab-size-divisible-by 128 \
    --attention-softmax-in-fp32 \
    --use-mcore-models \
    --rotary-percent 1.0 \
    --rotary-base 10000 \
    --rotary-scaling-factor 40 \
    --mscale 0.707 \
    --mscale-all-dim 0.707 \
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
