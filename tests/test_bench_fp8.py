"""The paged-decode benchmark's FP8 KV caches without a GPU: --kv-dtype on
`flashjit bench` and benchmarks/decode.py, the per-tensor quantisation and the
reference over the dequantised cache on CPU tensors, the cell labels, which
flashjit errors are skipped cells and which are failures (decode_row on the CPU
with stand-in libraries), the configurations bench builds first, and the
tables with their FP8/bf16 speed ratios."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from flashjit import cli, spec
from flashjit.bench import decode, decode_fp8, report
from helpers_cache import REPO, subprocess_env


def parse(*argv):
    return cli.build_parser().parse_args(["bench", *argv])


def test_kv_dtype_argument_spellings():
    assert parse().kv_dtype is None and decode_fp8.kv_dtypes_of(None) == ("bf16",)
    args = parse("--kv-dtype", "bf16", "e4m3", "fp8_e5m2", "float8_e4m3fn", "bfloat16")
    assert args.kv_dtype == ["bf16", "e4m3", "e5m2", "e4m3", "bf16"]
    assert decode_fp8.kv_dtypes_of(args.kv_dtype) == ("bf16", "e4m3", "e5m2")


@pytest.mark.parametrize("value,words", [("fp16", "queries are bf16"), ("float8_e4m3fnuz", "another platform"),
                                         ("int8", "expected one of")])
def test_bad_kv_dtype_exits_2(value, words, capsys):
    with pytest.raises(SystemExit) as exc:
        parse("--kv-dtype", value)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "flashjit bench: error:" in err and "--kv-dtype" in err and words in err


def test_decode_script_takes_kv_dtype(tmp_path):
    """benchmarks/decode.py: --kv-dtype in its help; a KV dtype it cannot run is refused before any GPU work."""
    env = subprocess_env(tmp_path / "cache", CUDA_VISIBLE_DEVICES="")
    script = str(REPO / "benchmarks" / "decode.py")
    shown = subprocess.run([sys.executable, script, "--help"], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=120)
    assert shown.returncode == 0 and "--kv-dtype" in shown.stdout and "e4m3" in shown.stdout, shown.stderr
    refused = subprocess.run([sys.executable, script, "--kv-dtype", "bf16", "fp16"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "queries are bf16" in refused.stderr, refused.stderr


def test_labels():
    assert decode_fp8.impl_label("flashjit", False, "bf16") == "flashjit tc=False"
    assert decode_fp8.impl_label("flashinfer", True, "e4m3") == "flashinfer tc=True e4m3"
    assert decode_fp8.impl_labels(["flashjit", "flashinfer"], ("bf16", "e5m2")) == [
        "flashjit tc=False", "flashjit tc=True", "flashinfer tc=False", "flashinfer tc=True",
        "flashjit tc=False e5m2", "flashjit tc=True e5m2", "flashinfer tc=False e5m2", "flashinfer tc=True e5m2"]
    assert decode_fp8.canonical_of("e4m3") == "float8_e4m3fn" and decode_fp8.torch_dtype("e5m2") is torch.float8_e5m2


@pytest.mark.parametrize("kv,fmax,mantissa_bits,smallest", [("e4m3", 448.0, 3, 2.0**-9), ("e5m2", 57344.0, 2, 2.0**-16)])
def test_quantise_per_tensor(kv, fmax, mantissa_bits, smallest):
    torch.manual_seed(0)
    x = torch.randn(64, 2, 16, 4, 128, dtype=torch.bfloat16) * 3
    codes, scale = decode_fp8.quantise(x, kv)
    assert codes.dtype == decode_fp8.torch_dtype(kv) and codes.shape == x.shape
    amax = x.abs().amax().item()
    assert scale == torch.tensor(amax / fmax, dtype=torch.float32).item()  # held as a float32
    values = codes.float()
    assert torch.isfinite(values).all() and values.abs().max().item() == fmax  # amax lands on the largest code
    back = decode_fp8.dequantise(codes, scale)
    # Round to nearest: half an ulp relative, or half the smallest subnormal step near zero.
    bound = (2.0 ** -(mantissa_bits + 1) * x.float().abs() + smallest / 2 * scale) * (1 + 2.0**-16)
    assert ((back - x.float()).abs() <= bound).all()
    assert (back - x.float()).abs().max() > 0  # quantised, not copied


@pytest.mark.parametrize("kv,fmax", [("e4m3", 448.0), ("e5m2", 57344.0)])
def test_quantise_saturates_and_keeps_zero(kv, fmax):
    codes, scale = decode_fp8.quantise(torch.zeros(3, 5), kv)
    assert scale == 1.0 and not codes.float().any()
    # The float32 scale can leave amax / scale a hair past the largest code: it lands on that code.
    for i in range(1, 5000):
        x = torch.tensor([1 + i / 997, -(1 + i / 997), 0.25])
        if (x[0] / decode_fp8.per_tensor_scale(x, kv)).item() > fmax:
            break
    else:
        pytest.fail("no amax with amax / scale past the largest code")
    assert decode_fp8.quantise(x, kv)[0].float().tolist()[:2] == [fmax, -fmax]


def test_reference_reads_the_dequantised_cache():
    torch.manual_seed(1)
    cache, _, indices, _ = decode.paged_cache(3, 40, 2, device="cpu")
    q = torch.randn(3, 4, decode.D, dtype=torch.bfloat16)
    codes, scale = decode_fp8.quantise(cache, "e4m3")
    fp8_ref = decode.reference(q, codes, indices, 40, scale)
    assert torch.equal(fp8_ref, decode.reference(q, decode_fp8.dequantise(codes, scale), indices, 40))
    assert not torch.equal(fp8_ref, decode.reference(q, cache, indices, 40))
    with pytest.raises(ValueError, match="scale"):
        decode.reference(q, codes, indices, 40)


def test_not_generated_is_told_apart():
    with pytest.raises(ValueError) as exc:
        spec.KernelSpec.make("single_prefill", "bfloat16", 128, dtype_kv="e4m3", use_tensor_cores=False).validate()
    assert decode_fp8.is_not_generated(exc.value)
    assert not decode_fp8.is_not_generated(ValueError("k_scale: expected a finite positive number"))
    assert not decode_fp8.is_not_generated(RuntimeError("an FP8 KV cache is not yet generated"))


class StandIn:
    """A library whose paged decode returns the float32 reference over the cache
    it is given, rounded to bf16 (a correct kernel), or raises `fails[tc]`."""

    def __init__(self, fails=None, wrong=False):
        self.fails, self.wrong, self.calls = fails or {}, wrong, []
        outer = self

        class Wrapper:
            def __init__(self, workspace, kv_layout, use_cuda_graph, use_tensor_cores):
                self.tc = use_tensor_cores

            def plan(self, indptr, indices, last, qo_heads, kv_heads, head_dim, page, q_data_type, kv_data_type):
                if (self.tc, kv_data_type) in outer.fails:
                    raise outer.fails[self.tc, kv_data_type]
                self.indices, self.kv_len = indices, int((indptr[1] - 1) * page + last[0])

            def run(self, q, cache, k_scale=None, v_scale=None):
                outer.calls.append((self.tc, cache.dtype, k_scale, v_scale))
                out = decode.reference(q, cache, self.indices, self.kv_len, k_scale).to(torch.bfloat16)
                return -out if outer.wrong else out

        self.BatchDecodeWithPagedKVCacheWrapper = Wrapper


def test_decode_row_skips_what_is_not_generated_and_fails_the_rest(monkeypatch):
    monkeypatch.setattr(decode, "DEVICE", "cpu")
    monkeypatch.setattr(decode, "time_us", lambda fn, reps: (fn(), (100.0, "graph", 4))[1])
    e4m3 = torch.float8_e4m3fn
    not_generated = ValueError("unsupported configuration x: an FP8 KV cache for tensor-core y is not yet generated")
    libs = {"flashjit": StandIn({(True, e4m3): not_generated, (False, torch.float8_e5m2): ValueError("k_scale: bad")}),
            "flashinfer": StandIn({(False, e4m3): RuntimeError("no kernel")})}
    results = {"read_gbps": 4000.0, "copy_gbps": 3000.0, "decode": [], "skipped": []}
    failures = []
    decode.decode_row(libs, {"flashjit": None, "flashinfer": None}, ("tiny 2x40 4/2", 2, 40, 4, 2), 3, results,
                      failures, ("bf16", "e4m3", "e5m2"))
    recs = {rec["impl"]: rec for rec in results["decode"]}
    assert list(recs) == decode_fp8.impl_labels(libs, ("bf16", "e4m3", "e5m2"))
    assert recs["flashjit tc=True e4m3"]["ok"] is None and "not yet generated" in recs["flashjit tc=True e4m3"]["skipped"]
    assert results["skipped"] == ["flashjit tc=True e4m3 tiny 2x40 4/2"]
    assert failures == ["flashjit tc=False e5m2 tiny 2x40 4/2: error: ValueError: k_scale: bad"]
    assert recs["flashinfer tc=False e4m3"]["error"] == "RuntimeError: no kernel"  # a peer's error fails nothing
    bf16, fp8 = recs["flashjit tc=False"], recs["flashjit tc=False e4m3"]
    assert bf16["ok"] and bf16["bytes"] == 2 * 40 * 2 * 128 * 2 * 2 and bf16["frac_read"] == bf16["gbps"] / 4000
    assert "frac_copy" not in bf16 and "scale" not in bf16
    assert fp8["ok"] and fp8["bytes"] == bf16["bytes"] // 2 and fp8["gbps"] == fp8["bytes"] / 100.0 / 1e3
    assert fp8["frac_copy"] == fp8["gbps"] / 3000 and fp8["frac_read"] == fp8["gbps"] / 4000
    # FP8 runs pass the cache's dtype and its scale as k_scale and v_scale; bf16 runs pass none.
    calls, e5m2_scale = libs["flashinfer"].calls, recs["flashinfer tc=True e5m2"]["scale"]
    assert (False, torch.bfloat16, None, None) in calls and (True, e4m3, fp8["scale"], fp8["scale"]) in calls
    assert (True, torch.float8_e5m2, e5m2_scale, e5m2_scale) in calls and e5m2_scale != fp8["scale"]


def test_decode_row_mismatch_is_a_failure(monkeypatch):
    monkeypatch.setattr(decode, "DEVICE", "cpu")
    monkeypatch.setattr(decode, "time_us", lambda fn, reps: (100.0, "graph", 4))
    results, failures = {"read_gbps": 4000.0, "copy_gbps": 3000.0, "decode": [], "skipped": []}, []
    decode.decode_row({"flashjit": StandIn(wrong=True)}, {"flashjit": None}, ("tiny 1x17 2/1", 1, 17, 2, 1), 3,
                      results, failures, ("e4m3",))
    assert [f.split(":")[0] for f in failures] == ["flashjit tc=False e4m3 tiny 1x17 2/1",
                                                   "flashjit tc=True e4m3 tiny 1x17 2/1"]
    assert all(f.split(": ", 1)[1].startswith("FAIL max err") for f in failures) and not results["skipped"]


def test_prebuilt_fp8_specs_are_what_prewarm_selects(monkeypatch):
    args = cli.build_parser().parse_args(["prewarm", "--op", "batch_decode_paged", "--dtype", "bf16", "--kv-dtype",
                                          "e4m3", "--head-dim", "128", "--tensor-cores", "both", "--arch", "sm_90a"])
    fp8 = set(cli.specs_from_args(args))
    plan = decode.rows(quick=True)
    assert fp8 and set(decode.specs(plan, ("bf16", "e4m3"))) == set(decode.specs(plan)) | fp8
    # A family not generated yet is left out of the build (its cells are skipped), not an error.
    monkeypatch.setattr(spec, "FP8_KV_FAMILIES", tuple(f for f in spec.FP8_KV_FAMILIES if f[0] != "batch_decode_paged"))
    assert decode.specs(plan, ("e4m3",)) == []
    assert len(decode.specs(plan, ("bf16",))) == 2


def fp8_section() -> dict:
    base = {"row": "GQA 64x4k 32/8", "batch": 64, "kv_len": 4096, "qo_heads": 32, "kv_heads": 8}
    timed = {"ok": True, "max_err": 1e-3, "rel_err": 1e-4, "mode": "graph", "inner": 13}

    def rec(lib, tc, kv, **fields):
        nbytes = 1 << (29 if kv == "bf16" else 28)
        return dict(base, impl=decode_fp8.impl_label(lib, tc, kv), lib=lib, tensor_cores=tc, kv_dtype=kv,
                    bytes=nbytes, **fields)

    records = [rec("flashjit", False, "bf16", us=150.0, gbps=3579.1, frac_read=0.8134, **timed),
               rec("flashjit", True, "bf16", us=140.0, gbps=3834.8, frac_read=0.8715, **timed),
               rec("flashinfer", False, "bf16", us=160.0, gbps=3355.4, frac_read=0.7626, **timed),
               rec("flashinfer", True, "bf16", error="RuntimeError: boom"),
               rec("flashjit", False, "e4m3", us=80.0, gbps=3355.4, frac_copy=0.951, frac_read=0.7626, scale=0.01,
                   **timed),
               rec("flashjit", True, "e4m3", ok=None, skipped="ValueError: ... not yet generated"),
               rec("flashinfer", False, "e4m3", us=100.0, gbps=2684.4, frac_copy=0.7611, frac_read=0.61, **timed),
               rec("flashinfer", True, "e4m3", us=90.0, gbps=2982.6, frac_copy=0.8456, frac_read=0.68, mode="eager",
                   ok=True)]
    return {"kind": "decode", "gpu": "NVIDIA H100 80GB HBM3", "date": "2026-12-01T10:00:00", "commit": "abc1234",
            "torch": "2.13.0", "flashinfer": "0.7.2", "reps": 50, "libs": ["flashjit", "flashinfer"],
            "kv_dtypes": ["bf16", "e4m3"], "impls": decode_fp8.impl_labels(["flashjit", "flashinfer"], ("bf16", "e4m3")),
            "read_gbps": 4400.0, "read_method": "amax(int64 view)", "read_all_gbps": {"amax(int64 view)": 4400.0},
            "copy_gbps": 3527.0, "spec_gbps": 3352.3, "decode": records, "append": [], "failures": [],
            "skipped": ["flashjit tc=True e4m3 GQA 64x4k 32/8"]}


def test_speed_ratios():
    ratios = decode_fp8.speed_ratios(fp8_section())
    assert [(r["kv_dtype"], r["impl"], round(r["ratio"], 4)) for r in ratios] == [
        ("e4m3", "flashjit tc=False", 1.875), ("e4m3", "flashinfer tc=False", 1.6)]
    assert decode_fp8.speed_ratios(fp8_section(), row="another row") == []
    assert decode_fp8.speed_ratios({"libs": ["flashjit"], "decode": []}) == []  # a section from before FP8


def test_fp8_decode_table():
    section = fp8_section()
    lines = report.decode_table(section).splitlines()
    assert lines[0] == ("## Paged decode, bf16 queries, KV cache bf16 / e4m3, head_dim 128, page 16, NHD, "
                        "random page order")
    assert "FP8 rows (e4m3; " in lines[4] and "% of copy bandwidth (target >= 90%)" in lines[4]
    assert lines[6:8] == ["| row (B x kv_len, qo/kv heads) | KV | K+V MiB | flashjit tc=False | flashjit tc=True | "
                          "flashinfer tc=False | flashinfer tc=True |", "|---|---|---|---|---|---|---|"]
    assert lines[8:10] == [
        "| GQA 64x4k 32/8 | bf16 | 512 | 150.0 · 3579 · 81% | 140.0 · 3835 · 87% | 160.0 · 3355 · 76% | "
        "error: RuntimeError: boom |",
        "| GQA 64x4k 32/8 | e4m3 | 256 | 80.0 · 3355 · 95% of copy | skipped: not yet generated | "
        "100.0 · 2684 · 76% of copy | 90.0 · 2983 · 85% of copy (eager) |"]
    assert "FP8 / bf16 requests per second on GQA 64x4k 32/8 (bf16 µs / FP8 µs; target >= 1.8x)" in lines
    assert "| e4m3 | 1.88x | n/a | 1.60x | n/a |" in lines
    assert ("e4m3 rows at >= 90% of copy bandwidth (of those timed): flashjit tc=False 1/1, flashjit tc=True 0/0 of 1, "
            "flashinfer tc=False 0/1, flashinfer tc=True 0/1") in lines
    assert lines[-2:] == ["skipped (not yet generated): flashjit tc=True e4m3 GQA 64x4k 32/8",
                          "decode benchmark: 0 flashjit failure(s), 1 skipped cell(s) (not yet generated)"]
    # Rows as benchmarks/decode.py prints them while they come: both KV dtypes of the row.
    assert report.decode_row_line(section, "GQA 64x4k 32/8").splitlines() == lines[8:10]
    assert report.plot_series({"meta": {}, "sections": {"decode": section}})[0][2]["flashjit tc=False e4m3"] == [3355.4]


def test_bf16_table_keeps_its_layout():
    """Without FP8 KV dtypes (the default, and JSON from before them) the table is the one it always was."""
    section = fp8_section()
    section.update(kv_dtypes=["bf16"], impls=decode_fp8.impl_labels(section["libs"], ("bf16",)), skipped=[],
                   decode=[r for r in section["decode"] if r["kv_dtype"] == "bf16"])
    lines = report.decode_table(section).splitlines()
    assert lines[0] == "## Paged decode, bf16, head_dim 128, page 16, NHD, random page order"
    assert lines[6] == ("| row (B x kv_len, qo/kv heads) | K+V MiB | flashjit tc=False | flashjit tc=True | "
                        "flashinfer tc=False | flashinfer tc=True |")
    assert lines[8].startswith("| GQA 64x4k 32/8 | 512 | 150.0 · 3579 · 81% |")
    assert not any("FP8" in line or "skipped" in line for line in lines)
    assert lines[-1] == "decode benchmark: 0 flashjit failure(s)"
