#!/bin/bash
# Test fixture: Megatron-LM's own DeepSeek-V3 launch script, its flags as written. Source: NVIDIA/Megatron-LM
# examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh (commit d98e8a64dd). Changed, sizes, degrees and paths only:
#   the sbatch/srun/container launch -> torchrun on this host (GPUS_PER_NODE=2); pretrain_gpt.py -> this
#   repository's pretrain_gpt_moe.py; OUTPUT_PATH, DATA_PATH and --tokenizer-model -> the arguments below;
#   USE_MEGATRON_FSDP 1 -> 0 and WANDB 1 -> 0 (the script's own switches: Megatron-FSDP is not supported here,
#   docs/flags.md); EP 8 -> 2; MBS 4 -> 1; GBS 2048 -> 4; --seq-length/--max-position-embeddings 4096 -> 64;
#   --num-layers 61 -> 3 and --moe-layer-freq [0]*3+[1]*58 -> [0]*1+[1]*2 (a dense first layer, as written);
#   --hidden-size 7168 -> 64; --ffn-hidden-size 18432 -> 160; --num-attention-heads 128 -> 4;
#   --kv-channels 128 -> 16; --num-experts 256 -> 32; --moe-ffn-hidden-size and
#   --moe-shared-expert-intermediate-size 2048 -> 16; --q-lora-rank 1536 -> 32; --kv-lora-rank 512 -> 16;
#   --qk-head-dim 128 -> 16; --qk-pos-emb-head-dim 64 -> 8; --v-head-dim 128 -> 16; --train-samples 585937500 -> 16;
#   --lr-decay-samples 584765624 -> 16; --lr-warmup-samples 1536000 -> 4; --eval-iters 32 -> 1;
#   --eval-interval 100 -> 2; --save-interval 100 -> 2; --num-workers 6 -> 1; --make-vocab-size-divisible-by 3232
#   -> 128 (the test tokenizer's vocabulary is 2,000, not 129,280).
# tests/distributed/test_megatron_lm_family_scripts.py trains it on CPU processes (gloo), saves, resumes, validates.
#
#   DRY_RUN=1 bash examples/megatron_lm/deepseek_v3.sh OUTPUT_PATH TOKENIZER_DIR DATA_PREFIX

export NCCL_IB_SL=1
export NCCL_IB_TIMEOUT=19
export NVTE_FWD_LAYERNORM_SM_MARGIN=16
export NVTE_BWD_LAYERNORM_SM_MARGIN=16
export NCCL_P2P_NET_CHUNKSIZE=2097152
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export PYTHONWARNINGS=ignore

OUTPUT_PATH=$1
TOKENIZER_MODEL=$2
DATA_PATH=$3
USE_MEGATRON_FSDP=${USE_MEGATRON_FSDP:-0}
SHARDING_STRATEGY=${SHARDING_STRATEGY:-"optim_grads_params"}
WANDB=${WANDB:-0}

GPUS_PER_NODE=${GPUS_PER_NODE:-2}
TP=${TP:-1}
EP=${EP:-2}
MBS=${MBS:-1}
GBS=${GBS:-4}
COMMENT=${COMMENT:-""}

