# Shared launcher logic for the example scripts; source it, don't run it.
#
# Provides:
#   REPO_ROOT, PYTHON            the repository and the Python that runs it
#   require_env NAME HINT        fail with a clear message when $NAME is unset
#   resolve_launcher DEFAULT_NPROC
#                                sets NNODES NODE_RANK MASTER_ADDR MASTER_PORT
#                                GPUS_PER_NODE: from the environment, else from
#                                Slurm, else single-node defaults
#   gpus_on_node FALLBACK        GPUs here (Slurm, nvidia-smi), else FALLBACK
#   data_from_env                DATA_PATHS and TOKENIZER_ARGS from DATA_PATH and the tokenizer variables
#   check_args WORLD ARGS...     parse and validate trainer flags for a world size
#   launch_pretrain ARGS...      check_args, then torchrun pretrain_gpt_moe.py ARGS on this node, through
#                                `python -m megatron_moe.launch` (torchrun's arguments, one line per failure) (exporting
#                                CUDA_DEVICE_MAX_CONNECTIONS=1 with TP or CP, see one_device_connection)
#
# Environment knobs every example honours:
#   NNODES NODE_RANK MASTER_ADDR MASTER_PORT GPUS_PER_NODE   the launch
#   DRY_RUN=1    print the torchrun command and check the flags against the
#                world size (NNODES x GPUS_PER_NODE) without training
#   PYTHON       interpreter (default: the active venv, else REPO_ROOT/.venv,
#                else python3)
# Extra arguments given to an example script are appended to its flags, so
# they override the script's values (`... --train-iters 20`).

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [[ -z "${PYTHON:-}" ]]; then
    if [[ -n "${VIRTUAL_ENV:-}" && -x "$VIRTUAL_ENV/bin/python" ]]; then
        PYTHON="$VIRTUAL_ENV/bin/python"
    elif [[ -x "$REPO_ROOT/.venv/bin/python" ]]; then
        PYTHON="$REPO_ROOT/.venv/bin/python"
    else
        PYTHON="$(command -v python3 || command -v python)"
    fi
fi

log() { echo "[$(date '+%Y-%m-%d %H:%M:%S')] $*" >&2; }

die() {
    echo "error: $*" >&2
    exit 2
}

# require_env NAME HINT: the variable must be set and non-empty.
require_env() {
    local name=$1 hint=$2
    if [[ -z "${!name:-}" ]]; then
        die "$name is not set: $hint"
    fi
}

# require_file PATH WHAT: the file must exist (skipped under DRY_RUN=1).
require_file() {
    local path=$1 what=$2
    if [[ "${DRY_RUN:-0}" != 1 && ! -e "$path" ]]; then
        die "$what not found: $path"
    fi
}

# data_from_env: DATA_PATHS (an array) and TOKENIZER_ARGS (the tokenizer flags)
# from the environment, for the examples that train on your data. DATA_PATH is
# one .bin/.idx prefix or a blend "WEIGHT1 PREFIX1 WEIGHT2 PREFIX2 ...". The
# tokenizer the data was made with: TOKENIZER_MODEL (a SentencePiece .model),
# or VOCAB_FILE and MERGE_FILE (GPT-2's BPE, as Megatron-LM's examples take
# it), or TOKENIZER_TYPE=HuggingFaceTokenizer with TOKENIZER_MODEL (a directory
# holding tokenizer.json, or that file).
data_from_env() {
    require_env DATA_PATH "give the .bin/.idx prefix written by tools/preprocess_data.py, e.g. DATA_PATH=/data/corpus_text_document, or a blend DATA_PATH='0.7 /data/a_text_document 0.3 /data/b_text_document'"
    read -r -a DATA_PATHS <<<"$DATA_PATH"
    local item
    for item in "${DATA_PATHS[@]}"; do
        if [[ ! "$item" =~ ^[0-9.eE+-]+$ ]]; then  # a prefix, not a blend weight
            require_file "$item.bin" "DATA_PATH: token file"
            require_file "$item.idx" "DATA_PATH: index file"
        fi
    done
    tokenizer_from_env
}

