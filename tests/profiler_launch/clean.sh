#!/usr/bin/env bash
# The same launch without hazards: local linears for the emulation, bf16, fusion off, bounded.
export TENSOR_SAVE_ENABLED=true
export CUSTOM_QUANT_TYPE="$QUANT"        # not a literal: decided at run time, not judged
export CUSTOM_QUANT_TYPE=hifp8
ARGS=(--transformer-impl local --bf16 --fp8-format hybrid --fp8-recipe delayed
      --no-gradient-accumulation-fusion)
torchrun pretrain_gpt.py "${ARGS[@]}"
