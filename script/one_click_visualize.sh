#!/usr/bin/env bash
# One-click visualization: every figure, quick_analysis.png, tensor_stats.txt and index.html.
#   bash script/one_click_visualize.sh TENSOR_DIR [OUT_DIR] [extra visualize_tensors.py options]
# Exit code: 0 figures drawn, 2 a usage error or nothing readable to draw (one line on stderr), 1 the tool failed.
set -euo pipefail
usage() {
  echo "usage: bash script/one_click_visualize.sh TENSOR_DIR [OUT_DIR=./draw] [options of script/visualize_tensors.py]"
  echo "  draws every figure of TENSOR_DIR (the capture's TENSOR_SAVE_DIR) into OUT_DIR; open OUT_DIR/index.html"
}
if [ $# -lt 1 ]; then
  echo "one_click_visualize.sh: error: give the capture folder: bash script/one_click_visualize.sh TENSOR_DIR [OUT_DIR] (see --help)" >&2
  exit 2
fi
if [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
  usage
  exit 0
fi
tensor_dir=$1
out_dir=${2:-./draw}
shift $(( $# >= 2 ? 2 : 1 ))
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
echo "one-click: visualizing $tensor_dir into $out_dir"
exec "${PYTHON:-python}" "$here/visualize_tensors.py" --tensor_dir "$tensor_dir" --output_dir "$out_dir" "$@"
