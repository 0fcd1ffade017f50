#!/usr/bin/env bash
# Hardware counters of one d128 bf16 prefill call (benchmarks/dev/profile_prefill.py:
# 4 x 4096 tokens, 16 heads, not causal; $PROFILE_ARGS such as '--shape 16 1024
# --causal --backend fa3' change it) for flashjit's default tiling, each tiling given as an
# argument (a Fa2Tiling(...) expression, with '@DIR' rendered from the templates
# folder DIR), and FlashInfer fa2 when importable. Reports (.ncu-rep, raw CSV,
# SASS with stall samples) go to $OUT; a table of the throughput and stall
# metrics that locate a loop's limit is printed last (ncu_ops.md: stall samples per
# opcode). INVARIANT=1 adds flashjit's call in batch-invariant mode.
#   bash benchmarks/dev/ncu_prefill.sh ['Fa2Tiling(...)' ...]
# Runs from any directory, in the repository root (a '@DIR' is relative to it);
# $OUT (default ./ncu_out) is relative to the caller's directory.
set -uo pipefail
OUT=${OUT:-$PWD/ncu_out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../.."  # the repository root: .whl/, benchmarks/
: > "$OUT/variants.txt"  # the archive below lists it even when no variant is given
. benchmarks/dev/gpu_env.sh

profile() {  # name, extra profile_prefill.py arguments...
  local name=$1; shift
  ncu --clock-control none --set full --import-source no -k 'regex:fa[23]_attention|BatchPrefill' -c 1 \
    -f -o "$OUT/$name" python3 benchmarks/dev/profile_prefill.py ${PROFILE_ARGS:-} "$@" > "$OUT/$name.log" 2>&1 \
    || { echo "$name: ncu failed"; tail -5 "$OUT/$name.log"; return; }
  ncu -i "$OUT/$name.ncu-rep" --page raw --csv > "$OUT/$name.raw.csv" 2>/dev/null
  ncu -i "$OUT/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/$name.sass.csv" 2>/dev/null
}

profile flashjit --no-flashinfer
# INVARIANT=1: also the call planned in batch-invariant mode (fa3: the chunk-fold kernel).
[ -n "${INVARIANT:-}" ] && profile flashjit_invariant --no-flashinfer --batch-invariant
i=0
for tiling in "$@"; do
  i=$((i + 1))
  if [[ $tiling == *@* ]]; then  # 'Fa2Tiling(...)@DIR': rendered from the templates in DIR
    profile "variant$i" --no-flashinfer --tiling "${tiling%@*}" --templates "${tiling#*@}"
  else
    profile "variant$i" --no-flashinfer --tiling "$tiling"
  fi
  echo "variant$i = $tiling" >> "$OUT/variants.txt"
done
if python3 -c "import flashinfer" 2>/dev/null; then
  # FlashInfer's plan/run are profiled in a process of their own; flashjit's kernel is skipped there
  # (its fa2 kernels are named BatchPrefill..., its fa3 ones PrefillWithKVCacheKernel).
  ncu --clock-control none --set full --import-source no -k 'regex:BatchPrefill|PrefillWithKVCache' -c 1 -f -o "$OUT/flashinfer" \
    python3 benchmarks/dev/profile_prefill.py ${PROFILE_ARGS:-} > "$OUT/flashinfer.log" 2>&1 || echo "flashinfer: ncu failed"
  ncu -i "$OUT/flashinfer.ncu-rep" --page raw --csv > "$OUT/flashinfer.raw.csv" 2>/dev/null
  ncu -i "$OUT/flashinfer.ncu-rep" --page source --csv --print-source sass > "$OUT/flashinfer.sass.csv" 2>/dev/null
fi
python3 benchmarks/dev/ncu_table.py "$OUT"/*.raw.csv | tee "$OUT/ncu_table.md"
python3 benchmarks/dev/ncu_ops.py "$OUT"/*.sass.csv > "$OUT/ncu_ops.md"  # stall samples per opcode
# The device returns few files: one archive of the reports.
(cd "$OUT" && tar czf ncu_reports.tar.gz ./*.ncu-rep ./*.csv ./*.log ./variants.txt 2>/dev/null \
  && rm -f ./*.ncu-rep ./*.csv ./*.log)
