#!/usr/bin/env bash
# GPU check in one call: info, GPU tests (prewarm + numerical sweep), JIT
# benchmarks, prefill/decode benchmarks. Run from the repository root; logs and
# reports go to $OUT (or ./gpu_out); a short summary is printed last.
#   bash benchmarks/gpu_check.sh [quick|medium|full|tests|bench|compare|prefill|mla|invariant|fp8|spec|sanitize|verify]
# tests: GPU tests only; prefill: GPU tests and prefill.py --rounds 3;
# fp8: the FP8 KV-cache GPU tests (tests/test_gpu_*fp8*.py), then decode.py
# --kv-dtype bf16 e4m3 (decode_fp8.md/.json; $FP8_KV_DTYPES replaces "bf16 e4m3"),
# with FP8_TILINGS=1 the FP8 decode tilings' A/B (dev/decode_tilings.py --kv-dtype
# e4m3, both cores), and a table of both steps with the FP8/bf16 speed ratios last;
# mla: the MLA GPU tests (FLASHJIT_PREWARM_OPS=mla_paged: only MLA kernels built)
# for the shipped fa3 tiling and for each of $MLA_VARIANTS (';'-separated
# Fa3MlaTiling(...) expressions; default: whole-tile waits; dev/pytest_mla_tiling.py),
# dev/mla_check.py on each, each also under compute-sanitizer racecheck, synccheck
# and memcheck (SANITIZE_SHIPPED=0: the variants alone), then benchmarks/mla.py
# beside FlashInfer with the variants and a second column of the shipped kernel
# (--baseline-templates templates: the spread an A/B must beat; $MLA_BASELINE: other
# sources' folder instead); MLA_SAME_BITS=1: the variants' mla_check also asks
# for the shipped tiling's outputs bit for bit (mla_check.py --same-bits);
# spec: speculative decoding and shared prefixes: the custom-mask and cascade GPU
# tests, then dev/verification_speed.py and dev/cascade_speed.py beside FlashInfer;
# sanitize: the GPU tests of $SANITIZE_TESTS (default: custom masks, cascade, fa3 over an FP8
# cache, head dim 512; FLASHJIT_TEST_HEAD_DIMS defaults to 128,512), once plain (builds the kernels),
# then under compute-sanitizer memcheck, racecheck and synccheck at once ($SANITIZE_K: a pytest -k filter;
# each tool under $SANITIZE_LIMIT seconds, default 240);
# verify: the newest fa3 and FP8 kernels, step by step, without the whole GPU suite ($VERIFY_STEPS,
# default all of "d96 fp8fa3 compile fp8mla walk prefill96 sinks tilings"; each under $VERIFY_LIMIT
# seconds, default 300, the tilings under $TILINGS_LIMIT, default 480):
# fa3 at head dim 96 (tests/test_gpu_head_dims.py at 96), fa3 over an FP8 cache at every head dim,
# the FP8 operators under torch.compile (MLA's scales), FP8 MLA on fa2 and fa3, the persistent
# grid's walk against its rounds (dev/fa3_walk.py), prefill at 96 beside fa2, cuDNN and FlashInfer
# and what sinks cost (dev/head_dims_sinks.py), and fa3's tilings at $VERIFY_HEAD_DIMS (default 128;
# the second Q buffer and the turns among them, dev/fa2_tilings.py; $VERIFY_BASELINE: a templates/
# folder of other sources timed beside); a table last;
# invariant: the batch-invariant GPU tests, then dev/batch_invariant_cost.py
# with $INVARIANT_ARGS (default: every prefill and decode row);
# bench: JIT, prefill (S = 1k, 4k) and decode benchmarks only;
# compare: GPU tests, dev/fa2_tilings.py for each of $HEAD_DIMS (default 128; with
# --baseline-templates $BASELINE_TEMPLATES when set, one or more folders, absolute
# or relative to the repository root: a kernel change against the sources before
# it, in the same run; $TILINGS_ARGS is passed on, e.g. --no-variants) and
# decode.py (with $BASELINE_TEMPLATES: dev/decode_tilings.py, the shipped decode
# tiling from each folder and from this tree in one run), each step under a time
# limit.
# TEST_FILES="tests/a.py tests/b.py" runs those GPU test files instead of the whole suite.
# SKIP_TESTS=1 leaves out the GPU tests, SKIP_DECODE=1 decode.py, SKIP_BENCH=1 the
# invariant mode's benchmark. FlashInfer comes
# from .whl/site.txz (benchmarks/dev/pack_flashinfer.sh) or wheels in .whl/.
set -uo pipefail
MODE=${1:-full}
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
. benchmarks/dev/gpu_env.sh
export FLASHJIT_ERROR_REPORT=$OUT/error_report.json
status=0
summarize_errors() {  # the GPU tests write the report: without them (bench, SKIP_TESTS) there is none
  [ -f "$OUT/error_report.json" ] || return 0
  python3 benchmarks/dev/error_summary.py "$OUT/error_report.json" --out "$OUT/error_summary.md" | tail -40
}
python3 -m flashjit info 2>&1 | tee "$OUT/info.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.total --format=csv | tee -a "$OUT/info.txt"

