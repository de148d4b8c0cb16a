#!/bin/bash
# A Megatron-LM launch with one of each launch hazard (read by tests/test_profiler_launch.py,
# which expects each finding on the line named in its comment; never run).
set -euo pipefail
export TENSOR_SAVE_ENABLED=true
export TENSOR_SAVE_CONFIG=unbounded_capture.yaml       # LCH006
export CUSTOM_QUANT_TYPE=mxfp8                         # LCH001 (TE linears by default)
GPT_ARGS=(
    --num-layers 16 --hidden-size 2048
    --fp8-format e5m2 \
        --fp8-recipe mxfp8                             # line 10: LCH002 and LCH004 (no --bf16)
    --fp4-format e2m1                                  # LCH003 where the install has no FP4
)
torchrun --nproc-per-node 8 pretrain_gpt.py "${GPT_ARGS[@]}"   # LCH005 without apex
