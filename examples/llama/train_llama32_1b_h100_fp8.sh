#!/usr/bin/env bash
# Train Llama 3.2 1B with tensor capture / low-precision emulation.
#
#   bash examples/llama/train_llama32_1b_h100_fp8.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH \
#        TOKENIZER_PATH DATA_PATH DTYPE
#
#   DTYPE       bf16 (local linears), or fp8 (Transformer Engine linears with the hybrid FP8
#               recipe; needs TE and a GPU)
#   TOKENIZER_PATH  a Hugging Face tokenizer folder (tokenizer.json, tokenizer_config.json);
#               Megatron-LM loads it with AutoTokenizer. Llama-3.2's, on a machine with
#               access to the gated model: huggingface-cli download meta-llama/Llama-3.2-1B
#               --include "tokenizer*" --local-dir model/llama3.2-1b. Or the one
#               preprocess-corpus trains on your corpus (PREFIX's folder/tokenizer)
#   DATA_PATH   indexed dataset prefix (..._text_document, beside it .bin and .idx), made
#               from your own text: preprocess-corpus --input my_corpus.jsonl --tokenizer
#               model/llama3.2-1b --output-prefix dataset/mine/mine (JSON Lines with a
#               "text" field, or plain text with a blank line between documents; the
#               main job's corpus runs/default/corpus/python_docs.jsonl is an example);
#               DATA_PATH is then dataset/mine/mine_text_document
#
# Environment:
#   TENSOR_SAVE_ENABLED, TENSOR_SAVE_DIR, TENSOR_SAVER_ITERATION, CUSTOM_QUANT_TYPE
#                      capture / emulation, applied through the patch set (patches/).
#                      With DTYPE bf16 CUSTOM_QUANT_TYPE emulates on local linears; with DTYPE
#                      fp8 (Transformer Engine linears) it runs TE's custom recipe with our
#                      quantizer factory (--fp8-recipe custom --fp8-quantizer-factory
#                      te_integration.factory.quantizer_factory; TE >= 2.16; every
#                      megatron-core the patch set supports has these flags; docs/te.md).
#                      Capture with fp8 does not save the Transformer Engine linears (a note
#                      says so; TE's debug API with our features can: docs/te.md).
#   FP8_RECIPE, FP4_RECIPE  Megatron-LM's --fp8-recipe (delayed, tensorwise, blockwise, mxfp8)
#                      / --fp4-recipe (nvfp4). DTYPE fp8: run natively (Megatron-LM checkout
#                      only) on a GPU that has the recipe, else exit 2 naming what is missing;
#                      DTYPE bf16: emulate it exactly on local linears (CUSTOM_QUANT_TYPE=te_...,
#                      the recipe table in training_driver.preflight / quant.recipes)
#   DRY_RUN=1          print the training command instead of running it (no GPU or
#                      Transformer Engine needed to see it)
#   MEGATRON_LM_DIR    a Megatron-LM checkout: its version must be one the patch set supports
#                      (megatron-tensor-patch --detect; else exit 2); its pretrain_gpt.py runs
#                      on a patched copy; without apex (fused_weight_gradient_mlp_cuda), and
#                      always under TE's custom recipe, the launcher adds
#                      --no-gradient-accumulation-fusion; with the custom recipe the checkout
#                      must take --fp8-quantizer-factory (else exit 2) and pretrain_gpt.py runs
#                      through te_integration.megatron_lm (names TE layers for name rules);
#                      Megatron-LM loads TOKENIZER_PATH with transformers (must import, else
#                      exit 2).
#   TE_INSPECT_CONFIG  a debug-API YAML of our TE features (docs/te.md; MEGATRON_LM_DIR and
#                      DTYPE fp8): checked first, then run through te_integration.megatron_lm
#                      (released Megatron-LM has no --tensor-inspect flags); logs in
#                      TE_INSPECT_LOG_DIR (default CHECKPOINT_PATH/inspect_logs)
#                      Unset: run this project's driver (training_driver/train.py)
#   GPUS_PER_NODE (default: GPUs found, else 1), NNODES (1), NODE_RANK (0),
#   MASTER_ADDR (localhost), MASTER_PORT (6000)
#   TP, PP (1), MICRO_BATCH_SIZE (1), GLOBAL_BATCH_SIZE (8),
#   TRAIN_ITERS (1000), LR (3e-4), MIN_LR (3e-5), WARMUP_ITERS (100, or TRAIN_ITERS/10 when fewer),
#   SAVE_INTERVAL (500)
#   MODEL              llama32_1b (default) or tiny (a CPU smoke run of the same pipeline),
#                      on either path
#   NUM_LAYERS, HIDDEN_SIZE, FFN_HIDDEN_SIZE, NUM_ATTENTION_HEADS, NUM_QUERY_GROUPS,
#   SEQ_LENGTH         replace that field of MODEL's shape (e.g. MODEL=llama32_1b NUM_LAYERS=4)
#   MEGATRON_LM_EXTRA_ARGS  more pretrain_gpt.py arguments, word-split (MEGATRON_LM_DIR only)
#   Megatron-LM's training loop needs six, psutil, pybind11 and transformers
#                      (pip install -e ".[megatron-lm]"; checked before torchrun, else exit 2);
#                      --no-rope-fusion, --no-masked-softmax-fusion and
#                      --no-gradient-accumulation-fusion are passed when TE / apex do not import
#   IGNORE_RESOURCE_CHECK=1  start even when the estimate of memory and of one captured
#                      iteration says this machine cannot hold the run (else exit 2, one line)
#   WORKDIR            where the patched Megatron copy goes (default: CHECKPOINT_PATH/.lowp)
set -euo pipefail