start=$(date +%s)
test_rc=skipped
targets=(${TEST_FILES:-tests})  # $TEST_FILES: these test files alone; fp8: the FP8 KV-cache GPU test files
[ "$MODE" = fp8 ] && targets=($(ls tests/test_gpu_fp8.py tests/test_gpu_*fp8*.py 2>/dev/null | sort -u)) &&
  export FLASHJIT_PREWARM_FP8=1  # the prewarm fixture builds the FP8 configurations alone
[ "$MODE" = spec ] && targets=(tests/test_gpu_custom_mask.py tests/test_gpu_cascade.py)
if [ "$MODE" = sanitize ]; then
  targets=(${SANITIZE_TESTS:-tests/test_gpu_custom_mask.py tests/test_gpu_cascade.py tests/test_gpu_fp8_fa3.py
           tests/test_gpu_head_dim_512.py})
  export FLASHJIT_TEST_HEAD_DIMS=${FLASHJIT_TEST_HEAD_DIMS:-128,512}
fi
if [ "$MODE" != bench ] && [ "$MODE" != verify ] && [ -z "${SKIP_TESTS:-}" ]; then
selection=()
[ "$MODE" = mla ] && selection=(-k mla) && export FLASHJIT_PREWARM_OPS=mla_paged
if [ "$MODE" = invariant ]; then  # its tests load kernels outside the sweep's prewarm: build them in one run first
  selection=(-k invariant)
  ops="single_prefill single_decode batch_prefill_ragged batch_prefill_paged batch_decode_paged"
  { python3 -m flashjit prewarm --batch-invariant --op $ops --dtype bf16 fp16 fp32 --head-dim 64 128 256 \
      --backend auto fa2 --causal on &&
    python3 -m flashjit prewarm --op batch_prefill_ragged batch_decode_paged --dtype bf16 --head-dim 64 128 256 \
      --tensor-cores both --causal both; } >"$OUT/prewarm_invariant.log" 2>&1 || status=1
  echo "prewarm (batch-invariant kernels): $(tail -n 1 "$OUT/prewarm_invariant.log") in $(( $(date +%s) - start )) s"
fi
python3 -m pytest -q --maxfail=30 --tb=short -m gpu "${targets[@]}" "${selection[@]}" -p no:cacheprovider --durations=5 2>&1 \
  | tee "$OUT/pytest_gpu.log" | tail -25
