"""JIT costs against their targets: `import flashjit` after torch (< 50 ms, CUDA
untouched), one configuration compiled cold (< 10 s), a cached configuration
loaded and ready in a fresh process (< 50 ms), the host time of a call of every
op and wrapper run() (< 10 us: flashjit.bench.host, the rows of `flashjit bench
--only host`, each the median of 3 rounds of the mean of 3000 calls with tiny
inputs), the part of it that the C entry point alone takes, and plan().

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


def launch_alone() -> float:
    """Mean us per call of single decode's C entry point alone, its params packed
    beforehand: the ctypes call and what the library does around the driver's
    launch, the floor under every host row."""
    import torch

    from flashjit import jit
    from flashjit.bench import host
    from flashjit.loader import LAUNCH_HEAD
    from flashjit.ops._launch import make_params, select_spec

    q = torch.randn(8, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(q)
    spec = select_spec("single_decode", torch.bfloat16, 128, backend="auto", use_tensor_cores=False, causal=False,
                       window=False, soft_cap=False, return_lse=False)
    p = make_params(q, k, v, (8 * 128, 128), 8, "NHD", 128 ** -0.5, -1, 0.0)
    p.q, p.k, p.v, p.o = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
    p.num_work, p.qo_len, p.kv_len, p.num_splits = 1, 1, 16, 1
    launcher = jit.get_module(spec).launcher
    block = LAUNCH_HEAD.pack(torch.cuda.current_stream().cuda_stream) + bytes(p)
    return host.measure(lambda: launcher(block), sync=torch.cuda.synchronize)[0]


def stream_and_device() -> float:
    """Mean us of what every call reads anew: torch's current device and its raw current stream."""
    import torch

    from flashjit.bench import host
    from flashjit.ops import _calls

    device, stream = _calls._current_device, _calls._raw_stream
    return host.measure(lambda: stream(device()), sync=torch.cuda.synchronize)[0]


def plan_ms() -> float:
    """Host time of plan() for 64 decode requests (page-table checks, split plan, metadata upload)."""
    import torch

    import flashjit
    batch, page, qo_heads, kv_heads, dim = 64, 16, 32, 8, 128
    indptr = torch.arange(batch + 1, dtype=torch.int32)
    indices = torch.arange(batch, dtype=torch.int32, device="cuda")
    last = torch.full((batch,), page, dtype=torch.int32)
    w = flashjit.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"),
                                                    use_tensor_cores=True)
    plan = lambda: w.plan(indptr, indices, last, qo_heads, kv_heads, dim, page, q_data_type=torch.bfloat16)  # noqa: E731
    plan()
    torch.cuda.synchronize()
    n = 200
    t = time.perf_counter()
    for _ in range(n):
        plan()
    per_plan = (time.perf_counter() - t) / n
    torch.cuda.synchronize()
    return per_plan * 1e3


def host_rows(cache_dir: str) -> list[tuple]:
    os.environ["FLASHJIT_CACHE_DIR"] = cache_dir
    from flashjit import jit
    from flashjit.bench import host

    jit.build_many(host.specs())  # in parallel, before the first call of each case would build it alone
    section = host.run()
    rows = [(f"host time per call: {row['op']}", f"{row['us']:.1f} us", "< 10 us", row["note"])
            for row in section["rows"]]
    rows.append(("C entry point alone", f"{launch_alone():.1f} us", "",
                 "single_decode's launch through ctypes, params packed beforehand: the floor under the rows above"))
    rows.append(("current device and stream", f"{stream_and_device() * 1e3:.0f} ns", "",
                 "torch's raw getters, read on every call (not cached: nothing cheaper tells when they change)"))
    rows.append(("host time of paged decode plan()", f"{plan_ms():.2f} ms", "",
                 "64 requests: page-table checks, split plan, metadata upload"))
    return rows


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
        rows += host_rows(cache_dir)
    lines = ["| measure | value | target | note |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    emit("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
