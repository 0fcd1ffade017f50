"""Paged KV cache on a GPU: paged decode and prefill against float64 within
their profiles, split-KV plans, CUDA-graph replay after re-planning, the two
paths of a serving loop against each other, and bad page tables."""

from __future__ import annotations

import math

import pytest
import torch

import flashjit
from flashjit.reference import ragged_reference
from sweep import (CAUSAL, DTYPE_CORES, DTYPE_PATHS, DTYPES, HEAD_DIMS, HEADS, cores_id, path_id, path_kwargs,
                   spec_for, spec_path, variant_kwargs)
from test_gpu_attention import check, poison_allocator, randn, skip_unless_runs

pytestmark = pytest.mark.gpu

WORKSPACE_BYTES = 64 << 20


def workspace():
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")


def indptr_of(lengths) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def scatter_requests(cache, kv_lens, k, v):
    """Writes each request's packed K/V rows (k, v: NHD, requests back to back) into
    pages of `cache` ([pages, 2, page_size, heads, dim]) taken in random order, and
    returns the page table: (indptr, indices, last_page_len) as int32 CUDA tensors."""
    page_size = cache.shape[2]
    pages = [math.ceil(n / page_size) for n in kv_lens]
    order = torch.randperm(cache.shape[0], device="cuda")[:sum(pages)].to(torch.int32)
    page_indptr, kv_indptr = indptr_of(pages), indptr_of(kv_lens)
    for r, n in enumerate(kv_lens):
        pos = torch.arange(n, device="cuda")
        page = order[page_indptr[r] + pos // page_size].long()
        cache[page, 0, pos % page_size] = k[kv_indptr[r]:kv_indptr[r] + n]
        cache[page, 1, pos % page_size] = v[kv_indptr[r]:kv_indptr[r] + n]
    last = [(n - 1) % page_size + 1 if n else 0 for n in kv_lens]
    return (torch.tensor(page_indptr, dtype=torch.int32, device="cuda"), order,
            torch.tensor(last, dtype=torch.int32, device="cuda"))


class PagedBatch:
    """Requests' keys/values packed NHD (for the reference) and the same values
    scattered over the pages of a cache in random order, the other pages random."""

    def __init__(self, kv_lens, page_size, num_kv, head_dim, dtype, layout="NHD", form="5d", spare_pages=3, k=None):
        self.kv_lens, self.page_size, self.layout = list(kv_lens), page_size, layout
        self.kv_indptr = indptr_of(self.kv_lens)
        pages = [math.ceil(n / page_size) for n in self.kv_lens]
        self.num_pages = sum(pages) + spare_pages
        self.k = randn(self.kv_indptr[-1], num_kv, head_dim, dtype=dtype) if k is None else k
        self.v = randn(self.kv_indptr[-1], num_kv, head_dim, dtype=dtype)
        cache = randn(self.num_pages, 2, page_size, num_kv, head_dim, dtype=dtype)  # NHD
        self.indptr, self.indices, self.last = scatter_requests(cache, self.kv_lens, self.k, self.v)
        if layout == "HND":
            cache = cache.transpose(2, 3).contiguous()
        self.cache = cache if form == "5d" else (cache[:, 0].contiguous(), cache[:, 1].contiguous())


def decode_case(kv_lens, dtype, tensor_cores, head_dim, heads, page_size=16, layout="NHD", form="5d", plan_kw=None,
                **kw):
    num_qo, num_kv = heads
    batch = PagedBatch(kv_lens, page_size, num_kv, head_dim, dtype, layout, form)
    q = randn(len(kv_lens), num_qo, head_dim, dtype=dtype)
    wrapper = flashjit.BatchDecodeWithPagedKVCacheWrapper(workspace(), layout, use_tensor_cores=tensor_cores)
    wrapper.plan(batch.indptr, batch.indices, batch.last, num_qo, num_kv, head_dim, page_size, q_data_type=dtype,
                 **(plan_kw or {}), **{k: v for k, v in kw.items() if k != "return_lse"})
    poison_allocator()
    out, lse = wrapper.run(q, batch.cache, return_lse=True)
    torch.cuda.synchronize()
    ref, ref_lse = ragged_reference(q, batch.k, batch.v, list(range(len(kv_lens) + 1)), batch.kv_indptr,
                                    window_left=kw.get("window_left", -1), logits_soft_cap=kw.get("logits_soft_cap"))
    return wrapper, batch, q, out, lse, ref, ref_lse


DECODE_LENS = [1, 15, 16, 17, 300, 2000, 0, 77]


@pytest.mark.parametrize("variant", ["plain", "window", "softcap"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype,tensor_cores", DTYPE_CORES, ids=[cores_id(p) for p in DTYPE_CORES])
def test_batch_decode_paged(prewarmed, error_report, dtype, tensor_cores, head_dim, heads, variant):
    _, batch, q, out, lse, ref, ref_lse = decode_case(DECODE_LENS, dtype, tensor_cores, head_dim, heads,
                                                      **variant_kwargs(variant))
    spec = spec_for("batch_decode_paged", dtype, head_dim, False, variant, tensor_cores)
    check(spec, out, ref, q, batch.k, batch.v, max(DECODE_LENS), 1 / math.sqrt(head_dim), error_report,
          "batch_decode_paged", lse=lse, ref_lse=ref_lse, shape="mixed", heads=heads)
    assert (out[DECODE_LENS.index(0)] == 0).all() and torch.isneginf(lse[DECODE_LENS.index(0)]).all()


def prefill_case(qo_lens, kv_lens, dtype, path, head_dim, heads, causal, page_size=16, layout="NHD", form="5d"):
    num_qo, num_kv = heads
    batch = PagedBatch(kv_lens, page_size, num_kv, head_dim, dtype, layout, form)
    qo_indptr = indptr_of(qo_lens)
    q = randn(qo_indptr[-1], num_qo, head_dim, dtype=dtype)
    kw = path_kwargs(path)
    wrapper = flashjit.BatchPrefillWithPagedKVCacheWrapper(workspace(), layout, backend=kw["backend"])
    wrapper.plan(torch.tensor(qo_indptr, dtype=torch.int32), batch.indptr, batch.indices, batch.last, num_qo, num_kv,
                 head_dim, page_size, causal=causal, q_data_type=dtype, use_tensor_cores=kw["use_tensor_cores"])
    poison_allocator()
    out, lse = wrapper.run(q, batch.cache, return_lse=True)
    torch.cuda.synchronize()
    ref, ref_lse = ragged_reference(q, batch.k, batch.v, qo_indptr, batch.kv_indptr, causal=causal)
    return batch, q, out, lse, ref, ref_lse


PREFILL_QO = [1, 37, 128, 5, 300, 0]
PREFILL_KV = [1, 300, 128, 1000, 16, 40]


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype,path", DTYPE_PATHS, ids=[path_id(p) for p in DTYPE_PATHS])
def test_batch_prefill_paged(prewarmed, error_report, dtype, path, head_dim, causal, heads):
    skip_unless_runs(path)
    batch, q, out, lse, ref, ref_lse = prefill_case(PREFILL_QO, PREFILL_KV, dtype, path, head_dim, heads, causal)
    spec = spec_for("batch_prefill_paged", dtype, head_dim, causal, **spec_path(path))
    check(spec, out, ref, q, batch.k, batch.v, max(PREFILL_KV), 1 / math.sqrt(head_dim), error_report,
          "batch_prefill_paged", lse=lse, ref_lse=ref_lse, shape="mixed", heads=heads)


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_paged_and_ragged_prefill_identical_after_late_spikes(prewarmed, error_report, head_dim, causal, backend):
    """Keys aimed at single queries, late in their requests, make those rows' max
    jump far past the lazy-max threshold mid-sequence. Paged and ragged prefill of
    one backend take the same key steps, so they agree bit for bit, and both stay
    within the profile: fa2's paged prefill (FA2_TILINGS) and its ragged one (on
    sm_90a a wide tiling: other rows share a warp; d64's walks 128-key tiles in two
    steps) take 64-key steps; fa3's share one tiling. (fa2 d256 differs in
    rounding: its two tilings take 32- and 64-key steps.)"""
    skip_unless_runs(backend)
    dtype, (num_qo, num_kv), lens = torch.bfloat16, (8, 2), [600, 900]
    starts = indptr_of(lens)
    q = randn(starts[-1], num_qo, head_dim, dtype=dtype)
    k = randn(starts[-1], num_kv, head_dim, dtype=dtype)
    gen = torch.Generator().manual_seed(head_dim + causal)
    for start, n in zip(starts, lens):
        for _ in range(4):  # key j points along query i (head h): its logit is ~17 in log2 units, others' ~4
            i = int(torch.randint(n // 2, n, (1,), generator=gen))
            j = int(torch.randint(256, i + 1, (1,), generator=gen))
            h = int(torch.randint(num_qo, (1,), generator=gen))
            row = q[start + i, h].float()
            k[start + j, h // (num_qo // num_kv)] = (row * (12 / row.norm())).to(dtype)
    batch = PagedBatch(lens, 16, num_kv, head_dim, dtype, k=k)
    paged = flashjit.BatchPrefillWithPagedKVCacheWrapper(workspace(), backend=backend)
    paged.plan(torch.tensor(starts, dtype=torch.int32), batch.indptr, batch.indices, batch.last, num_qo, num_kv,
               head_dim, 16, causal=causal, q_data_type=dtype, use_tensor_cores=True)
    ragged = flashjit.BatchPrefillWithRaggedKVCacheWrapper(workspace(), backend=backend)
    ragged.plan(torch.tensor(starts), torch.tensor(starts), num_qo, num_kv, head_dim, causal=causal, q_data_type=dtype,
                use_tensor_cores=True)
    poison_allocator()
    out_paged, out_ragged = paged.run(q, batch.cache), ragged.run(q, batch.k, batch.v)
    ref, _ = ragged_reference(q, batch.k, batch.v, starts, starts, causal=causal)
    for op, out in [("batch_prefill_paged", out_paged), ("batch_prefill_ragged", out_ragged)]:
        check(spec_for(op, dtype, head_dim, causal, tensor_cores=True, backend=backend), out, ref, q, batch.k, batch.v,
              max(lens),
              1 / math.sqrt(head_dim), error_report, f"{op}_late_spikes")
    assert torch.equal(out_paged, out_ragged), float((out_paged.float() - out_ragged.float()).abs().max())


@pytest.mark.parametrize("form", ["5d", "tuple"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
# 3, 7: the page division without a shift; 1-32: fa3 gathers rows, 64-256: fa3 loads pages by TMA boxes (whole
# pages per tile, or a tile within a page).
@pytest.mark.parametrize("page_size", [1, 3, 7, 16, 32, 64, 256])
@pytest.mark.parametrize("op,path", [("decode", "cc"), ("decode", "tc"), ("prefill", "cc"), ("prefill", "fa2"),
                                     ("prefill", "fa3")], ids=lambda x: x)
def test_page_sizes_layouts_and_forms(prewarmed, error_report, op, path, page_size, layout, form):
    dtype, head_dim, heads = torch.bfloat16, 128, (8, 2)
    if op == "decode":
        _, batch, q, out, lse, ref, ref_lse = decode_case(DECODE_LENS, dtype, path == "tc", head_dim, heads,
                                                          page_size, layout, form)
        spec = spec_for("batch_decode_paged", dtype, head_dim, tensor_cores=path == "tc")
    else:
        skip_unless_runs(path)
        batch, q, out, lse, ref, ref_lse = prefill_case(PREFILL_QO, PREFILL_KV, dtype, path, head_dim, heads, True,
                                                        page_size, layout, form)
        spec = spec_for("batch_prefill_paged", dtype, head_dim, True, **spec_path(path))
    check(spec, out, ref, q, batch.k, batch.v, max(batch.kv_lens), 1 / math.sqrt(head_dim), error_report,
          f"paged_{op}", lse=lse, ref_lse=ref_lse, shape=f"page{page_size}_{layout}_{form}", heads=heads)


# Group sizes beside the sweep's 1, 4 and 8: the CUDA-core decode kernel
# instantiates 1, 2 and 4 rows per CTA and pads 3; 6 and 16 take two and four row tiles.
@pytest.mark.parametrize("heads", [(4, 2), (6, 2), (12, 2), (16, 1)], ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cc", "tc"])
def test_decode_group_sizes(prewarmed, error_report, tensor_cores, heads):
    dtype, head_dim = torch.bfloat16, 128
    _, batch, q, out, lse, ref, ref_lse = decode_case(DECODE_LENS, dtype, tensor_cores, head_dim, heads)
    spec = spec_for("batch_decode_paged", dtype, head_dim, tensor_cores=tensor_cores)
    check(spec, out, ref, q, batch.k, batch.v, max(DECODE_LENS), 1 / math.sqrt(head_dim), error_report,
          "batch_decode_paged", lse=lse, ref_lse=ref_lse, shape="groups", heads=heads)


# split -> (kv lengths, plan() arguments, expected chunk in keys; None: any nonzero).
# many_rows: 41 requests x 32 heads = 1312 merged rows, past the count from which
# the merge pass takes a warp per row (merge_states.cuh); the others merge a CTA per row.
SPLIT_CASES = {
    "auto": ([20000, 33001, 5], {}, None),
    "fixed": ([20000, 33001, 5], {"fixed_split_size": 40}, 40 * 16),
    "disabled": ([20000, 33001, 5], {"disable_split_kv": True}, 0),
    "many_rows": ([300] * 40 + [5], {"fixed_split_size": 8}, 8 * 16),
}


@pytest.mark.parametrize("split", list(SPLIT_CASES))
@pytest.mark.parametrize("dtype,tensor_cores", DTYPE_CORES, ids=[cores_id(p) for p in DTYPE_CORES])
def test_split_kv_decode(prewarmed, error_report, dtype, tensor_cores, split):
    """plan() splits the keys of long requests (or not, when told) and the merge pass combines them."""
    kv_lens, plan_kw, expected_chunk = SPLIT_CASES[split]
    wrapper, batch, q, out, lse, ref, ref_lse = decode_case(kv_lens, dtype, tensor_cores, 128, (32, 8),
                                                            plan_kw=plan_kw)
    chunk = wrapper._plan.work.kv_chunk
    assert (chunk == 0) == (split == "disabled"), f"kv_chunk {chunk} for split={split}"
    if expected_chunk is not None:
        assert chunk == expected_chunk
    spec = spec_for("batch_decode_paged", dtype, 128, tensor_cores=tensor_cores)
    check(spec, out, ref, q, batch.k, batch.v, max(kv_lens), 1 / math.sqrt(128), error_report, "split_kv_decode",
          lse=lse, ref_lse=ref_lse, shape=f"long_{split}", heads=(32, 8))


@pytest.mark.parametrize("dtype,path", DTYPE_PATHS, ids=[path_id(p) for p in DTYPE_PATHS])
def test_split_kv_ragged_prefill(prewarmed, error_report, dtype, path):
    """A ragged batch of two short query runs against long keys splits too."""
    skip_unless_runs(path)
    qo_lens, kv_lens = [3, 1, 20], [30000, 100, 9000]
    qo_indptr, kv_indptr = indptr_of(qo_lens), indptr_of(kv_lens)
    q = randn(qo_indptr[-1], 8, 128, dtype=dtype)
    k = randn(kv_indptr[-1], 2, 128, dtype=dtype)
    v = randn(kv_indptr[-1], 2, 128, dtype=dtype)
    wrapper = flashjit.BatchPrefillWithRaggedKVCacheWrapper(workspace(), backend=path_kwargs(path)["backend"])
    wrapper.plan(torch.tensor(qo_indptr), torch.tensor(kv_indptr), 8, 2, 128, causal=True, q_data_type=dtype,
                 use_tensor_cores=path != "cc")
    assert wrapper._plan.work.kv_chunk > 0
    poison_allocator()
    out, lse = wrapper.run(q, k, v, return_lse=True)
    ref, ref_lse = ragged_reference(q, k, v, qo_indptr, kv_indptr, causal=True)
    spec = spec_for("batch_prefill_ragged", dtype, 128, True, **spec_path(path))
    check(spec, out, ref, q, k, v, max(kv_lens), 1 / math.sqrt(128), error_report, "split_kv_ragged", lse=lse,
          ref_lse=ref_lse, shape="long_kv", heads=(8, 2))


@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cc", "tc"])
def test_cuda_graph_replays_after_replanning(prewarmed, error_report, tensor_cores):
    """Capture once; plan() new lengths (short, then long enough to split, then
    without pages for one request) within the batch size; replay; check each."""
    dtype, head_dim, (num_qo, num_kv), page_size, bsz = torch.bfloat16, 128, (16, 4), 16, 4
    num_pages = 4096
    cache = randn(num_pages, 2, page_size, num_kv, head_dim, dtype=dtype)
    page_buf = torch.zeros(num_pages, dtype=torch.int32, device="cuda")
    wrapper = flashjit.BatchDecodeWithPagedKVCacheWrapper(workspace(), use_cuda_graph=True,
                                                          use_tensor_cores=tensor_cores,
                                                          paged_kv_indices_buffer=page_buf)
    q_buf = randn(bsz, num_qo, head_dim, dtype=dtype)
    out_buf = torch.empty_like(q_buf)

    def plan(kv_lens):
        pages = [math.ceil(n / page_size) for n in kv_lens]
        indices = torch.randperm(num_pages, device="cuda")[:sum(pages)].to(torch.int32)
        last = torch.tensor([(n - 1) % page_size + 1 if n else 0 for n in kv_lens], dtype=torch.int32)
        indptr = torch.tensor(indptr_of(pages), dtype=torch.int32)
        wrapper.plan(indptr, indices, last, num_qo, num_kv, head_dim, page_size, q_data_type=dtype)
        return indices, indptr, last

    def reference(kv_lens, indices, indptr):
        k_cache, v_cache = cache[:, 0].flatten(0, 1), cache[:, 1].flatten(0, 1)
        rows = []
        for r, n in enumerate(kv_lens):
            ids = indices[int(indptr[r]):int(indptr[r + 1])].long()
            rows.append((ids[:, None] * page_size + torch.arange(page_size, device="cuda")).flatten()[:n])
        rows = torch.cat(rows)
        return ragged_reference(q_buf, k_cache[rows], v_cache[rows], list(range(bsz + 1)), indptr_of(kv_lens))

    plan([100, 7, 300, 64])
    wrapper.run(q_buf, cache, out=out_buf)  # warm-up outside the capture (loads the kernel)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q_buf, cache, out=out_buf)
    spec = spec_for("batch_decode_paged", dtype, head_dim, tensor_cores=tensor_cores)
    for kv_lens in ([100, 7, 300, 64], [30000, 1, 12000, 17], [0, 5000, 33, 1]):
        indices, indptr, _ = plan(kv_lens)
        q_buf.copy_(randn(bsz, num_qo, head_dim, dtype=dtype))
        out_buf.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = reference(kv_lens, indices, indptr)
        k_all = cache[:, 0].flatten(0, 2).view(-1, num_kv, head_dim)
        check(spec, out_buf, ref, q_buf, k_all, cache[:, 1].flatten(0, 2).view(-1, num_kv, head_dim), max(kv_lens),
              1 / math.sqrt(head_dim), error_report, "cuda_graph_replay", shape=str(kv_lens), heads=(num_qo, num_kv))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_tensor_core_against_cuda_core_decode(prewarmed, error_report, dtype):
    """The two decode paths on the same inputs: within the sum of their profiles."""
    kv_lens, heads, head_dim = [5000, 300, 17, 1], (32, 8), 128
    _, batch, q, tc, _, ref, _ = decode_case(kv_lens, dtype, True, head_dim, heads)
    wrapper = flashjit.BatchDecodeWithPagedKVCacheWrapper(workspace(), use_tensor_cores=False)
    wrapper.plan(batch.indptr, batch.indices, batch.last, *heads, head_dim, 16, q_data_type=dtype)
    cc = wrapper.run(q, batch.cache)
    bound = sum_of_profiles(dtype, head_dim, q, batch, max(kv_lens))
    record_difference(error_report, "decode_tc_vs_cc", dtype, tc, cc, ref, bound)


def sum_of_profiles(dtype, head_dim, q, batch, kv_len, op="batch_decode_paged", causal=False):
    kw = dict(q=q, k=batch.k, v=batch.v, kv_len=kv_len, sm_scale=1 / math.sqrt(head_dim))
    return (flashjit.tolerance(spec_for(op, dtype, head_dim, causal, tensor_cores=True), **kw)
            + flashjit.tolerance(spec_for(op, dtype, head_dim, causal, tensor_cores=False), **kw))


def record_difference(error_report, what, dtype, a, b, ref, bound):
    diff = (a.double() - b.double()).abs()
    ratio = float((diff / bound.bound(ref)).max())
    assert ratio <= 1.0, f"{what}: the two paths differ by {float(diff.max()):.3e}, past the sum of their bounds"
    short = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}[dtype]
    error_report.append({"config": f"{what}_{short}", "what": what, "ratio": ratio,
                         "max_err": float(diff.max()), "mean_err": float(diff.mean()), "rtol": bound.rtol,
                         "atol": bound.atol})


@pytest.mark.parametrize("path", ["cc", "fa2", "fa3"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_serving_loop_paths_agree(prewarmed, error_report, dtype, path):
    """Prompts through ragged prefill, and through append + paged prefill (both
    on `path`); then decode steps through append + paged decode (tensor cores
    unless path is cc) against ragged prefill of the whole sequence's last
    token: within the sum of the two paths' profiles."""
    skip_unless_runs(path)
    tensor_cores, backend = path != "cc", path_kwargs(path)["backend"]
    prompts, steps, heads, head_dim, page_size = [100, 37, 250], 4, (8, 2), 128, 16
    num_qo, num_kv = heads
    total = [n + steps for n in prompts]
    k_all = [randn(n, num_kv, head_dim, dtype=dtype) for n in total]
    v_all = [randn(n, num_kv, head_dim, dtype=dtype) for n in total]
    q_all = [randn(n, num_qo, head_dim, dtype=dtype) for n in total]
    pages = [math.ceil(n / page_size) for n in total]
    cache = torch.zeros(sum(pages) + 2, 2, page_size, num_kv, head_dim, dtype=dtype, device="cuda")
    indices = torch.randperm(cache.shape[0], device="cuda")[:sum(pages)].to(torch.int32)
    indptr_full = indptr_of(pages)

    def table(lengths):
        used = [math.ceil(n / page_size) for n in lengths]
        ids = torch.cat([indices[indptr_full[r]:indptr_full[r] + used[r]] for r in range(len(lengths))])
        last = torch.tensor([(n - 1) % page_size + 1 for n in lengths], dtype=torch.int32, device="cuda")
        return torch.tensor(indptr_of(used), dtype=torch.int32, device="cuda"), ids, last

    def append(lengths_before, new):
        nnz = sum(new)
        batch_idx = torch.cat([torch.full((n,), r, dtype=torch.int32) for r, n in enumerate(new)]).cuda()
        pos = torch.cat([torch.arange(b, b + n, dtype=torch.int32) for b, n in zip(lengths_before, new)]).cuda()
        ks = torch.cat([k_all[r][b:b + n] for r, (b, n) in enumerate(zip(lengths_before, new))])
        vs = torch.cat([v_all[r][b:b + n] for r, (b, n) in enumerate(zip(lengths_before, new))])
        indptr, ids, last = table([b + n for b, n in zip(lengths_before, new)])
        flashjit.append_paged_kv_cache(ks, vs, batch_idx, pos, cache, ids, indptr, last)
        assert nnz == ks.shape[0]

    def ragged(qo_lens, kv_lens, qs):
        k = torch.cat([k_all[r][:n] for r, n in enumerate(kv_lens)])
        v = torch.cat([v_all[r][:n] for r, n in enumerate(kv_lens)])
        w = flashjit.BatchPrefillWithRaggedKVCacheWrapper(workspace(), backend=backend)
        w.plan(torch.tensor(indptr_of(qo_lens)), torch.tensor(indptr_of(kv_lens)), num_qo, num_kv, head_dim,
               causal=True, q_data_type=dtype, use_tensor_cores=tensor_cores)
        return w.run(qs, k, v), k, v

    append([0] * len(prompts), prompts)
    q = torch.cat([q_all[r][:n] for r, n in enumerate(prompts)])
    paged = flashjit.BatchPrefillWithPagedKVCacheWrapper(workspace(), backend=backend)
    paged.plan(torch.tensor(indptr_of(prompts), dtype=torch.int32), *table(prompts), num_qo, num_kv, head_dim,
               page_size, causal=True, q_data_type=dtype, use_tensor_cores=tensor_cores)
    out_paged = paged.run(q, cache)
    out_ragged, k, v = ragged(prompts, prompts, q)
    ref, _ = ragged_reference(q, k, v, indptr_of(prompts), indptr_of(prompts), causal=True)
    op = "batch_prefill_paged"
    one = flashjit.tolerance(spec_for(op, dtype, head_dim, True, **spec_path(path)), q=q, k=k, v=v,
                             kv_len=max(prompts), sm_scale=1 / math.sqrt(head_dim))
    bound = one + one
    record_difference(error_report, f"prefill_paged_vs_ragged_{path}", dtype, out_paged,
                      out_ragged, ref, bound)

    decode = flashjit.BatchDecodeWithPagedKVCacheWrapper(workspace(), use_tensor_cores=tensor_cores)
    lengths = list(prompts)
    for _ in range(steps):
        append(lengths, [1] * len(lengths))
        lengths = [n + 1 for n in lengths]
        decode.plan(*table(lengths), num_qo, num_kv, head_dim, page_size, q_data_type=dtype)
        q = torch.stack([q_all[r][n - 1] for r, n in enumerate(lengths)])
        out_decode = decode.run(q, cache)
        out_ragged, k, v = ragged([1] * len(lengths), lengths, q)
        ref, _ = ragged_reference(q, k, v, indptr_of([1] * len(lengths)), indptr_of(lengths), causal=True)
        kw = dict(q=q, k=k, v=v, kv_len=max(lengths), sm_scale=1 / math.sqrt(head_dim))
        bound = (flashjit.tolerance(spec_for("batch_decode_paged", dtype, head_dim, tensor_cores=tensor_cores), **kw)
                 + flashjit.tolerance(spec_for("batch_prefill_ragged", dtype, head_dim, True, **spec_path(path)),
                                      **kw))
        record_difference(error_report, f"decode_paged_vs_ragged_{path}", dtype,
                          out_decode, out_ragged, ref, bound)


def test_bad_page_tables(prewarmed):
    """What plan() can see is its ValueError; a page id past the cache is run()'s."""
    batch = PagedBatch([20, 40], 16, 2, 128, torch.float16)
    w = flashjit.BatchDecodeWithPagedKVCacheWrapper(workspace())
    args = dict(num_qo_heads=4, num_kv_heads=2, head_dim=128, page_size=16, q_data_type=torch.float16)
    cases = [
        (dict(indptr=torch.tensor([0, 3, 2], dtype=torch.int32)), r"^indptr: expected non-decreasing"),
        (dict(last_page_len=torch.tensor([0, 8], dtype=torch.int32)), r"^last_page_len: expected 1\.\.16"),
        (dict(last_page_len=torch.tensor([4, 17], dtype=torch.int32)), r"^last_page_len: expected 1\.\.16"),
        (dict(last_page_len=torch.tensor([4], dtype=torch.int32)), r"^last_page_len: expected 2 elements"),
        (dict(indices=batch.indices[:3]), r"^indices: expected at least 5 elements"),
        (dict(indices=batch.indices.long()), r"^indices: expected a 1-D int32"),
        (dict(indices=batch.indices - 100), r"^indices: expected page ids >= 0"),
    ]
    for change, match in cases:
        with pytest.raises(ValueError, match=match):
            w.plan(**{"indptr": batch.indptr, "indices": batch.indices, "last_page_len": batch.last, **args,
                      **change})
    w.plan(batch.indptr, batch.indices + batch.num_pages, batch.last, **args)
    q = randn(2, 4, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"^indices: page id \d+ is past the cache's \d+ pages"):
        w.run(q, batch.cache)
    w.plan(batch.indptr, batch.indices, batch.last, **args)
    with pytest.raises(ValueError, match=r"^paged_kv_cache: expected page_size 16"):
        w.run(q, batch.cache[:, :, :8])
    with pytest.raises(ValueError, match=r"^q: expected dtype"):
        w.run(q.bfloat16(), batch.cache)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_single_decode_with_tensor_cores(prewarmed, error_report, dtype):
    """use_tensor_cores=True packs the group's heads as MMA rows; fp32 asks for CUDA cores."""
    q = randn(32, 128, dtype=dtype)
    k = randn(9000, 8, 128, dtype=dtype)
    v = randn(9000, 8, 128, dtype=dtype)
    if dtype == torch.float32:
        with pytest.raises(ValueError, match="Nearest working choice"):
            flashjit.single_decode_with_kv_cache(q, k, v, use_tensor_cores=True)
        return
    out = flashjit.single_decode_with_kv_cache(q, k, v, use_tensor_cores=True)
    ref, _ = ragged_reference(q[None], k, v, [0, 1], [0, 9000])
    spec = spec_for("single_decode", dtype, 128, tensor_cores=True)
    check(spec, out, ref[0], q, k, v, 9000, 1 / math.sqrt(128), error_report, "single_decode_tc", shape="1x9000",
          heads=(32, 8))