PRETRAIN_ARGS=(
    --distributed-timeout-minutes 60
    --tensor-model-parallel-size ${TP}
    --expert-model-parallel-size ${EP}
    --expert-tensor-parallel-size 1
    --context-parallel-size 1
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
    --use-mcore-models
    --sequence-parallel
    --use-flash-attn
    --disable-bias-linear
    --micro-batch-size ${MBS}
    --global-batch-size ${GBS}
    --train-samples 16
    --exit-duration-in-mins 220
    --no-check-for-nan-in-loss-and-grad
    --manual-gc
    --manual-gc-interval 10
    --recompute-granularity selective
    --recompute-modules mlp moe mla_up_proj layernorm
    --transformer-impl transformer_engine
    --seq-length 64
    --data-cache-path ${OUTPUT_PATH}/cache
    --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model ${TOKENIZER_MODEL}
    --data-path ${DATA_PATH}
    --split 99,1,0
    --no-mmap-bin-files
    --no-create-attention-mask-in-dataloader
    --num-workers 1
    --num-layers 3
    --hidden-size 64
    --ffn-hidden-size 160
    --num-attention-heads 4
    --kv-channels 16
    --max-position-embeddings 64
    --position-embedding-type rope
    --rotary-base 10000
    --make-vocab-size-divisible-by 128
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --swiglu
    --untie-embeddings-and-output-weights
    --multi-latent-attention
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --clip-grad 1.0
    --weight-decay 0.1
    --qk-layernorm
    --lr-decay-samples 16
    --lr-warmup-samples 4
    --lr-warmup-init 3.9e-7
    --lr 3.9e-6
    --min-lr 3.9e-7
    --lr-decay-style cosine
    --adam-beta1 0.9
    --adam-beta2 0.95
    --num-experts 32
    --moe-layer-freq [0]*1+[1]*2
    --moe-ffn-hidden-size 16
    --moe-shared-expert-intermediate-size 16
    --moe-router-load-balancing-type seq_aux_loss
    --moe-router-topk 8
    --moe-token-dispatcher-type flex
    --moe-flex-dispatcher-backend hybridep
    --moe-router-pre-softmax
    --moe-grouped-gemm
    --moe-aux-loss-coeff 1e-4
    --moe-router-group-topk 4
    --moe-router-num-groups 8
    --moe-router-topk-scaling-factor 2.5
    --moe-router-score-function sigmoid
    --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 1e-3
    --moe-router-dtype fp32
    --moe-permute-fusion
    --moe-router-force-load-balancing
    --q-lora-rank 32
    --kv-lora-rank 16
    --qk-head-dim 16
    --qk-pos-emb-head-dim 8
    --v-head-dim 16
    --rotary-scaling-factor 40
    --mscale 1.0
    --mscale-all-dim 1.0
    --mtp-num-layers 1
    --mtp-loss-scaling-factor 0.1
    --eval-iters 1
    --eval-interval 2
    --auto-detect-ckpt-format
    --load ${OUTPUT_PATH}/checkpoints
    --save ${OUTPUT_PATH}/checkpoints
    --save-interval 2
    --dist-ckpt-strictness log_all
    --init-method-std 0.02
    --log-timers-to-tensorboard
    --log-memory-to-tensorboard
    --log-num-zeros-in-grad
    --log-params-norm
    --log-validation-ppl-to-tensorboard
    --log-throughput
    --log-interval 1
    --logging-level 40
    --tensorboard-dir ${OUTPUT_PATH}/tensorboard
    --bf16
    --enable-experimental
)

if [ "${USE_MEGATRON_FSDP}" = 1 ]; then
    unset CUDA_DEVICE_MAX_CONNECTIONS
    PRETRAIN_ARGS=(
        "${PRETRAIN_ARGS[@]}"
        --use-megatron-fsdp
        --data-parallel-sharding-strategy ${SHARDING_STRATEGY}
        --no-gradient-accumulation-fusion
        --use-distributed-optimizer
        --calculate-per-token-loss
        --init-model-with-meta-device
        --ckpt-format fsdp_dtensor
        --fsdp-double-buffer
        --use-nccl-ub
        --megatron-fsdp-grad-comm-dtype bf16
        --megatron-fsdp-main-grads-dtype bf16
    )
fi

if [ "${WANDB}" = 1 ]; then
    PRETRAIN_ARGS=(
        "${PRETRAIN_ARGS[@]}"
        --wandb-project your_own_wandb_project
        --wandb-exp-name DeepSeek-V3-TP${TP}EP${EP}-MBS${MBS}GBS${GBS}-${COMMENT}
    )
fi

MASTER_ADDR=${MASTER_ADDR:-"localhost"}
MASTER_PORT=${MASTER_PORT:-"6000"}
torchrun --nproc_per_node $GPUS_PER_NODE --nnodes 1 --node_rank 0 --master_addr $MASTER_ADDR \
    --master_port $MASTER_PORT "$(dirname "$0")/../../pretrain_gpt_moe.py" ${PRETRAIN_ARGS[@]}
