# Sourced by the GPU scripts (gpu_check.sh, dev/ncu_prefill.sh) from the
# repository root with $OUT set: flashjit from this checkout, its cache and
# parallel builds, and FlashInfer, the peer, from .whl/ when it was carried
# (benchmarks/dev/pack_flashinfer.sh).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FLASHJIT_CACHE_DIR=${FLASHJIT_CACHE_DIR:-/tmp/flashjit-cache} FLASHJIT_JOBS=${FLASHJIT_JOBS:-16}
if [ -f .whl/site.txz ] && [ ! -d .whl/site ]; then
  tar -C .whl -xJf .whl/site.txz
elif ls .whl/*.whl >/dev/null 2>&1 && [ ! -d .whl/site ]; then
  pip install -q --no-deps --target .whl/site .whl/*.whl > "$OUT/flashinfer_install.log" 2>&1 || true
fi
if [ -d .whl/site ]; then
  export PYTHONPATH=$PYTHONPATH:$PWD/.whl/site FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16
fi