usage() {  # the comment block at the top of this file, without the '#'s
    awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
}
die() { echo "train_llama32_1b_h100_fp8.sh: error: $*" >&2; exit 2; }

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then usage; exit 0; fi
if [[ $# -ne 5 ]]; then
    usage >&2
    die "expected 5 arguments (CHECKPOINT_PATH TENSORBOARD_LOGS_PATH TOKENIZER_PATH DATA_PATH DTYPE), got $#"
fi
CHECKPOINT_PATH=$1
TENSORBOARD_LOGS_PATH=$2
TOKENIZER_PATH=$3
DATA_PATH=$4
DTYPE=$5

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export PYTHONPATH="${HERE}${PYTHONPATH:+:${PYTHONPATH}}"
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore:Transformer Engine and Apex are not installed,ignore:Apex is not installed,ignore:full scope is deprecated}"
PY="${PYTHON:-python}"

case "$DTYPE" in
    bf16|fp8) ;;
    *) die "DTYPE must be bf16 or fp8, got '$DTYPE'" ;;
esac
[[ -e "$TOKENIZER_PATH" ]] || die "TOKENIZER_PATH $TOKENIZER_PATH does not exist: give a Hugging Face tokenizer folder; Llama-3.2's: huggingface-cli download meta-llama/Llama-3.2-1B --include 'tokenizer*' --local-dir $TOKENIZER_PATH (or the one preprocess-corpus wrote; see --help)"
DATA_PATH="${DATA_PATH%.bin}"; DATA_PATH="${DATA_PATH%.idx}"
[[ -f "${DATA_PATH}.bin" && -f "${DATA_PATH}.idx" ]] || die "DATA_PATH ${DATA_PATH} has no .bin/.idx: make it from your text with preprocess-corpus --input CORPUS.jsonl --tokenizer $TOKENIZER_PATH --output-prefix ${DATA_PATH%_text_document} (see --help)"

