#!/usr/bin/env bash
# Hardware counters of the MLA attention kernel of one benchmarks/mla.py row
# (benchmarks/dev/profile_mla.py; $ROW, default 1: 128 x 4k, 128 heads) for flashjit
# fa3 and, when importable, FlashInfer fa3: the throughput and stall table
# (ncu_table.py) and stall samples per opcode (ncu_ops.py) go to $OUT, with the reports.
#   ROW=1 bash benchmarks/dev/ncu_mla.sh
set -uo pipefail
OUT=${OUT:-$PWD/ncu_out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../.."
. benchmarks/gpu_env.sh
ROW=${ROW:-1}

profile() {  # name, profile_mla.py arguments...
  local name=$1; shift
  ncu --clock-control none --set full --import-source no -k 'regex:[Mm][Ll][Aa]' --launch-skip 2 -c 1 \
    -f -o "$OUT/$name" python3 benchmarks/dev/profile_mla.py --row "$ROW" "$@" > "$OUT/$name.log" 2>&1 \
    || { echo "$name: ncu failed"; tail -5 "$OUT/$name.log"; return; }
  ncu -i "$OUT/$name.ncu-rep" --page raw --csv > "$OUT/$name.raw.csv" 2>/dev/null
  ncu -i "$OUT/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/$name.sass.csv" 2>/dev/null
}

profile flashjit_fa3 --lib flashjit
python3 -c "import flashinfer" 2>/dev/null && profile flashinfer_fa3 --lib flashinfer
python3 benchmarks/dev/ncu_table.py "$OUT"/*.raw.csv | tee "$OUT/ncu_table.md"
python3 benchmarks/dev/ncu_ops.py "$OUT"/*.sass.csv > "$OUT/ncu_ops.md"
(cd "$OUT" && tar czf ncu_reports.tar.gz ./*.ncu-rep ./*.csv ./*.log 2>/dev/null && rm -f ./*.ncu-rep ./*.csv ./*.log)
