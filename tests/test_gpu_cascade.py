"""MultiLevelCascadeAttentionWrapper on a GPU: 2 and 3 levels (a prefix shared by
the batch, prefixes shared by groups, each request's own pages), decode and
chunks of 4 query tokens, fp16 and bf16, head_dim 64 and 128, causal on the last
level. Its output against float64 attention over each request's concatenated
pages within the cascade's bound, and against BatchPrefillWithPagedKVCacheWrapper
over the same concatenated pages within the sum of the two bounds; CUDA-graph
replay after re-planning against eager runs."""

from __future__ import annotations

import math

import pytest
import torch

import flashjit
from flashjit.error_model import U32, Tolerance, evaluate_lse, measure, profile
from flashjit.reference import ragged_reference
from flashjit.spec import DTYPES
from test_gpu_attention import poison_allocator, randn
from test_gpu_paged import indptr_of, workspace

pytestmark = pytest.mark.gpu

PAGE, HEADS = 16, (8, 2)
SHARED_PAGES = 40                # level 0: 640 keys every request attends to
GROUPS, GROUP_PAGES = [2, 1, 3], [3, 0, 5]  # 3 levels: requests per group, whole pages of each group's prefix


def own_lengths(qo_len: int) -> list[int]:
    """Each request's own keys: partial and full last pages; none at all for decode
    (its last level is empty); causal chunks need at least qo_len own keys, so that
    no query token sees only part of a shared level (see flashjit/ops/cascade.py)."""
    return [qo_len - 1 if qo_len == 1 else qo_len, qo_len + 1, 15, 16, 17, 100]


class CascadeCase:
    """Page tables of the levels over one cache, and each request's concatenated
    page table (shared pages, its group's pages, its own) for the plain wrapper
    and the reference; pages drawn in random order from the cache."""

    def __init__(self, cache, num_levels: int, qo_len: int, own_lens: list[int]):
        self.cache, self.qo_len = cache, qo_len
        batch = len(own_lens)
        self.qo_lens = [qo_len] * batch
        pool = iter(torch.randperm(cache.shape[0]).tolist())

        def take(n: int) -> list[int]:
            return [next(pool) for _ in range(n)]

        shared = take(SHARED_PAGES)
        groups = [g for g, n in enumerate(GROUPS) for _ in range(n)] if num_levels == 3 else [None] * batch
        group_pages = [take(n) for n in GROUP_PAGES] if num_levels == 3 else []
        own = [take(math.ceil(n / PAGE)) for n in own_lens]
        tokens = qo_len * batch
        tables = [([tokens], [shared], [PAGE * SHARED_PAGES])]
        if num_levels == 3:
            tables.append(([qo_len * n for n in GROUPS], group_pages, [PAGE * n for n in GROUP_PAGES]))
        tables.append((self.qo_lens, own, own_lens))
        self.level_kv_lens = [max(lens) for _, _, lens in tables]
        self.qo_arr, self.kv_arr, self.indices_arr, self.last_arr = [], [], [], []
        for qo, pages, lens in tables:
            self.qo_arr.append(torch.tensor(indptr_of(qo), dtype=torch.int32))  # on the host, as vLLM passes it
            self.kv_arr.append(torch.tensor(indptr_of([len(p) for p in pages]), dtype=torch.int32, device="cuda"))
            self.indices_arr.append(torch.tensor([i for p in pages for i in p], dtype=torch.int32, device="cuda"))
            self.last_arr.append(torch.tensor([(n - 1) % PAGE + 1 if n else 1 for n in lens], dtype=torch.int32,
                                              device="cuda"))
        # The same keys as one paged batch: each request's pages in level order.
        pages = [shared + (group_pages[g] if g is not None else []) + own[r] for r, g in enumerate(groups)]
        self.kv_lens = [PAGE * (len(p) - len(o)) + n for p, o, n in zip(pages, own, own_lens)]
        self.indptr = torch.tensor(indptr_of([len(p) for p in pages]), dtype=torch.int32, device="cuda")
        self.indices = torch.tensor([i for p in pages for i in p], dtype=torch.int32, device="cuda")
        self.last = torch.tensor([(n - 1) % PAGE + 1 for n in self.kv_lens], dtype=torch.int32, device="cuda")
        rows = [(torch.tensor(p, device="cuda")[:, None] * PAGE + torch.arange(PAGE, device="cuda")).flatten()[:n]
                for p, n in zip(pages, self.kv_lens)]
        rows = torch.cat(rows)
        self.k = cache[:, 0].flatten(0, 1)[rows]
        self.v = cache[:, 1].flatten(0, 1)[rows]

    def plan_args(self):
        return self.qo_arr, self.kv_arr, self.indices_arr, self.last_arr

    def reference(self, q, causal: bool):
        return ragged_reference(q, self.k, self.v, indptr_of(self.qo_lens), indptr_of(self.kv_lens), causal=causal)[0]


def new_cache(dtype, head_dim: int, num_pages: int = 400):
    return randn(num_pages, 2, PAGE, HEADS[1], head_dim, dtype=dtype)