# FP8_RECIPE / FP4_RECIPE: natively with DTYPE fp8 where the GPU has the recipe, else emulated
# (DTYPE bf16: CUSTOM_QUANT_TYPE names the matching quant.recipes recipe). One line, exit 2.
RECIPE_ARGS=(); RECIPE_NOTE=""
if [[ -n "${FP8_RECIPE:-}${FP4_RECIPE:-}" ]]; then
    PLAN=$("$PY" -m training_driver.preflight_cli recipe --fp8-recipe "${FP8_RECIPE:-}" \
        --fp4-recipe "${FP4_RECIPE:-}" --dtype "$DTYPE" 2>&1) \
        || die "$(printf '%s\n' "$PLAN" | grep -v '^[[:space:]]*$' | tail -n 1 | sed 's/^preflight: error: //')"
    read -r HOW WHAT WHICH <<<"$(printf '%s\n' "$PLAN" | tail -n 1)"
    if [[ "$HOW" == emulate ]]; then
        if [[ -n "${CUSTOM_QUANT_TYPE:-}" && "$CUSTOM_QUANT_TYPE" != "$WHAT" ]]; then
            die "CUSTOM_QUANT_TYPE=$CUSTOM_QUANT_TYPE and ${FP8_RECIPE:+FP8_RECIPE=$FP8_RECIPE}${FP4_RECIPE:+FP4_RECIPE=$FP4_RECIPE} (emulated as $WHAT) disagree: set one of them"
        fi
        export CUSTOM_QUANT_TYPE="$WHAT"
        RECIPE_NOTE="${FP8_RECIPE:+FP8_RECIPE=$FP8_RECIPE}${FP4_RECIPE:+FP4_RECIPE=$FP4_RECIPE} is emulated with CUSTOM_QUANT_TYPE=$WHAT (DTYPE bf16, local linears)"
    else
        [[ -n "${MEGATRON_LM_DIR:-}" ]] || die "${FP8_RECIPE:+FP8_RECIPE=$FP8_RECIPE}${FP4_RECIPE:+FP4_RECIPE=$FP4_RECIPE} natively needs MEGATRON_LM_DIR (this project's driver runs Transformer Engine's delayed recipe only); or use DTYPE bf16 to emulate it"
        RECIPE_ARGS=("$WHAT" "$WHICH")
    fi
fi

# Before anything starts: the capture settings (a CUSTOM_QUANT_TYPE typo), the tokenizer (an
# old-format directory) and whether the data was made with it, the collector's own checks
# (training_driver.preflight). One line and exit 2 on a mistake.
PREFLIGHT=$("$PY" -m training_driver.preflight_cli inputs "$TOKENIZER_PATH" "$DATA_PATH" 2>&1) \
    || die "$(printf '%s\n' "$PREFLIGHT" | grep -v '^[[:space:]]*$' | tail -n 1 | sed 's/^preflight: error: //')"