# tokenizer_from_env: TOKENIZER_ARGS from TOKENIZER_TYPE (default: GPT2BPETokenizer
# when VOCAB_FILE is set, else SentencePieceTokenizer) and its files.
tokenizer_from_env() {
    local type="${TOKENIZER_TYPE:-}"
    [[ -n "$type" ]] || { [[ -n "${VOCAB_FILE:-}" ]] && type=GPT2BPETokenizer || type=SentencePieceTokenizer; }
    case "$type" in
        GPT2BPETokenizer)
            require_env VOCAB_FILE "give GPT-2's vocab.json the data was tokenized with (tools/train_tokenizer.py --model-type bytelevel-bpe writes one), e.g. VOCAB_FILE=/data/bpe/vocab.json"
            require_env MERGE_FILE "give GPT-2's merges.txt that goes with VOCAB_FILE, e.g. MERGE_FILE=/data/bpe/merges.txt"
            [[ -z "${TOKENIZER_MODEL:-}" ]] || die "TOKENIZER_MODEL=$TOKENIZER_MODEL with GPT-2's VOCAB_FILE/MERGE_FILE: give one tokenizer"
            require_file "$VOCAB_FILE" "VOCAB_FILE"
            require_file "$MERGE_FILE" "MERGE_FILE"
            TOKENIZER_ARGS=(--tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE")
            ;;
        SentencePieceTokenizer | HuggingFaceTokenizer)
            require_env TOKENIZER_MODEL "give the tokenizer the data was tokenized with: a SentencePiece .model (tools/train_tokenizer.py writes one), e.g. TOKENIZER_MODEL=/data/tokenizer.model; or VOCAB_FILE and MERGE_FILE (GPT-2's BPE); or TOKENIZER_TYPE=HuggingFaceTokenizer with TOKENIZER_MODEL a directory holding tokenizer.json"
            [[ -z "${VOCAB_FILE:-}${MERGE_FILE:-}" ]] || die "VOCAB_FILE/MERGE_FILE with TOKENIZER_TYPE=$type: they are GPT2BPETokenizer's; drop them or set TOKENIZER_TYPE=GPT2BPETokenizer"
            require_file "$TOKENIZER_MODEL" "TOKENIZER_MODEL"
            TOKENIZER_ARGS=(--tokenizer-type "$type" --tokenizer-model "$TOKENIZER_MODEL")
            ;;
        *) die "TOKENIZER_TYPE=$type: one of SentencePieceTokenizer, GPT2BPETokenizer, HuggingFaceTokenizer" ;;
    esac
}

# The first host of the Slurm allocation, as an address other nodes can reach.
# Slurm's NodeAddr is used when it differs from the node name (pretend nodes,
# clusters whose node names do not resolve).
slurm_master_addr() {
    local host addr
    host="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"
    [[ -n "$host" ]] || return 1
    addr="$(scontrol show node "$host" 2>/dev/null | grep -o 'NodeAddr=[^ ]*' | head -n1 | cut -d= -f2 || true)"
    echo "${addr:-$host}"
}

# A TCP port nothing listens on now.
free_port() {
    "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
}

# resolve_launcher DEFAULT_NPROC: the torchrun topology of this node.
resolve_launcher() {
    local default_nproc=$1
    NNODES="${NNODES:-${SLURM_NNODES:-1}}"
    NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-0}}"
    if [[ -z "${MASTER_ADDR:-}" ]]; then
        if [[ -n "${SLURM_JOB_NODELIST:-}" ]] && command -v scontrol >/dev/null 2>&1; then
            MASTER_ADDR="$(slurm_master_addr)" || die "cannot read the first host of SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST; set MASTER_ADDR"
        elif [[ "$NNODES" -gt 1 && "${DRY_RUN:-0}" == 1 ]]; then
            MASTER_ADDR=NODE0_ADDRESS  # a dry run only shows where it goes
        elif [[ "$NNODES" -gt 1 ]]; then
            die "NNODES=$NNODES but MASTER_ADDR is not set (and no Slurm allocation to read it from): set MASTER_ADDR to node 0's address"
        else
            MASTER_ADDR=localhost
        fi
    fi
    if [[ -z "${MASTER_PORT:-}" ]]; then
        # One port per Slurm job so jobs sharing a node do not collide.
        if [[ -n "${SLURM_JOB_ID:-}" ]]; then
            MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
        elif [[ "$NNODES" == 1 && "${DRY_RUN:-0}" != 1 ]]; then
            MASTER_PORT="$(free_port)"  # one node: any free port, so runs side by side don't collide
        else
            MASTER_PORT=29500
        fi
    fi
    GPUS_PER_NODE="${GPUS_PER_NODE:-$default_nproc}"
    export NNODES NODE_RANK MASTER_ADDR MASTER_PORT GPUS_PER_NODE
}

