#!/usr/bin/env bash
# Packs FlashInfer (the peer in the benchmarks) for a GPU machine with no
# package registry: downloads its wheels into .whl/ (git-ignored), unpacks them,
# drops the data/csrc sources of kernels the benchmarks never build (MoE, GEMM,
# sampling; ~250 MB) and writes .whl/site.txz (~16 MB), which fits the
# device tool's 64 MiB carry limit where the two wheels (65 MB) do not.
# gpu_check.sh unpacks it into .whl/site. Carry: [".whl/site.txz"].
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
  -d .whl flashinfer-python==0.7.2.post1 apache-tvm-ffi
rm -rf .whl/site && mkdir -p .whl/site
for w in .whl/*.whl; do (cd .whl/site && unzip -q -o "../$(basename "$w")"); done
# Attention JIT sources are the files at the top of data/csrc; keep the two
# folders they include.
for d in .whl/site/flashinfer/data/csrc/*/; do
  case "$(basename "$d")" in nv_internal|generated) ;; *) rm -rf "$d" ;; esac
done
tar -C .whl -cJf .whl/site.txz site
ls -la .whl/site.txz
