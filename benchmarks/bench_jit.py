"""JIT costs against their targets: `import flashjit` after torch (< 50 ms, CUDA
untouched), one configuration compiled cold (< 10 s), a cached configuration
loaded and ready in a fresh process (< 50 ms), host overhead per call (< 10 us).

Usage: python benchmarks/bench_jit.py [--out results.md]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from common import emit

SPEC = "KernelSpec.make('single_decode', 'bfloat16', 128)"


def run_py(code: str, env=None) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def import_time() -> dict:
    code = ("import time, json, torch; t = time.perf_counter(); import flashjit; "
            "dt = time.perf_counter() - t; import sys; "
            "print(json.dumps({'ms': dt * 1e3, 'cuda_init': torch.cuda.is_initialized(), "
            "'jinja2': 'jinja2' in sys.modules}))")
    runs = [run_py(code) for _ in range(5)]
    return {"ms": sorted(r["ms"] for r in runs)[2], "cuda_init": any(r["cuda_init"] for r in runs),
            "jinja2_imported": any(r["jinja2"] for r in runs)}


def cold_compile(cache_dir: str) -> float:
    code = (f"import time, json; from flashjit.spec import KernelSpec; from flashjit import jit; "
            f"t = time.perf_counter(); r = jit.build_many([{SPEC}]); "
            f"print(json.dumps({{'s': time.perf_counter() - t, 'built': r[0].built}}))")
    r = run_py(code, env={**os.environ, "FLASHJIT_CACHE_DIR": cache_dir})
    assert r["built"], "expected a cold build"
    return r["s"]


def cached_load(cache_dir: str) -> float:
    code = (f"import time, json, torch; torch.cuda.init(); import flashjit; from flashjit.spec import KernelSpec; "
            f"from flashjit import jit; t = time.perf_counter(); m = jit.get_module({SPEC}); "
            f"print(json.dumps({{'ms': (time.perf_counter() - t) * 1e3}}))")
    runs = [run_py(code, env={**os.environ, "FLASHJIT_CACHE_DIR": cache_dir})["ms"] for _ in range(5)]
    return sorted(runs)[2]


def host_overhead(cache_dir: str) -> dict:
    os.environ["FLASHJIT_CACHE_DIR"] = cache_dir
    import torch

    import flashjit
    q = torch.randn(8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(16, 8, 128, device="cuda", dtype=torch.bfloat16)
    flashjit.single_decode_with_kv_cache(q, k, k)
    torch.cuda.synchronize()
    n = 2000
    t = time.perf_counter()
    for _ in range(n):
        flashjit.single_decode_with_kv_cache(q, k, k)
    per_op = (time.perf_counter() - t) / n
    torch.cuda.synchronize()
    from flashjit.ops import decode

    (prep,) = decode._prepared.values()
    out = torch.empty(prep.out_shape, device="cuda", dtype=torch.bfloat16)
    t = time.perf_counter()
    for _ in range(n):
        prep.launch(q, k, k, out, None, 1, 1, 16)
    per_launch = (time.perf_counter() - t) / n
    torch.cuda.synchronize()
    return {"op_us": per_op * 1e6, "raw_launch_us": per_launch * 1e6}


def paged_decode_host(cache_dir: str) -> dict:
    """Host time of a serving step's calls, with GPU work too small to matter:
    plan() for 64 decode requests, and run() on a 5-D paged cache."""
    os.environ["FLASHJIT_CACHE_DIR"] = cache_dir
    import torch

    import flashjit
    batch, page, qo_heads, kv_heads, dim = 64, 16, 32, 8, 128
    cache = torch.randn(batch, 2, page, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    indptr = torch.arange(batch + 1, dtype=torch.int32)
    indices = torch.arange(batch, dtype=torch.int32, device="cuda")
    last = torch.full((batch,), page, dtype=torch.int32)
    q = torch.randn(batch, qo_heads, dim, device="cuda", dtype=torch.bfloat16)
    w = flashjit.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"),
                                                    use_tensor_cores=True)
    plan = lambda: w.plan(indptr, indices, last, qo_heads, kv_heads, dim, page, q_data_type=torch.bfloat16)  # noqa: E731
    plan()
    w.run(q, cache)
    torch.cuda.synchronize()
    n = 200
    t = time.perf_counter()
    for _ in range(n):
        plan()
    per_plan = (time.perf_counter() - t) / n
    torch.cuda.synchronize()
    n = 2000
    t = time.perf_counter()
    for _ in range(n):
        w.run(q, cache)
    per_run = (time.perf_counter() - t) / n
    torch.cuda.synchronize()
    # What a compiled graph calls: the same run() through the dispatcher.
    op = torch.ops.flashjit.batch_decode_paged_run.default
    t = time.perf_counter()
    for _ in range(n):
        op(w._handle, q, cache, None, False, None)
    per_op = (time.perf_counter() - t) / n
    torch.cuda.synchronize()
    return {"plan_ms": per_plan * 1e3, "run_us": per_run * 1e6, "op_us": per_op * 1e6}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = []
    imp = import_time()
    rows.append(("import flashjit after torch", f"{imp['ms']:.1f} ms", "< 50 ms",
                 f"CUDA initialised: {imp['cuda_init']}, jinja2 imported: {imp['jinja2_imported']}"))
    with tempfile.TemporaryDirectory() as cache_dir:
        rows.append(("cold compile, one configuration", f"{cold_compile(cache_dir):.2f} s", "< 10 s",
                     "single_decode bf16 d128, this GPU's arch"))
        rows.append(("cached configuration ready (fresh process)", f"{cached_load(cache_dir):.1f} ms", "< 50 ms",
                     "render + key + manifest/sha256 check + dlopen"))
        host = host_overhead(cache_dir)
        rows.append(("host overhead per op call", f"{host['op_us']:.1f} us", "< 10 us",
                     f"single_decode_with_kv_cache incl. checks; packed params + ctypes launch {host['raw_launch_us']:.1f} us"))
        paged = paged_decode_host(cache_dir)
        rows.append(("host time of paged decode run()", f"{paged['run_us']:.1f} us", "< 10 us",
                     "64 requests x 16 keys, 32/8 heads, tensor cores, 5-D cache, eager"))
        rows.append(("host time of paged decode run() in a compiled graph", f"{paged['op_us']:.1f} us", "",
                     "torch.ops.flashjit.batch_decode_paged_run: run() plus the dispatcher round trip"))
        rows.append(("host time of paged decode plan()", f"{paged['plan_ms']:.2f} ms", "",
                     "64 requests: page-table checks, split plan, metadata upload"))
    lines = ["| measure | value | target | note |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    emit("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
