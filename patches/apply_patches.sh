#!/usr/bin/env bash
# Put the tensor-capture / CUSTOM_QUANT_TYPE emulation calls into a Megatron tree.
#
#   patches/apply_patches.sh MEGATRON_TREE            apply (idempotent)
#   patches/apply_patches.sh MEGATRON_TREE --check    exit 0 patched, 1 not patched, 2 problem
#   patches/apply_patches.sh MEGATRON_TREE --revert   undo, byte for byte
#   patches/apply_patches.sh MEGATRON_TREE --detect   print the megatron-core version; exit 2 if unsupported
#
# MEGATRON_TREE is a Megatron-LM checkout or any directory containing megatron/core
# (e.g. a copy of the installed megatron-core; never patch site-packages in place).
# The edit set follows megatron/core/package_info.py (0.16.1 ... 0.19.x and Megatron-LM main);
# the edits are defined in tensor_capture/patch_edits.py, applied by tensor_capture/patcher.py;
# this is a thin wrapper around it. A refusal is one line on stderr and exit status 2.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="${HERE}${PYTHONPATH:+:${PYTHONPATH}}"   # works installed or not
if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
    exec python -m tensor_capture.patcher --help
fi
exec python -m tensor_capture.patcher "$@"