def cascade_bound(wrapper, case: CascadeCase, q) -> Tolerance:
    """What the cascade's output meets against float64 attention over the
    concatenated keys. Level l returns o_l within its profile (atol_l + rtol_l|o_l|,
    |o_l| <= max|v|) and an LSE within delta_l; the merge weighs o_l by w_l from
    the LSEs in float32 and rounds the sum to the output dtype. So
    |out - ref| <= u_out|ref|                       (the merged output's rounding)
                 + max_l atol_l + max_l rtol_l max|v|  (the levels' errors, weights summing to 1)
                 + 2.1 ln2 max_l delta_l max|v|      (weights from perturbed LSEs: |w^_l - w_l| <= w_l (2^(2 delta) - 1))
                 + 16 u32 max|v|                     (exp2, sums and the division of the float32 merge);
    the levels' bounds are summed here, which covers max_l atol_l."""
    sm_scale = 1 / math.sqrt(q.shape[-1])
    v_absmax, logit_absmax = measure(q, case.k, case.v, sm_scale)
    levels, deltas, rtols = Tolerance(0.0, 0.0), [], []
    for wrapper_l, kv_len in zip(wrapper._batch_prefill_wrappers, case.level_kv_lens):
        spec = wrapper_l._plan.module.spec
        tol = flashjit.tolerance(spec, q=q, k=case.k, v=case.v, kv_len=max(kv_len, 1), sm_scale=sm_scale)
        levels, rtols = levels + tol, rtols + [tol.rtol]
        lse_tol = evaluate_lse(profile(spec), kv_len=max(kv_len, 1), logit_absmax=logit_absmax)
        deltas.append(lse_tol.atol + lse_tol.rtol * (math.log2(max(kv_len, 1)) + logit_absmax / math.log(2)))
    u_out = DTYPES[str(q.dtype).removeprefix("torch.")][2]
    merge = Tolerance(rtol=u_out, atol=v_absmax * (max(rtols) + 2.1 * math.log(2) * max(deltas) + 16 * U32))
    return levels + merge


def plain_run(case: CascadeCase, q, causal: bool):
    """BatchPrefillWithPagedKVCacheWrapper over each request's concatenated pages, and its bound."""
    plain = flashjit.BatchPrefillWithPagedKVCacheWrapper(workspace())
    plain.plan(torch.tensor(indptr_of(case.qo_lens), dtype=torch.int32), case.indptr, case.indices, case.last,
               *HEADS, q.shape[-1], PAGE, causal=causal, q_data_type=q.dtype)
    poison_allocator()
    out = plain.run(q, case.cache)
    tol = flashjit.tolerance(plain._plan.module.spec, q=q, k=case.k, v=case.v, kv_len=max(case.kv_lens),
                             sm_scale=1 / math.sqrt(q.shape[-1]))
    return out, tol


