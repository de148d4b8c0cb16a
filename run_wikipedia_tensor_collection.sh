#!/usr/bin/env bash
# Collect attention/linear tensors from a training run (seed item 7), then summarize them.
#
#   bash run_wikipedia_tensor_collection.sh                 # embedded default: tiny Llama on CPU,
#                                                           # corpus built from Python's docs
#   bash run_wikipedia_tensor_collection.sh --data-path dataset/wikipedia_processed/wikipedia_processed_text_document \
#        --tokenizer dataset/wikipedia_processed/tokenizer --visualize
#   bash run_wikipedia_tensor_collection.sh --help          # every option
#
# It sets TENSOR_SAVE_ENABLED/TENSOR_SAVE_DIR/TENSOR_SAVER_ITERATION/CUSTOM_QUANT_TYPE, launches
# llama-train on the patched megatron-core, watches the tensor directory, stops once one full
# iteration is saved (>= 10 files) or after 5 minutes, prints a summary, and with --visualize
# runs script/one_click_visualize.sh. The logic is training_driver/collector/__init__.py.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PYTHONPATH="${HERE}${PYTHONPATH:+:${PYTHONPATH}}"
# megatron-core warns at import that TE/apex are absent on CPU machines; that is expected here.
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore:Transformer Engine and Apex are not installed,ignore:Apex is not installed,ignore:full scope is deprecated}"
exec "${PYTHON:-python}" -m training_driver.collector "$@"