# gpus_on_node FALLBACK: GPUs on this node: Slurm's count, else nvidia-smi's,
# else FALLBACK (so a dry run on a machine without GPUs shows the real layout).
gpus_on_node() {
    local count=0
    if [[ -n "${SLURM_GPUS_ON_NODE:-}" ]]; then
        count=$SLURM_GPUS_ON_NODE
    elif command -v nvidia-smi >/dev/null 2>&1; then
        count="$(nvidia-smi --list-gpus 2>/dev/null | wc -l)"
    fi
    if [[ "$count" -gt 0 ]]; then echo "$count"; else echo "$1"; fi
}

# check_args WORLD_SIZE ARGS...: parse the flags as the trainer does and check
# them against the world size (layout divisibility, batch sizes), every error
# in one block (under DRY_RUN=1 also the trainer's start-up notes, on stderr);
# starts nothing.
check_args() {
    local world=$1
    shift
    PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" - "$world" "$@" <<'EOF'
import os
import sys
from megatron_moe.config import ConfigError, layout_line, parse_and_validate

world = int(sys.argv[1])
try:
    cfg = parse_and_validate(sys.argv[2:], world)
except ConfigError as error:
    print(f"error: {error}", file=sys.stderr)
    sys.exit(2)
for note in cfg.notes if os.environ.get("DRY_RUN") == "1" else ():  # a real launch: the trainer prints them
    print(note, file=sys.stderr)
print(f"flags OK for world size {world}: {layout_line(cfg, world)}")
EOF
}

# one_device_connection ARGS...: true when the flags ask for tensor or context
# parallelism. megatron-core then relies on CUDA_DEVICE_MAX_CONNECTIONS=1 (one
# hardware queue) to start the TP all-reduce / reduce-scatter of the input
# gradient before the weight-gradient GEMM, and warns without it; Megatron-LM
# refuses TP or CP without it (before Blackwell). Without TP and CP it is left
# unset: the MoE all-to-alls overlap compute on side streams, which one queue
# would serialize. Flags that do not parse answer false (check_args reports them).
one_device_connection() {
    PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" - "$@" <<'EOF'
import sys
from megatron_moe.config import ConfigError, parse_args

try:
    p = parse_args(sys.argv[1:]).parallel
except ConfigError:
    sys.exit(1)
sys.exit(0 if p.tensor_model_parallel_size > 1 or p.context_parallel_size > 1 else 1)
EOF
}

# launch_pretrain ARGS...: torchrun pretrain_gpt_moe.py on this node, with
# CUDA_DEVICE_MAX_CONNECTIONS=1 where one_device_connection says megatron-core
# needs it (a value already in the environment is kept).
launch_pretrain() {
    # torchrun (the interpreter's own: no venv to activate) through megatron_moe.launch: a failed job ends in one
    # line per failing rank and torchrun's summary in one line, with the first failed rank's exit code (2 for a
    # flag, data or tokenizer error), not ChildFailedError's traceback and exit code 1.
    local torchrun=(env "PYTHONPATH=$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m megatron_moe.launch)
    if [[ -z "${CUDA_DEVICE_MAX_CONNECTIONS:-}" ]] && one_device_connection "$@"; then
        export CUDA_DEVICE_MAX_CONNECTIONS=1
    fi
    local environment=()
    [[ -z "${CUDA_DEVICE_MAX_CONNECTIONS:-}" ]] || environment=(env "CUDA_DEVICE_MAX_CONNECTIONS=$CUDA_DEVICE_MAX_CONNECTIONS")
    local cmd=(
        "${environment[@]}"
        "${torchrun[@]}"
        --nnodes "$NNODES"
        --node-rank "$NODE_RANK"
        --master-addr "$MASTER_ADDR"
        --master-port "$MASTER_PORT"
        --nproc-per-node "$GPUS_PER_NODE"
        "$REPO_ROOT/pretrain_gpt_moe.py"
        "$@"
    )
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
        local word line=""
        for word in "${cmd[@]}"; do
            if [[ "$word" =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then line+="$word "; else line+="$(printf '%q' "$word") "; fi
        done
        echo "${line% }"
        check_args $((NNODES * GPUS_PER_NODE)) "$@"
        return
    fi
    # A bad flag ends here in one line (exit 2), not once per rank plus torchrun's ChildFailedError.
    check_args $((NNODES * GPUS_PER_NODE)) "$@" >&2 || exit
    log "node $NODE_RANK of $NNODES: $GPUS_PER_NODE processes, master $MASTER_ADDR:$MASTER_PORT"
    "${cmd[@]}"
}