test_rc=${PIPESTATUS[0]}
[ "$test_rc" = 0 ] || status=1
echo "gpu tests: rc=$test_rc in $(( $(date +%s) - start )) s"
fi
if [ "$MODE" = compare ]; then
  baseline=${BASELINE_TEMPLATES:+--baseline-templates $BASELINE_TEMPLATES}
  for d in ${HEAD_DIMS:-128}; do
    variants=--no-variants  # the alternative tilings only for $VARIANT_HEAD_DIMS (default: all)
    case " ${VARIANT_HEAD_DIMS-${HEAD_DIMS:-128}} " in *" $d "*) variants= ;; esac
    timeout ${TILINGS_LIMIT:-240} python3 benchmarks/dev/fa2_tilings.py --head-dim "$d" $baseline $variants \
      ${TILINGS_ARGS:-} --out "$OUT/tilings_d$d.md" 2>"$OUT/tilings_d$d.err" | grep "|" || status=1
  done
  if [ -n "${SKIP_DECODE:-}" ]; then
    :
  elif [ -n "${BASELINE_TEMPLATES:-}" ]; then
    timeout ${DECODE_LIMIT:-240} python3 benchmarks/dev/decode_tilings.py $baseline --no-variants \
      --out "$OUT/decode_tilings.md" 2>"$OUT/decode.err" | grep "|" || status=1
  else
    timeout ${DECODE_LIMIT:-240} python3 benchmarks/decode.py --out "$OUT/decode.md" --json "$OUT/decode.json" \
      2>"$OUT/decode.err" | tail -20 || status=1
  fi
fi
if [ "$MODE" = mla ]; then
  IFS=';' read -r -a variants <<< "${MLA_VARIANTS:-Fa3MlaTiling(stages=2)}"
  fa3_variant_args=()
  for i in "${!variants[@]}"; do
    variant=${variants[$i]}
    fa3_variant_args+=(--fa3-variant "$variant")
    [ -n "${SKIP_TESTS:-}" ] && continue
    FLASHJIT_ERROR_REPORT=$OUT/error_report_variant$i.json python3 benchmarks/dev/pytest_mla_tiling.py "$variant" \
      -q --maxfail=30 --tb=short -m gpu -k mla tests -p no:cacheprovider >"$OUT/pytest_gpu_variant$i.log" 2>&1 || status=1
    echo "gpu tests, $variant: $(tail -n 1 "$OUT/pytest_gpu_variant$i.log")"
  done
  for tiling in "" "${variants[@]}"; do
    tag=${tiling:+_$(echo "$tiling" | tr -c 'A-Za-z0-9=\n' '_')}
    timeout 300 python3 benchmarks/dev/mla_check.py --backends fa3 ${tiling:+--fa3-tiling "$tiling"} \
      ${tiling:+${MLA_SAME_BITS:+--same-bits}} >"$OUT/mla_check$tag.log" 2>&1 || status=1
    echo "mla_check fa3 ${tiling:-shipped}: $(tail -n 1 "$OUT/mla_check$tag.log")"
    # SANITIZE_SHIPPED=0: the sanitizers on the variants alone (the shipped kernel's last clean run is a results file)
    [ -z "$tiling" ] && [ "${SANITIZE_SHIPPED:-1}" = 0 ] && continue
    for tool in racecheck synccheck memcheck; do
      timeout 420 compute-sanitizer --tool $tool --error-exitcode 1 python3 benchmarks/dev/mla_check.py --small \
        --backends fa3 ${tiling:+--fa3-tiling "$tiling"} >"$OUT/sanitizer_$tool$tag.log" 2>&1 || status=1
      echo "$tool ${tiling:-shipped}: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool$tag.log" | tail -n 1)"
    done
  done
  timeout ${MLA_LIMIT:-420} python3 benchmarks/mla.py --baseline-templates ${MLA_BASELINE:-templates} "${fa3_variant_args[@]}" \
    --out "$OUT/mla.md" 2>"$OUT/mla.err" | grep "|" || status=1
fi
if [ "$MODE" = invariant ] && [ -z "${SKIP_BENCH:-}" ]; then
  timeout ${INVARIANT_LIMIT:-480} python3 benchmarks/dev/batch_invariant_cost.py ${INVARIANT_ARGS:-} \
    --out "$OUT/batch_invariant_cost.md" --json "$OUT/batch_invariant_cost.json" 2>"$OUT/batch_invariant_cost.err" \
    | grep "|" || status=1
