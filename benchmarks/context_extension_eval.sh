#!/usr/bin/env bash
# Evaluations of a context extension (benchmarks.context_extension): the original model (with the RoPE stretch)
# and the dense- and sparse-extended exports, each with dense and sparse attention, at 8K / 16K / 32K:
# perplexity, RULER niah (20 samples per task and length), the NIAH grid and the fidelity harness at 16K and 32K.
#   bash benchmarks/context_extension_eval.sh ORIGINAL_MODEL EXTENSION_WORK REPORT_DIR [-- extra launch/eval.py args]
# The three models run concurrently (one GPU holds them all); the reports land in REPORT_DIR as
# {original,dense,sparse}_{perplexity,ruler,niah,fidelity16k,fidelity32k}.md (+ PNG / JSON), then one
# REPORT_DIR.tar.gz holds them all. Runs with $PYTHON (default: the project's .venv); LENGTHS, FIDELITY_LENGTHS,
# RULER_TASKS, RULER_SAMPLES and MASKED (default 0: the sparse kernels) change the defaults above; PARTS (default
# "perplexity ruler niah fidelity") picks what to run, to split the work over calls of a time-limited machine, and
# ORIGINAL_PARTS (default: PARTS; empty: nothing) what to run on the original model (whose results do not change
# with a retraining).
set -euo pipefail
original=${1:?usage: context_extension_eval.sh ORIGINAL_MODEL EXTENSION_WORK REPORT_DIR}
extension=${2:?usage: context_extension_eval.sh ORIGINAL_MODEL EXTENSION_WORK REPORT_DIR}
out=${3:?usage: context_extension_eval.sh ORIGINAL_MODEL EXTENSION_WORK REPORT_DIR}
shift 3
[ "${1:-}" != "--" ] || shift
repo=$(cd "$(dirname "$0")/.." && pwd)
export PYTHON=${PYTHON:-$repo/.venv/bin/python}
export LENGTHS=${LENGTHS:-8192 16384 32768} RULER_TASKS=${RULER_TASKS:-niah_single_2 niah_multikey_1}
export RULER_SAMPLES=${RULER_SAMPLES:-20} MASKED=${MASKED:-0}
fidelity_lengths=${FIDELITY_LENGTHS:-16384 32768}
parts=${PARTS:-perplexity ruler niah fidelity}
original_parts=${ORIGINAL_PARTS-$parts}  # set and empty: the original model is not evaluated
mkdir -p "$out"

evaluate() {  # NAME, PARTS, then the model's launch/eval.py arguments
  local name=$1 part parts; read -r -a parts <<< "$2"; shift 2
  local common=(--ds-config "$repo/ds_configs/zero2_offload.json" "$@")
  for part in "${parts[@]}"; do
    if [ "$part" != fidelity ]; then
      bash "$repo/benchmarks/smollm2_eval.sh" "$out" "$part" -- "${common[@]}" --tag "${name}_" >> "$out/${name}.log" 2>&1 \
        || echo "$name: $part failed (see $out/$name.log)"  # the other parts still run
      continue
    fi
    for length in $fidelity_lengths; do
      LENGTHS=$length bash "$repo/benchmarks/smollm2_eval.sh" "$out" fidelity -- "${common[@]}" \
        --tag "${name}_fidelity$((length / 1024))k_" >> "$out/${name}.log" 2>&1 || echo "$name: fidelity $length failed"
    done
  done
}

evaluate original "$original_parts" --model "$original" --rope-kind yarn --rope-factor 4 "$@" &
evaluate dense "$parts" --model "$extension/dense/hf" "$@" &
evaluate sparse "$parts" --model "$extension/sparse/hf" "$@" &
wait
tar -czf "$out.tar.gz" -C "$(dirname "$out")" "$(basename "$out")"
echo "reports in $out and $out.tar.gz"
