#!/usr/bin/env bash
# SmolLM2-135M, dense vs dynamic sparse attention: the results in benchmarks/results/*smollm2*.
#   bash benchmarks/smollm2_eval.sh OUT_DIR [perplexity|fidelity|niah|ruler ...] [-- extra "$repo/launch/eval.py" args]
# Runs with the project's .venv (make install-eval), or $PYTHON.
# Default settings (SparseAttentionConfig defaults); sparse attention computed as masked SDPA (--masked), which
# has the index's exact semantics and runs anywhere; MASKED=0 goes through the sparse kernels (GPU).
# The 8K model's lengths by default; LENGTHS, RULER_TASKS and RULER_SAMPLES set them for an extended model, e.g.
#   LENGTHS="8192 16384 32768" RULER_SAMPLES=20 MASKED=0 bash benchmarks/smollm2_eval.sh out ruler -- --model hf/
# (fidelity runs at the longest length).
set -euo pipefail
out=${1:?usage: smollm2_eval.sh OUT_DIR [parts...]}; shift
parts=(); extra=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; extra=("$@"); break; fi
  parts+=("$1"); shift
done
[ ${#parts[@]} -gt 0 ] || parts=(perplexity fidelity niah ruler)
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$repo/.venv/bin/python}  # the venv the README's make targets build (PYTHON: a path or a command name)
command -v "$py" > /dev/null || { echo "error: $py not found; run make install-eval first (or set PYTHON to an interpreter with the eval extra)" >&2; exit 2; }
read -r -a lengths <<< "${LENGTHS:-2048 4096 8192}"
read -r -a tasks <<< "${RULER_TASKS:-niah_single_1 niah_single_2 niah_single_3 niah_multikey_1}"
masked=(); [ "${MASKED:-1}" = 0 ] || masked=(--masked)
ruler_lengths=("${lengths[@]}"); [ -n "${LENGTHS:-}" ] || ruler_lengths=(4096 8192)

for part in "${parts[@]}"; do
  case $part in
    perplexity) "$py" "$repo/launch/eval.py" perplexity --lengths "${lengths[@]}" --rows 4 ${masked[@]+"${masked[@]}"} --out "$out" ${extra[@]+"${extra[@]}"} ;;
    fidelity)   "$py" "$repo/launch/eval.py" fidelity --length "${lengths[-1]}" ${masked[@]+"${masked[@]}"} --out "$out" ${extra[@]+"${extra[@]}"} ;;
    niah)       "$py" "$repo/launch/eval.py" niah --lengths 1024 "${lengths[@]}" --depths 0 0.1 0.25 0.4 0.5 0.6 0.75 0.9 1 ${masked[@]+"${masked[@]}"} --out "$out" ${extra[@]+"${extra[@]}"} ;;
    ruler)      "$py" "$repo/launch/eval.py" ruler --tasks "${tasks[@]}" --lengths "${ruler_lengths[@]}" --samples "${RULER_SAMPLES:-10}" ${masked[@]+"${masked[@]}"} --out "$out" ${extra[@]+"${extra[@]}"} ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