fi
if [ "$MODE" = prefill ]; then
  python3 benchmarks/prefill.py --rounds 3 --out "$OUT/prefill.md" 2>"$OUT/prefill.err" | grep "|" || status=1
fi
if [ "$MODE" = spec ]; then
  for script in verification_speed cascade_speed; do
    timeout ${SPEC_LIMIT:-240} python3 benchmarks/dev/$script.py --out "$OUT/$script.md" >"$OUT/$script.log" 2>&1 ||
      status=1
    grep -E "^\||vs " "$OUT/$script.md" 2>/dev/null
  done
fi
if [ "$MODE" = fp8 ]; then
  kv_dtypes=${FP8_KV_DTYPES:-bf16 e4m3}
  decode_start=$(date +%s)
  timeout ${DECODE_LIMIT:-480} python3 benchmarks/decode.py --kv-dtype $kv_dtypes --out "$OUT/decode_fp8.md" \
    --json "$OUT/decode_fp8.json" >"$OUT/decode_fp8.log" 2>"$OUT/decode_fp8.err"
  decode_rc=$?
  [ "$decode_rc" = 0 ] || status=1
  if [ -n "${FP8_TILINGS:-}" ]; then  # the FP8 decode tilings' A/B (docs/fp8.md, "Speed")
    for cores in tensor cuda; do
      timeout ${TILINGS_LIMIT:-300} python3 benchmarks/dev/decode_tilings.py --cores $cores --kv-dtype e4m3 \
        --out "$OUT/fp8_tilings_$cores.md" 2>"$OUT/fp8_tilings_$cores.err" | grep "|" || status=1
    done
  fi
  summarize_errors || status=1
  grep "|" "$OUT/decode_fp8.md" 2>/dev/null | tail -n 40
  tests_line=
  [ "$test_rc" = skipped ] || tests_line=$(tail -n 1 "$OUT/pytest_gpu.log")
  echo
  echo "| fp8 step | result |"
  echo "|---|---|"
  echo "| gpu tests ${targets[*]} | rc=$test_rc${tests_line:+: $tests_line} |"
  echo "| decode.py --kv-dtype $kv_dtypes | rc=$decode_rc in $(( $(date +%s) - decode_start )) s:" \
    "$(grep -E '^decode benchmark:' "$OUT/decode_fp8.md" 2>/dev/null | tail -n 1) |"
  grep -E "^(e4m3|e5m2) rows at" "$OUT/decode_fp8.md" 2>/dev/null | tail -n 2
  echo "== summary: gpu tests rc=$test_rc, decode rc=$decode_rc, overall status=$status"
  exit $status
fi
if [ "$MODE" = sanitize ]; then  # the three tools at once: each is bound by its own instrumentation, not the GPU
  pids=()
  for tool in memcheck racecheck synccheck; do
    timeout ${SANITIZE_LIMIT:-240} compute-sanitizer --tool $tool --error-exitcode 1 python3 -m pytest -q -x -m gpu \
      "${targets[@]}" ${SANITIZE_K:+-k "$SANITIZE_K"} -p no:cacheprovider >"$OUT/sanitizer_$tool.log" 2>&1 &
    pids+=($!)
  done
  for i in 0 1 2; do wait ${pids[$i]} || status=1; done
  for tool in memcheck racecheck synccheck; do
    echo "$tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.log" | tail -n 1)," \
      "$(grep -E 'passed|failed' "$OUT/sanitizer_$tool.log" | tail -n 1)"
  done
