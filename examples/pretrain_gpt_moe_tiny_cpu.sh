#!/usr/bin/env bash
# Pretrain a tiny GPT-MoE on CPU: 2 gloo processes, expert parallelism 2.
#
# The data is the Python standard library's own sources (real text nobody here
# wrote). When $DATA_DIR does not hold it yet, it is built first:
#   tools.make_stdlib_corpus -> tools.train_tokenizer -> tools.preprocess_data (python -m, from any directory)
#
#   examples/pretrain_gpt_moe_tiny_cpu.sh                  # what `make demo` runs
#   examples/pretrain_gpt_moe_tiny_cpu.sh --train-iters 20 # extra flags override
#   DRY_RUN=1 examples/pretrain_gpt_moe_tiny_cpu.sh        # print the command only
#
# Environment: DATA_PATH and its tokenizer (TOKENIZER_MODEL, or VOCAB_FILE and
# MERGE_FILE for GPT-2's BPE: your data, as the GPU examples take it, see
# data_from_env in common.sh; then nothing is built), else DATA_DIR (default REPO/data, where the
# stdlib data is built when missing); RUN_DIR (default
# REPO/runs/gpt_moe_tiny_cpu: tensorboard/ and checkpoints/ go there),
# VOCAB_SIZE (4096), and the launcher variables of examples/common.sh.
# A second run with the same RUN_DIR resumes from its checkpoint (--load ==
# --save); remove RUN_DIR to start over.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

DATA_DIR="${DATA_DIR:-$REPO_ROOT/data}"
RUN_DIR="${RUN_DIR:-$REPO_ROOT/runs/gpt_moe_tiny_cpu}"
VOCAB_SIZE="${VOCAB_SIZE:-4096}"
STDLIB_PREFIX="$DATA_DIR/stdlib_text_document"
if [[ -n "${DATA_PATH:-}" ]]; then  # your data: DATA_PATH (a prefix or a blend) and its tokenizer
    data_from_env
else
    for given in TOKENIZER_MODEL VOCAB_FILE MERGE_FILE; do
        [[ -z "${!given:-}" ]] || die "$given=${!given} without DATA_PATH: give the data it tokenized too (the stdlib data has its own tokenizer in DATA_DIR)"
    done
    TOKENIZER_MODEL="$DATA_DIR/tokenizer.model"
    TOKENIZER_ARGS=(--tokenizer-model "$TOKENIZER_MODEL")
    DATA_PATHS=("$STDLIB_PREFIX")
fi

# Two processes on two cores: one thread each, or they fight over the cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# A CPU demo: stay on the CPU even where CUDA exists (0 to use the GPUs).
export MEGATRON_MOE_FORCE_CPU="${MEGATRON_MOE_FORCE_CPU:-1}"

# python -m tools.NAME ARGS..., whatever the current directory.
run_tool() {
    PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m "tools.$1" "${@:2}"
}

prepare_data() {
    if [[ -n "${DATA_PATH:-}" ]]; then
        log "data: using DATA_PATH=${DATA_PATHS[*]} with ${TOKENIZER_ARGS[*]} (given)"
        return
    fi
    if [[ -f "$STDLIB_PREFIX.bin" && -f "$STDLIB_PREFIX.idx" && -f "$TOKENIZER_MODEL" ]]; then
        log "data: using $STDLIB_PREFIX.{bin,idx} and $TOKENIZER_MODEL"
        if [[ ! -f "$STDLIB_PREFIX.meta.json" ]]; then  # data made before the metadata sidecar existed
            run_tool preprocess_data --write-metadata "$STDLIB_PREFIX" \
                --tokenizer-model "$TOKENIZER_MODEL"
        fi
        return
    fi
    log "data: building the stdlib corpus, tokenizer and token files in $DATA_DIR"
    mkdir -p "$DATA_DIR"
    run_tool make_stdlib_corpus --output "$DATA_DIR/stdlib.jsonl"
    run_tool train_tokenizer --input "$DATA_DIR/stdlib.jsonl" \
        --model-prefix "${TOKENIZER_MODEL%.model}" --vocab-size "$VOCAB_SIZE" --num-threads 2
    run_tool preprocess_data --input "$DATA_DIR/stdlib.jsonl" \
        --tokenizer-model "$TOKENIZER_MODEL" --output-prefix "$DATA_DIR/stdlib" \
        --workers 2 --append-eod
}

# Mixtral's shape, shrunk: every layer MoE, SwiGLU experts, RMSNorm, RoPE, no biases, untied output layer,
# softmax top-2 routing; so the checkpoint exports to HuggingFace (tools/checkpoint/convert.py export-hf).
MODEL_ARGS=(
    --num-layers 4
    --hidden-size 256
    --ffn-hidden-size 512            # each expert's SwiGLU width (gate and up projections 512 wide each)
    --num-attention-heads 4
    --seq-length 256
    --position-embedding-type rope
    --normalization RMSNorm
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
)
MOE_ARGS=(
    --num-experts 8                  # in every layer, as Mixtral
    --moe-router-topk 2
    --moe-aux-loss-coeff 0.01
)
DATA_ARGS=(
    --data-path "${DATA_PATHS[@]}"
    "${TOKENIZER_ARGS[@]}"
    --split 98,2,0
)
TRAINING_ARGS=(
    --micro-batch-size 4
    --global-batch-size 8            # 4 per rank x DP 2: 2,048 tokens a step
    --train-iters 200                # ~410K tokens, a third of the corpus
    --lr 2e-3
    --min-lr 2e-4
    --lr-warmup-iters 20
    --lr-decay-style cosine
    --weight-decay 0.01
    --clip-grad 1.0
    --eval-interval 50
    --eval-iters 4                   # 4 x 8 = 32 held-out sequences
)
PARALLEL_ARGS=(
    --expert-model-parallel-size 2   # 4 experts per rank
    --moe-overlap-choice auto        # the cost model keeps only the overlap that pays (on one host's loopback: none)
)
LOGGING_ARGS=(
    --log-interval 10
    --tensorboard-dir "$RUN_DIR/tensorboard"
)
CHECKPOINT_ARGS=(
    --save "$RUN_DIR/checkpoints"
    --load "$RUN_DIR/checkpoints"
)

resolve_launcher 2
# Node 0 builds the data; other nodes (shared filesystem) read it once the
# rendezvous, which waits for node 0's torchrun, has completed.
if [[ "${DRY_RUN:-0}" != 1 && "$NODE_RANK" == 0 ]]; then
    prepare_data
fi
launch_pretrain \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" \
    "${PARALLEL_ARGS[@]}" "${LOGGING_ARGS[@]}" "${CHECKPOINT_ARGS[@]}" "$@"