def report(error_report, what, dtype, out, other, ref, bound) -> float:
    diff = torch.where(out.double() == other.double(), 0.0, (out.double() - other.double()).abs())
    ratio = float((diff / bound.bound(ref)).max())
    short = {torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]
    error_report.append({"config": f"{what}_{short}", "what": what, "ratio": ratio, "max_err": float(diff.max()),
                         "mean_err": float(diff.mean()), "rtol": bound.rtol, "atol": bound.atol})
    return ratio


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("qo_len", [1, 4], ids=["decode", "chunks4"])
@pytest.mark.parametrize("num_levels", [2, 3], ids=["2levels", "3levels"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cascade_against_reference_and_plain_paged(prewarmed, error_report, dtype, head_dim, num_levels, qo_len,
                                                   causal):
    case = CascadeCase(new_cache(dtype, head_dim), num_levels, qo_len, own_lengths(qo_len))
    q = randn(sum(case.qo_lens), HEADS[0], head_dim, dtype=dtype)
    w = flashjit.MultiLevelCascadeAttentionWrapper(num_levels, workspace())
    w.plan(*case.plan_args(), *HEADS, head_dim, PAGE, causal=causal, q_data_type=dtype)
    assert [lvl._plan.module.spec.causal for lvl in w._batch_prefill_wrappers] == [False] * (num_levels - 1) + [causal]
    poison_allocator()
    out = w.run(q, case.cache)
    torch.cuda.synchronize()
    assert out.dtype == dtype and out.shape == q.shape and not torch.isnan(out).any()
    ref = case.reference(q, causal)
    bound = cascade_bound(w, case, q)
    what = f"cascade_{num_levels}levels_q{qo_len}_{'causal' if causal else 'full'}_d{head_dim}"
    assert report(error_report, what, dtype, out, ref, ref, bound) <= 1.0, f"{what}: past its bound against float64"
    plain, plain_tol = plain_run(case, q, causal)
    plain_tol.assert_close(plain, ref, "plain paged prefill")
    ratio = report(error_report, f"{what}_vs_plain", dtype, out, plain, ref, bound + plain_tol)
    assert ratio <= 1.0, f"{what}: cascade and plain paged attention differ past the sum of their bounds"


def test_cascade_with_kv_tuple_and_hnd(prewarmed, error_report):
    """The cache as a (K, V) tuple in the HND layout: the levels read it as the plain wrapper does."""
    dtype, head_dim = torch.bfloat16, 128
    case = CascadeCase(new_cache(dtype, head_dim), 2, 4, own_lengths(4))
    hnd = case.cache.transpose(2, 3).contiguous()
    q = randn(sum(case.qo_lens), HEADS[0], head_dim, dtype=dtype)
    w = flashjit.MultiLevelCascadeAttentionWrapper(2, workspace(), "HND")
    w.plan(*case.plan_args(), *HEADS, head_dim, PAGE, causal=True, q_data_type=dtype)
    poison_allocator()
    out = w.run(q, (hnd[:, 0].contiguous(), hnd[:, 1].contiguous()))
    ref = case.reference(q, True)
    assert report(error_report, "cascade_hnd_tuple", dtype, out, ref, ref, cascade_bound(w, case, q)) <= 1.0


@pytest.mark.parametrize("num_levels", [2, 3], ids=["2levels", "3levels"])
def test_cuda_graph_replay_after_replanning(prewarmed, error_report, num_levels):
    """Capture one run(); plan new page tables (same batch and tokens) and new
    queries; each replay equals an eager run() of the same plan bit for bit and
    meets the bound against float64."""
    dtype, head_dim, qo_len = torch.bfloat16, 128, 1
    cache = new_cache(dtype, head_dim)
    page_bufs = [torch.zeros(cache.shape[0], dtype=torch.int32, device="cuda") for _ in range(num_levels)]
    w = flashjit.MultiLevelCascadeAttentionWrapper(num_levels, workspace(), use_cuda_graph=True,
                                                   paged_kv_indices_buf_arr=page_bufs)
    case = CascadeCase(cache, num_levels, qo_len, own_lengths(qo_len))
    w.plan(*case.plan_args(), *HEADS, head_dim, PAGE, causal=True, q_data_type=dtype)
    q_buf = randn(sum(case.qo_lens), HEADS[0], head_dim, dtype=dtype)
    w.run(q_buf, cache)  # warm-up outside the capture: loads the kernels, prepares the calls
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_graph = w.run(q_buf, cache)
    for own in (own_lengths(qo_len), [300, 0, 2, 33, 64, 1], [5, 900, 17, 0, 16, 48]):
        case = CascadeCase(cache, num_levels, qo_len, own)
        w.plan(*case.plan_args(), *HEADS, head_dim, PAGE, causal=True, q_data_type=dtype)
        q_buf.copy_(randn(*q_buf.shape, dtype=dtype))
        eager = w.run(q_buf, cache).clone()
        out_graph.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_graph, eager), float((out_graph.float() - eager.float()).abs().max())
        ref = case.reference(q_buf, True)
        ratio = report(error_report, f"cascade_graph_{num_levels}levels", dtype, out_graph, ref, ref,
                       cascade_bound(w, case, q_buf))
        assert ratio <= 1.0, f"replay with own lengths {own}: past the bound against float64"


def test_bad_input_on_gpu(prewarmed):
    """Wrong devices and page tables: a ValueError naming the argument, before any launch."""
    dtype, head_dim = torch.float16, 64
    case = CascadeCase(new_cache(dtype, head_dim), 2, 1, own_lengths(1))
    w = flashjit.MultiLevelCascadeAttentionWrapper(2, workspace())
    args = (*HEADS, head_dim, PAGE)
    cpu_indices = [case.indices_arr[0], case.indices_arr[1].cpu()]
    with pytest.raises(ValueError, match=r"^paged_kv_indices_arr\[1\]: expected a tensor on cuda:0"):
        w.plan(case.qo_arr, case.kv_arr, cpu_indices, case.last_arr, *args, q_data_type=dtype)
    short = [case.indices_arr[0][:-1], case.indices_arr[1]]
    with pytest.raises(ValueError, match=r"^paged_kv_indices_arr\[0\]: expected at least 40 elements"):
        w.plan(case.qo_arr, case.kv_arr, short, case.last_arr, *args, q_data_type=dtype)
    negative = [case.indices_arr[0], case.indices_arr[1] - 1000]
    with pytest.raises(ValueError, match=r"^paged_kv_indices_arr\[1\]: expected page ids >= 0"):
        w.plan(case.qo_arr, case.kv_arr, negative, case.last_arr, *args, q_data_type=dtype)
    w.plan(*case.plan_args(), *args, q_data_type=dtype)
    q = randn(sum(case.qo_lens), HEADS[0], head_dim, dtype=dtype)
    with pytest.raises(ValueError, match=r"^q: expected a CUDA tensor, got a tensor on cpu"):
        w.run(q.cpu(), case.cache)
    with pytest.raises(ValueError, match=r"^q: expected dtype"):
        w.run(q.bfloat16(), case.cache)
    with pytest.raises(ValueError, match=r"^k: expected a CUDA tensor, got a tensor on cpu"):  # the cache's K
        w.run(q, case.cache.cpu())