fi
if [ "$MODE" = verify ]; then
  rows=()
  step() {  # step NAME COMMAND...: its log in $OUT/verify_NAME.log, its last line in the table
    local name=$1; shift
    case " ${VERIFY_STEPS:-d96 fp8fa3 compile fp8mla walk prefill96 sinks tilings} " in *" $name "*) ;; *) return 0 ;; esac
    local t0=$(date +%s) limit=${VERIFY_LIMIT:-300}
    [ "$name" = tilings ] && limit=${TILINGS_LIMIT:-480}  # six tilings of fa3, each built and checked first
    timeout $limit "$@" >"$OUT/verify_$name.log" 2>&1
    local rc=$?
    [ "$rc" = 0 ] || status=1
    rows+=("| $name | rc=$rc in $(( $(date +%s) - t0 )) s: $(grep -v '^\s*$' "$OUT/verify_$name.log" | tail -n 1) |")
    echo "${rows[-1]}"
  }
  gpu_tests=(python3 -m pytest -q --maxfail=20 --tb=short -m gpu -p no:cacheprovider)
  step d96 env FLASHJIT_TEST_HEAD_DIMS=96 "${gpu_tests[@]}" tests/test_gpu_head_dims.py
  step fp8fa3 "${gpu_tests[@]}" tests/test_gpu_fp8_fa3.py
  step compile "${gpu_tests[@]}" tests/test_gpu_fp8_compile.py
  step fp8mla env FLASHJIT_PREWARM_OPS=mla_paged "${gpu_tests[@]}" tests/test_gpu_mla_fp8.py
  step walk python3 benchmarks/dev/fa3_walk.py --out "$OUT/fa3_walk.md"
  step prefill96 python3 benchmarks/dev/head_dims_sinks.py --only prefill --prefill-head-dims 96 --rounds 3 \
    --out "$OUT/prefill96.md"
  step sinks python3 benchmarks/dev/head_dims_sinks.py --only sinks --rounds 3 --out "$OUT/sinks.md"
  for d in ${VERIFY_HEAD_DIMS:-128}; do
    step tilings python3 benchmarks/dev/fa2_tilings.py --backend fa3 --head-dim "$d" --out "$OUT/fa3_tilings_d$d.md" \
      ${VERIFY_BASELINE:+--baseline-templates $VERIFY_BASELINE}
  done
  summarize_errors || status=1
  grep -h "|\|sinks cost" "$OUT"/fa3_walk.md "$OUT"/prefill96.md "$OUT"/sinks.md "$OUT"/fa3_tilings_d*.md \
    2>/dev/null | tail -n 80
  printf '%s\n' "" "| verify step | result |" "|---|---|" "${rows[@]}"
  echo "== summary: overall status=$status"
  exit $status
fi
if [ "$MODE" = tests ] || [ "$MODE" = compare ] || [ "$MODE" = prefill ] || [ "$MODE" = mla ] || [ "$MODE" = invariant ] ||
   [ "$MODE" = spec ] || [ "$MODE" = sanitize ]; then
  summarize_errors || status=1
  echo "== summary: gpu tests rc=$test_rc, overall status=$status"
  exit $status
fi

python3 benchmarks/bench_jit.py --out "$OUT/bench_jit.md" 2>&1 | tail -8 || status=1
if [ "$MODE" = quick ]; then
  python3 benchmarks/prefill.py --quick --out "$OUT/prefill.md" 2>"$OUT/prefill.err" | tail -12 || status=1
elif [ "$MODE" = medium ] || [ "$MODE" = bench ]; then
  python3 benchmarks/prefill.py --seqlens 1024 4096 --out "$OUT/prefill.md" 2>"$OUT/prefill.err" | tail -20 || status=1
else
  python3 benchmarks/prefill.py --out "$OUT/prefill.md" 2>"$OUT/prefill.err" | tail -25 || status=1
fi
if [ "$MODE" = quick ]; then
  python3 benchmarks/decode.py --quick --out "$OUT/decode.md" --json "$OUT/decode.json" 2>"$OUT/decode.err" | tail -20 || status=1
else
  python3 benchmarks/decode.py --out "$OUT/decode.md" --json "$OUT/decode.json" 2>"$OUT/decode.err" | tail -20 || status=1
fi
summarize_errors || status=1
echo "== summary: gpu tests rc=$test_rc, overall status=$status"
exit $status