read -r _ CAPTURE QUANT <<<"$(printf '%s\n' "$PREFLIGHT" | tail -n 1)"
[[ "$QUANT" == - ]] && QUANT=""
# A tokenizer.json file stands for its directory (what AutoTokenizer.from_pretrained takes).
[[ -f "$TOKENIZER_PATH" ]] && TOKENIZER_PATH=$(dirname "$TOKENIZER_PATH")
# CUSTOM_QUANT_TYPE with Transformer Engine linears: TE's custom recipe with our factory
# (te_integration.factory), so the format is emulated inside TE's GEMMs instead of ignored.
TE_FACTORY=te_integration.factory.quantizer_factory
TE_RECIPE=()
if [[ "$DTYPE" == fp8 && -n "$QUANT" ]]; then
    [[ ${#RECIPE_ARGS[@]} -eq 0 ]] || die "CUSTOM_QUANT_TYPE=$QUANT with DTYPE fp8 runs TE's custom recipe, and ${FP8_RECIPE:+FP8_RECIPE=$FP8_RECIPE}${FP4_RECIPE:+FP4_RECIPE=$FP4_RECIPE} asks for a native one: set one of them"
    TE_RECIPE=(--fp8-recipe custom --fp8-quantizer-factory "$TE_FACTORY")
fi
DRY_RUN=${DRY_RUN:-0}

if [[ -n "${MEGATRON_LM_DIR:-}" ]]; then
    [[ -d "$MEGATRON_LM_DIR" ]] || die "MEGATRON_LM_DIR=$MEGATRON_LM_DIR is not a directory: point it at a Megatron-LM checkout or unset it"
    [[ -f "$MEGATRON_LM_DIR/pretrain_gpt.py" ]] || die "MEGATRON_LM_DIR=$MEGATRON_LM_DIR has no pretrain_gpt.py: point it at a Megatron-LM checkout or unset it"
    # The checkout's megatron-core version must be one the patch set supports.
    DETECTED=$("$PY" -m tensor_capture.patcher --detect "$MEGATRON_LM_DIR" 2>&1) \
        || die "MEGATRON_LM_DIR=$MEGATRON_LM_DIR: $(printf '%s\n' "$DETECTED" | grep -v '^[[:space:]]*$' | tail -n 1 | sed 's/^megatron-tensor-patch: error: //')"
    MEGATRON_VERSION=$(printf '%s\n' "$DETECTED" | tail -n 1)
    if [[ ${#TE_RECIPE[@]} -gt 0 ]]; then   # the checkout must take --fp8-quantizer-factory
        CHECKOUT_CHECK=$("$PY" -m te_integration.megatron_lm --check-checkout "$MEGATRON_LM_DIR" 2>&1) \
            || die "$(printf '%s\n' "$CHECKOUT_CHECK" | grep -v '^[[:space:]]*$' | tail -n 1 | sed 's/^te_integration.megatron_lm: error: //')"
    fi
fi

# Our TE debug features (TE_INSPECT_CONFIG): a Megatron-LM checkout's TE layers, the YAML
# checked now (lowp-te-check), run through te_integration.megatron_lm.
if [[ -n "${TE_INSPECT_CONFIG:-}" ]]; then
    [[ -n "${MEGATRON_LM_DIR:-}" && "$DTYPE" == fp8 ]] || die "TE_INSPECT_CONFIG needs Transformer Engine layers in a Megatron-LM run: set MEGATRON_LM_DIR and DTYPE fp8"
    [[ ${#TE_RECIPE[@]} -eq 0 ]] || die "TE_INSPECT_CONFIG and CUSTOM_QUANT_TYPE=$QUANT cannot run together with Transformer Engine layers (TE's debug path sends the custom recipe's tensors to its cuBLAS GEMM, which refuses them): unset one of them"
    INSPECT_CHECK=$("$PY" -m te_integration.check_cli "$TE_INSPECT_CONFIG" 2>&1) \
        || die "$(printf '%s\n' "$INSPECT_CHECK" | grep -v '^[[:space:]]*$' | tail -n 1 | sed 's/^lowp-te-check: error: //')"
fi

HAS_CUDA=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
if [[ "$DTYPE" == fp8 && "$DRY_RUN" != 1 ]]; then
    [[ "$HAS_CUDA" == 1 ]] || die "DTYPE fp8 needs a CUDA GPU (none found): use bf16, or CUSTOM_QUANT_TYPE to emulate a format"
    "$PY" -c 'import transformer_engine' >/dev/null 2>&1 || die "DTYPE fp8 needs Transformer Engine: pip install transformer-engine[pytorch]"
    if [[ ${#TE_RECIPE[@]} -gt 0 ]]; then   # the factory's TE version, CUSTOM_QUANT_TYPE and role rules
        FACTORY_CHECK=$("$PY" -m te_integration.factory --check 2>&1) \
            || die "$(printf '%s\n' "$FACTORY_CHECK" | grep -v '^[[:space:]]*$' | tail -n 1 | sed 's/^te_integration.factory: error: //')"
    fi
    if [[ "$CAPTURE" == 1 ]]; then
        echo "train_llama32_1b_h100_fp8.sh: note: DTYPE fp8 runs Transformer Engine linears, which capture does not reach (docs/capture.md, 'Not captured'): their tensors are not saved; DTYPE bf16 captures them" >&2
    fi
fi

if [[ "$HAS_CUDA" == 1 ]]; then
    DEFAULT_GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
else
    DEFAULT_GPUS=1
fi
GPUS_PER_NODE=${GPUS_PER_NODE:-$DEFAULT_GPUS}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
TP=${TP:-1}; PP=${PP:-1}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-1}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-8}
TRAIN_ITERS=${TRAIN_ITERS:-1000}
LR=${LR:-3e-4}; MIN_LR=${MIN_LR:-3e-5}
[[ "$TRAIN_ITERS" =~ ^[1-9][0-9]*$ ]] || die "TRAIN_ITERS=$TRAIN_ITERS must be a positive integer"
if [[ -z "${WARMUP_ITERS:-}" ]]; then   # 100, or a tenth of a shorter run
    WARMUP_ITERS=$(( TRAIN_ITERS / 10 < 100 ? TRAIN_ITERS / 10 : 100 ))
elif [[ ! "$WARMUP_ITERS" =~ ^[0-9]+$ || "$WARMUP_ITERS" -ge "$TRAIN_ITERS" ]]; then
    die "WARMUP_ITERS=$WARMUP_ITERS must be an integer below TRAIN_ITERS=$TRAIN_ITERS (Megatron's learning-rate schedule asserts it)"
fi
SAVE_INTERVAL=${SAVE_INTERVAL:-500}
MODEL=${MODEL:-llama32_1b}
WORKDIR=${WORKDIR:-${CHECKPOINT_PATH}/.lowp}
# The model's shape: MODEL's (training_driver.train_config.MODEL_SHAPES), each field replaced by
# its variable when set; the same shape on either path and in the resource check.
SHAPE_ARGS=()
for VAR in NUM_LAYERS HIDDEN_SIZE FFN_HIDDEN_SIZE NUM_ATTENTION_HEADS NUM_QUERY_GROUPS SEQ_LENGTH; do
    if [[ -n "${!VAR:-}" ]]; then
        FLAG="--$(printf '%s' "$VAR" | tr 'A-Z_' 'a-z-')"
        SHAPE_ARGS+=("$FLAG" "${!VAR}")
    fi
done
# Megatron-LM: its arguments for this shape and machine, after checking what its training loop
# imports (six, psutil, pybind11, transformers) and that a CUSTOM_QUANT_PLAN matches a GEMM of
# this model (training_driver.megatron_lm.command); else the shape alone. One line, exit 2.
MLM_ARGS=()
COMMAND_ARGS=(--model "$MODEL" ${SHAPE_ARGS[@]+"${SHAPE_ARGS[@]}"} --dtype "$DTYPE")
if [[ -n "${MEGATRON_LM_DIR:-}" ]]; then
    COMMAND_ARGS+=(--checkout "$MEGATRON_LM_DIR" --quant-plan "${CUSTOM_QUANT_PLAN:-}")
    [[ ${#TE_RECIPE[@]} -eq 0 ]] || COMMAND_ARGS+=(--te-custom-recipe)
else
    COMMAND_ARGS+=(--shape-only)
fi
NOTES_FILE=$(mktemp)
if ! MLM_OUT=$("$PY" -m training_driver.megatron_lm.command "${COMMAND_ARGS[@]}" 2>"$NOTES_FILE"); then
    LINE=$(grep -v '^[[:space:]]*$' "$NOTES_FILE" | tail -n 1 | sed 's/^megatron_lm_command: error: //')
    rm -f "$NOTES_FILE"; die "$LINE"
fi
grep ': note: ' "$NOTES_FILE" >&2 || true
rm -f "$NOTES_FILE"
[[ -z "$MLM_OUT" ]] || mapfile -t MLM_ARGS <<<"$MLM_OUT"
# Anything else for pretrain_gpt.py, word-split (e.g. --no-load-rng, --exit-interval 3)
read -r -a MLM_EXTRA <<<"${MEGATRON_LM_EXTRA_ARGS:-}"

if [[ "$NODE_RANK" == 0 ]] && ! "$PY" -c "import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', int(sys.argv[1])))" "$MASTER_PORT" 2>/dev/null; then
    die "MASTER_PORT $MASTER_PORT is in use: export MASTER_PORT=<a free port>"
fi

# Can this node hold the model and one captured iteration? The estimate of
# training_driver.preflight (memory: weights, gradients, optimizer, activations; capture size
# against the byte budget / free disk), for the same shape on either path. One line, exit 2.
if [[ "${IGNORE_RESOURCE_CHECK:-0}" != 1 ]]; then
    CHECK_ARGS=(--data-path "$DATA_PATH" --tokenizer "$TOKENIZER_PATH" --model "$MODEL"
                --dtype "$DTYPE" --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
                --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE")
    CHECK_ARGS+=(${SHAPE_ARGS[@]+"${SHAPE_ARGS[@]}"})
    RESOURCES=$("$PY" -m training_driver.preflight_cli resources --ranks "$GPUS_PER_NODE" \
        --world-size "$((GPUS_PER_NODE * NNODES))" --remedy "MODEL=tiny, a smaller SEQ_LENGTH or MICRO_BATCH_SIZE fits, or set IGNORE_RESOURCE_CHECK=1 to run anyway" \
        --prog train_llama32_1b_h100_fp8.sh -- "${CHECK_ARGS[@]}" 2>&1) \
        || die "$(printf '%s\n' "$RESOURCES" | grep -v '^[[:space:]]*$' | tail -n 1 | sed 's/^preflight: error: //')"
    printf '%s\n' "$RESOURCES" | grep -v '^[[:space:]]*$' | tail -n 1 >&2
fi
export LOWP_RESOURCES_CHECKED=1     # checked (or waived) once here, not again on every rank
[[ -z "$RECIPE_NOTE" ]] || echo "train_llama32_1b_h100_fp8.sh: note: $RECIPE_NOTE" >&2
if [[ "$HAS_CUDA" != 1 && "$MODEL" == llama32_1b ]]; then
    echo "train_llama32_1b_h100_fp8.sh: note: no GPU found; a 1B model on CPU is very slow (MODEL=tiny runs a small smoke version)" >&2
fi

DIST_ARGS=(--nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK"
           --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")

if [[ -n "${MEGATRON_LM_DIR:-}" ]]; then
    # Patch a copy, never the user's checkout; run the copy's pretrain_gpt.py so its megatron/
    # (first on sys.path as the script's folder) is the patched one.
    TREE="$WORKDIR/megatron-lm"
    # Megatron-LM asserts it for tensor (or context) parallelism (arguments.py), as its own
    # example scripts set it: one CUDA work queue keeps communication and compute in order.
    export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
    # The script runs through te_integration.megatron_lm when TE layers need names (the
    # custom recipe's name rules) or our debug features are on (TE_INSPECT_CONFIG): released
    # Megatron-LM has no --tensor-inspect flags (pull request #3811 only).
    ENTRY=()
    if [[ -n "${TE_INSPECT_CONFIG:-}" ]]; then
        ENTRY=(-m te_integration.megatron_lm --inspect-config "$TE_INSPECT_CONFIG"
               --inspect-log-dir "${TE_INSPECT_LOG_DIR:-$CHECKPOINT_PATH/inspect_logs}")
    elif [[ ${#TE_RECIPE[@]} -gt 0 ]]; then
        ENTRY=(-m te_integration.megatron_lm)
    fi
    echo "train_llama32_1b_h100_fp8.sh: Megatron-LM checkout $MEGATRON_LM_DIR (megatron-core $MEGATRON_VERSION), MODEL=$MODEL, $(printf '%s ' "${MLM_ARGS[@]}" | grep -o -- '--transformer-impl [a-z_]*')" >&2
    PRECISION=(--bf16)
    if [[ ${#TE_RECIPE[@]} -gt 0 ]]; then
        PRECISION+=(--fp8-format hybrid "${TE_RECIPE[@]}")
        echo "train_llama32_1b_h100_fp8.sh: CUSTOM_QUANT_TYPE=$QUANT on Transformer Engine linears: ${TE_RECIPE[*]}" >&2
    elif [[ "$DTYPE" == fp8 ]]; then
        PRECISION+=(--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max)
    fi
    if [[ "${RECIPE_ARGS[0]:-}" == --fp4-recipe ]]; then
        PRECISION=(--bf16 --fp4-format e2m1 "${RECIPE_ARGS[@]}")
    elif [[ ${#RECIPE_ARGS[@]} -gt 0 ]]; then
        PRECISION+=("${RECIPE_ARGS[@]}")
    fi
    COMMAND=("$PY" -m training_driver.torchrun "${DIST_ARGS[@]}" ${ENTRY[@]+"${ENTRY[@]}"} "$TREE/pretrain_gpt.py" \
        "${MLM_ARGS[@]}" --position-embedding-type rope --rotary-base 500000 \
        --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights --disable-bias-linear \
        --attention-dropout 0.0 --hidden-dropout 0.0 \
        --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
        --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE" \
        --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine \
        --lr-warmup-iters "$WARMUP_ITERS" --weight-decay 0.1 --clip-grad 1.0 \
        --adam-beta1 0.9 --adam-beta2 0.95 "${PRECISION[@]}" \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_PATH" \
        --data-path "$DATA_PATH" --split 99,1,0 \
        --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval "$SAVE_INTERVAL" \
        --eval-interval 1000 --eval-iters 10 --log-interval 1 \
        --tensorboard-dir "$TENSORBOARD_LOGS_PATH" ${MLM_EXTRA[@]+"${MLM_EXTRA[@]}"})
    # DRY_RUN=1: the exact command, and nothing copied, patched or created
    if [[ "$DRY_RUN" == 1 ]]; then printf '%q ' "${COMMAND[@]}"; printf '\n'; exit 0; fi
    mkdir -p "$CHECKPOINT_PATH" "$TENSORBOARD_LOGS_PATH" "$TREE"
    (cd "$MEGATRON_LM_DIR" && tar --exclude=.git -cf - .) | (cd "$TREE" && tar -xf -)
    if [[ "$CAPTURE" == 1 ]]; then
        bash "$HERE/patches/apply_patches.sh" "$TREE" >/dev/null || die "could not apply the patch set to the copy of $MEGATRON_LM_DIR (see the message above)"
    fi
    exec "${COMMAND[@]}"
fi

TRAIN_ARGS=(--data-path "$DATA_PATH" --tokenizer "$TOKENIZER_PATH" --model "$MODEL"
            --dtype "$DTYPE" --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
            --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE"
            --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr "$MIN_LR" --warmup-iters "$WARMUP_ITERS"
            --checkpoint-dir "$CHECKPOINT_PATH" --save-interval "$SAVE_INTERVAL"
            --tensorboard-dir "$TENSORBOARD_LOGS_PATH" ${SHAPE_ARGS[@]+"${SHAPE_ARGS[@]}"})
COMMAND=("$PY" -m training_driver.torchrun "${DIST_ARGS[@]}" -m training_driver.train "${TRAIN_ARGS[@]}")
if [[ "$DRY_RUN" == 1 ]]; then printf '%q ' "${COMMAND[@]}"; printf '\n'; exit 0; fi
mkdir -p "$CHECKPOINT_PATH" "$TENSORBOARD_LOGS_PATH" "$WORKDIR"
if [[ "$CAPTURE" == 1 && -z "${MEGATRON_LOWP_PATCHED_DIR:-}" ]]; then
    PATCHED=$("$PY" -c 'import sys; from training_driver.capture import prepare_patched_tree; p = prepare_patched_tree(sys.argv[1]); print(p or "")' "$WORKDIR/patched_megatron") \
        || die "could not prepare the patched megatron-core (see the message above)"
    if [[ -n "$PATCHED" ]]; then
        export MEGATRON_LOWP_PATCHED_DIR="$PATCHED"
        export PYTHONPATH="${PATCHED}:${PYTHONPATH}"
    else
        echo "train_llama32_1b_h100_fp8.sh: note: the capture patch set is not installed; training unpatched" >&2
    fi
fi

exec "${COMMAND[@]}"
