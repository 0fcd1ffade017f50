"""Custom masks on a GPU: single, ragged and paged prefill (page sizes 1 and
16) with FlashInfer's custom_mask, fp16/bf16, head dims 64 and 128, GQA 32/8
and 8/2, against the float64 reference with the mask applied, within the
configuration's profile, LSE too. Masks: speculative decoding's trees (8 draft
tokens per request seeing every cache key and their ancestors in a random tree)
and dense random ones. Also: an all-True mask is no mask (causal=False) bit for
bit where both kernels share a tiling (else within the sum of their
profiles); a mask of the causal pattern against causal=True within the sum of
the profiles; packed_custom_mask gives custom_mask's output bit for bit;
split-KV; rows whose mask hides every key (o = 0, LSE -inf); sliding window
and soft-cap beside a mask; a CUDA graph replayed after plan() rewrote the
mask buffer and after the buffer changed in place; batch-invariant mode; the
key tiles before a request's full-key count (keys every query sees) skipping
the mask's test, bit for bit the run that tests every tile. Its own prewarm
builds just these configurations, in one parallel build."""

from __future__ import annotations

import math

import pytest
import torch

import flashjit
from flashjit import jit
from flashjit.kernels import fa2
from flashjit.ops import _calls, _masks
from flashjit.reference import attention_reference, ragged_reference, request_masks
from flashjit.spec import KernelSpec
from sweep import build_for_gpu
from test_gpu_attention import check, poison_allocator, randn
from test_gpu_paged import PagedBatch, indptr_of, workspace

pytestmark = pytest.mark.gpu

F16, BF16 = torch.float16, torch.bfloat16
DTYPES = [F16, BF16]
HEAD_DIMS = [64, 128]
HEADS = [(32, 8), (8, 2)]
# A test's name for an op and its page size (0: ragged K/V).
VARIANTS = {"single": ("single_prefill", 0), "ragged": ("batch_prefill_ragged", 0),
            "paged1": ("batch_prefill_paged", 1), "paged16": ("batch_prefill_paged", 16)}
DRAFT = 8
TREE_CACHE = [0, 1, 15, 16, 17, 300, 2000, 77]   # cache keys in front of each request's draft tokens
DENSE = ([1, 37, 128, 5, 3], [1, 300, 128, 1000, 0])
SINGLE = {"tree": ([DRAFT], [300 + DRAFT]), "dense": ([37], [300])}
WINDOW_CAP = {"window_left": 70, "logits_soft_cap": 30.0}


def mask_spec(op: str, dtype, head_dim: int, **flags) -> KernelSpec:
    return KernelSpec.make(op, dtype, head_dim, backend="fa2", use_tensor_cores=True, return_lse=True,
                           custom_mask=True, **flags)


def plain_spec(op: str, dtype, head_dim: int, causal: bool = False) -> KernelSpec:
    return KernelSpec.make(op, dtype, head_dim, backend="fa2", use_tensor_cores=True, return_lse=True, causal=causal)


def used_specs() -> list[KernelSpec]:
    ops = sorted({op for op, _ in VARIANTS.values()})
    specs = [mask_spec(op, dtype, d) for op in ops for dtype in DTYPES for d in HEAD_DIMS]
    specs += [plain_spec(op, dtype, 128) for op in ops for dtype in DTYPES]
    specs += [plain_spec(op, BF16, 128, causal=True) for op in ops]
    specs.append(mask_spec("batch_prefill_ragged", BF16, 128, sliding_window=True, soft_cap=True))
    return list(dict.fromkeys(s.validate() for s in specs))


@pytest.fixture(scope="module")
def built():
    """This file's configurations, in one parallel build."""
    return build_for_gpu(used_specs())


def tree_mask(cache_len: int, draft: int = DRAFT) -> torch.Tensor:
    """[draft, cache_len + draft]: every cache key, and the draft tokens on the
    path from the root of a random tree to the query's own token."""
    mask = torch.zeros(draft, cache_len + draft, dtype=torch.bool)
    mask[:, :cache_len] = True
    parents = [-1] + [int(torch.randint(-1, i, ())) for i in range(1, draft)]
    for i in range(draft):
        node = i
        while node >= 0:
            mask[i, cache_len + node] = True
            node = parents[node]
    return mask


def lengths(kind: str, variant: str) -> tuple[list[int], list[int]]:
    if variant == "single":
        return SINGLE[kind]
    if kind == "tree":
        return [DRAFT] * len(TREE_CACHE), [n + DRAFT for n in TREE_CACHE]
    return DENSE


def make_mask(kind: str, qo_lens, kv_lens) -> torch.Tensor:
    """A batch's flat mask on the GPU: trees (requests of DRAFT queries) or dense random pairs."""
    if kind == "tree":
        parts = [tree_mask(kv - qo) for qo, kv in zip(qo_lens, kv_lens)]
        return torch.cat([p.flatten() for p in parts]).cuda()
    if kind == "full":
        return torch.ones(sum(q * k for q, k in zip(qo_lens, kv_lens)), dtype=torch.bool, device="cuda")
    if kind == "causal":  # bottom-right aligned, as causal=True
        parts = [torch.ones(qo, kv, dtype=torch.bool).tril(kv - qo) for qo, kv in zip(qo_lens, kv_lens)]
        return torch.cat([p.flatten() for p in parts]).cuda()
    return torch.rand(sum(q * k for q, k in zip(qo_lens, kv_lens)), device="cuda") < 0.5


class Problem:
    """One op's inputs for qo_lens x kv_lens; run() plans (batch ops) and runs it
    with a mask, none, or causal=True."""

    def __init__(self, variant: str, dtype, head_dim: int, heads, qo_lens, kv_lens):
        self.variant, (self.op, self.page_size) = variant, VARIANTS[variant]
        self.dtype, self.head_dim, self.heads = dtype, head_dim, heads
        self.qo_lens, self.kv_lens = list(qo_lens), list(kv_lens)
        num_qo, num_kv = heads
        self.q = randn(sum(qo_lens), num_qo, head_dim, dtype=dtype)
        if self.page_size:
            self.batch = PagedBatch(kv_lens, self.page_size, num_kv, head_dim, dtype)
            self.k, self.v = self.batch.k, self.batch.v
        else:
            self.k, self.v = (randn(sum(kv_lens), num_kv, head_dim, dtype=dtype) for _ in range(2))
        self.wrapper = None

    def plan(self, backend="auto", wrapper_kw=None, **plan_kw):
        num_qo, num_kv = self.heads
        qo_indptr = torch.tensor(indptr_of(self.qo_lens), dtype=torch.int32)
        if self.page_size:
            self.wrapper = self.wrapper or flashjit.BatchPrefillWithPagedKVCacheWrapper(workspace(), backend=backend,
                                                                                       **(wrapper_kw or {}))
            self.wrapper.plan(qo_indptr, self.batch.indptr, self.batch.indices, self.batch.last, num_qo, num_kv,
                              self.head_dim, self.page_size, q_data_type=self.dtype, **plan_kw)
        else:
            self.wrapper = self.wrapper or flashjit.BatchPrefillWithRaggedKVCacheWrapper(workspace(), backend=backend,
                                                                                        **(wrapper_kw or {}))
            self.wrapper.plan(qo_indptr, torch.tensor(indptr_of(self.kv_lens), dtype=torch.int32), num_qo, num_kv,
                              self.head_dim, q_data_type=self.dtype, **plan_kw)
        return self.wrapper

    def run(self, mask=None, packed=None, causal=False, backend="auto", **kw):
        """(out, lse) into poisoned memory; mask: the flat bool mask; packed: its packed bits instead."""
        masks = {"custom_mask": mask, "packed_custom_mask": packed}
        if self.op == "single_prefill":
            poison_allocator()
            if mask is not None:
                masks["custom_mask"] = mask.view(self.qo_lens[0], self.kv_lens[0])
            res = flashjit.single_prefill_with_kv_cache(self.q, self.k, self.v, causal=causal, return_lse=True,
                                                        backend=backend, **masks, **kw)
        else:
            plan_kw = {key: kw.pop(key) for key in ("fixed_split_size", "batch_invariant", *WINDOW_CAP) if key in kw}
            self.wrapper = None
            wrapper = self.plan(backend, causal=causal, **masks, **plan_kw)
            if mask is not None or packed is not None:
                assert wrapper._plan.module.spec.custom_mask and wrapper._plan.module.spec.backend == "fa2"
            poison_allocator()
            cache = (self.batch.cache,) if self.page_size else (self.k, self.v)
            res = wrapper.run(self.q, *cache, return_lse=True)
        torch.cuda.synchronize()
        return res

    def reference(self, mask=None, causal=False, **kw):
        masks = None if mask is None else request_masks(mask, self.qo_lens, self.kv_lens)
        return ragged_reference(self.q, self.k, self.v, indptr_of(self.qo_lens), indptr_of(self.kv_lens),
                                masks=masks, causal=causal, **kw)

    def check(self, spec, out, lse, ref, ref_lse, report, what, **info):
        check(spec, out, ref, self.q, self.k, self.v, max(max(self.kv_lens), 1), 1 / math.sqrt(self.head_dim),
              report, what, lse=lse, ref_lse=ref_lse, heads=self.heads, **info)

    def tolerance(self, spec):
        return flashjit.tolerance(spec, q=self.q, k=self.k, v=self.v, kv_len=max(max(self.kv_lens), 1),
                                  sm_scale=1 / math.sqrt(self.head_dim))


def _hidden_rows(out, lse, ref_lse, what):
    """Rows whose mask hides every key: o = 0 and LSE -inf, as the reference."""
    empty = torch.isneginf(ref_lse)
    assert (out[empty] == 0).all(), f"{what}: a row that sees no key is not 0"
    assert torch.isneginf(lse[empty]).all(), f"{what}: a row that sees no key has a finite LSE"
    return int(empty.sum())


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["tree", "dense"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_mask_against_the_reference(built, error_report, variant, kind, dtype, head_dim, heads):
    p = Problem(variant, dtype, head_dim, heads, *lengths(kind, variant))
    mask = make_mask(kind, p.qo_lens, p.kv_lens)
    out, lse = p.run(mask)
    ref, ref_lse = p.reference(mask)
    p.check(mask_spec(p.op, dtype, head_dim), out, lse, ref, ref_lse, error_report, f"{variant}_mask", kind=kind)
    _hidden_rows(out, lse, ref_lse, f"{variant} {kind}")


@pytest.mark.parametrize("kind", ["tree", "dense"])
@pytest.mark.parametrize("variant", ["ragged", "paged1", "paged16"])
def test_tiles_before_the_full_keys_skip_the_test(built, monkeypatch, variant, kind):
    """The plan's full-key counts (ops._masks.full_keys: a tree's whole cache,
    a dense mask's few keys) change no bit against a plan without them, where
    every key tile tests the mask."""
    p = Problem(variant, BF16, 128, (32, 8), *lengths(kind, variant))
    mask = make_mask(kind, p.qo_lens, p.kv_lens)
    with_counts = p.run(mask)
    assert p.wrapper._plan.mask[2] != 0
    counts = p.wrapper._mask_full.tolist()
    if kind == "tree":  # at least the cache (a draft token every query sees counts too)
        assert all(n >= kv - qo for n, qo, kv in zip(counts, p.qo_lens, p.kv_lens))
    monkeypatch.setattr(_masks, "FULL_KEYS_MAX_PAIRS", 0)
    without = p.run(mask)
    assert p.wrapper._plan.mask[2] == 0
    assert torch.equal(with_counts[0], without[0]) and torch.equal(with_counts[1], without[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_full_mask_is_no_mask(built, error_report, variant, dtype):
    """Bit for bit where the masked and plain kernels share a tiling (on sm_90a
    plain single and ragged prefill take fa2's wide tilings, which masks do
    not): else within the sum of their profiles."""
    p = Problem(variant, dtype, 128, (8, 2), *lengths("dense", variant))
    out, lse = p.run(make_mask("full", p.qo_lens, p.kv_lens))
    plain_out, plain_lse = p.run(backend="fa2")
    spec, plain = mask_spec(p.op, dtype, 128), plain_spec(p.op, dtype, 128)
    arches = jit.resolve_arches()
    if fa2.tiling(spec, arches) == fa2.tiling(plain, arches):
        assert torch.equal(out, plain_out) and torch.equal(lse, plain_lse)
    ref, ref_lse = p.reference()
    bound = p.tolerance(spec) + p.tolerance(plain)
    ratio = float(((out.double() - plain_out.double()).abs() / bound.bound(ref)).max())
    assert ratio <= 1.0, f"{variant}: full mask and no mask differ past the sum of their profiles"
    p.check(spec, out, lse, ref, ref_lse, error_report, f"{variant}_full_mask", plain_ratio=ratio)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_causal_pattern_is_causal(built, error_report, variant):
    """Within the sum of the two profiles (the causal kernel skips the tiles
    the mask hides, and its plan may split differently); the report says
    whether they agreed bit for bit."""
    lens = ([300], [1000]) if variant == "single" else ([1, 37, 128, 300, 5], [1, 300, 128, 1000, 700])
    p = Problem(variant, BF16, 128, (8, 2), *lens)
    out, lse = p.run(make_mask("causal", p.qo_lens, p.kv_lens))
    causal_out, causal_lse = p.run(causal=True, backend="fa2")
    ref, ref_lse = p.reference(causal=True)
    bound = p.tolerance(mask_spec(p.op, BF16, 128)) + p.tolerance(plain_spec(p.op, BF16, 128, causal=True))
    ratio = float(((out.double() - causal_out.double()).abs() / bound.bound(ref)).max())
    assert ratio <= 1.0, f"{variant}: the causal pattern and causal=True differ past the sum of their profiles"
    p.check(mask_spec(p.op, BF16, 128), out, lse, ref, ref_lse, error_report, f"{variant}_causal_pattern",
            causal_ratio=ratio, bitwise=bool(torch.equal(out, causal_out) and torch.equal(lse, causal_lse)))


@pytest.mark.parametrize("variant", VARIANTS)
def test_packed_custom_mask_is_custom_mask(built, variant):
    """The bits packed per request (segment_packbits, little-endian) give custom_mask's output bit for bit."""
    p = Problem(variant, BF16, 128, (32, 8), *lengths("tree", variant))
    mask = make_mask("tree", p.qo_lens, p.kv_lens)
    bit_indptr = torch.tensor(indptr_of([q * k for q, k in zip(p.qo_lens, p.kv_lens)]), device="cuda")
    packed, _ = flashjit.segment_packbits(mask, bit_indptr, bitorder="little")
    out, lse = p.run(mask)
    packed_out, packed_lse = p.run(packed=packed)
    assert torch.equal(out, packed_out) and torch.equal(lse, packed_lse)


@pytest.mark.parametrize("kind", ["tree", "dense"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_split_kv_with_a_mask(built, error_report, variant, kind):
    """Long keys cut into chunks (the kernel reads bits by absolute key)."""
    split = {"ragged": 512, "paged1": 512, "paged16": 8}
    qo_lens, kv_lens = ([DRAFT], [5000]) if variant == "single" else ([DRAFT] * 3, [30000, 100, 9000])
    p = Problem(variant, BF16, 128, (8, 2), qo_lens, kv_lens)
    mask = make_mask(kind, qo_lens, kv_lens)
    kw = {} if variant == "single" else {"fixed_split_size": split[variant]}
    out, lse = p.run(mask, **kw)
    spec = mask_spec(p.op, BF16, 128)
    if variant == "single":
        module = jit.get_module(spec)
        ctas = -(-DRAFT * 4 // module.rows_per_cta) * 2
        assert _calls.single_request_split(5000, ctas, _calls.resident_ctas(module, p.q.device))[0] > 1
    else:
        work = p.wrapper._plan.work
        assert work.kv_chunk > 0 and work.merge_indptr is not None, "the plan was meant to split"
    ref, ref_lse = p.reference(mask)
    p.check(spec, out, lse, ref, ref_lse, error_report, f"{variant}_mask_split", kind=kind)


@pytest.mark.parametrize("variant", VARIANTS)
def test_rows_that_see_no_key(built, error_report, variant):
    """Every third query row hidden from every key, and a request whose whole mask is False."""
    qo_lens, kv_lens = ([37], [300]) if variant == "single" else ([37, 8, 5], [300, 40, 17])
    p = Problem(variant, BF16, 128, (8, 2), qo_lens, kv_lens)
    parts = []
    for r, (qo, kv) in enumerate(zip(qo_lens, kv_lens)):
        part = torch.rand(qo, kv, device="cuda") < 0.5
        part[::3] = False
        parts.append(part.flatten() if r != 1 else torch.zeros(qo * kv, dtype=torch.bool, device="cuda"))
    mask = torch.cat(parts)
    out, lse = p.run(mask)
    ref, ref_lse = p.reference(mask)
    assert _hidden_rows(out, lse, ref_lse, variant) >= qo_lens[0] // 3
    p.check(mask_spec(p.op, BF16, 128), out, lse, ref, ref_lse, error_report, f"{variant}_mask_hidden_rows")


def test_window_and_soft_cap_beside_a_mask(built, error_report):
    p = Problem("ragged", BF16, 128, (8, 2), *lengths("tree", "ragged"))
    mask = make_mask("tree", p.qo_lens, p.kv_lens)
    out, lse = p.run(mask, **WINDOW_CAP)
    ref, ref_lse = p.reference(mask, **WINDOW_CAP)
    p.check(mask_spec(p.op, BF16, 128, sliding_window=True, soft_cap=True), out, lse, ref, ref_lse, error_report,
            "ragged_mask_window_softcap")


@pytest.mark.parametrize("variant", ["ragged", "paged16"])
def test_cuda_graph_replays_a_new_mask(built, error_report, variant):
    """Captured once; a plan() with a new mask (same lengths) rewrites
    custom_mask_buf in place (bits and full-key counts), and so does a direct
    write of new bits that keeps each request's cache visible (the planned
    counts): each replay equals an eager run bit for bit and is within the profile."""
    p = Problem(variant, BF16, 128, (32, 8), *lengths("tree", variant))
    pages = torch.zeros(p.batch.indices.shape[0] + 8, dtype=torch.int32, device="cuda") if p.page_size else None
    ctor = {"use_cuda_graph": True, "custom_mask_buf": torch.zeros(1 << 16, dtype=torch.uint8, device="cuda"),
            **({"paged_kv_indices_buf": pages} if p.page_size else {})}
    mask = make_mask("tree", p.qo_lens, p.kv_lens)
    wrapper = p.plan(wrapper_kw=ctor, custom_mask=mask)
    cache = (p.batch.cache,) if p.page_size else (p.k, p.v)
    out_buf, lse_buf = torch.empty_like(p.q), torch.empty(p.q.shape[:2], device="cuda")
    wrapper.run(p.q, *cache, out=out_buf, lse=lse_buf, return_lse=True)  # prepared outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(p.q, *cache, out=out_buf, lse=lse_buf, return_lse=True)
    bit_indptr = torch.tensor(indptr_of([q * k for q, k in zip(p.qo_lens, p.kv_lens)]), device="cuda")
    for how in ("plan", "in_place"):
        mask = make_mask("tree", p.qo_lens, p.kv_lens)
        if how == "plan":
            p.plan(custom_mask=mask)
        else:
            # The planned full-key counts stay: the new bits keep those keys visible (docs/masks.md).
            counts = wrapper._mask_full.tolist()
            parts = request_masks(mask, p.qo_lens, p.kv_lens)
            for part, n in zip(parts, counts):
                part[:, :n] = True
            mask = torch.cat([part.flatten() for part in parts])
            packed, _ = flashjit.segment_packbits(mask, bit_indptr, bitorder="little")
            ctor["custom_mask_buf"][:packed.shape[0]].copy_(packed)
        out_buf.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager_out, eager_lse = wrapper.run(p.q, *cache, return_lse=True)
        assert torch.equal(out_buf, eager_out) and torch.equal(lse_buf, eager_lse), how
        ref, ref_lse = p.reference(mask)
        p.check(mask_spec(p.op, BF16, 128), out_buf, lse_buf, ref, ref_lse, error_report, f"{variant}_mask_graph",
                how=how)


def test_batch_invariant_mode_with_a_mask(built, error_report):
    """A request alone, among others and through single prefill, bit for bit
    (fa2, whatever the GPU: fa3 has no masks); within the profile."""
    alone = Problem("ragged", BF16, 128, (8, 2), [DRAFT], [3000 + DRAFT])
    crowd = Problem("ragged", BF16, 128, (8, 2), [5, DRAFT, 90], [40, 3000 + DRAFT, 5000])
    crowd.q[5:5 + DRAFT], crowd.k[40:3048], crowd.v[40:3048] = alone.q, alone.k, alone.v
    mine = tree_mask(3000).cuda().flatten()
    crowd_mask = torch.cat([make_mask("dense", [5], [40]), mine, make_mask("dense", [90], [5000])])
    out, lse = alone.run(mine, batch_invariant=True)
    out_crowd, lse_crowd = crowd.run(crowd_mask, batch_invariant=True)
    assert torch.equal(out_crowd[5:5 + DRAFT], out) and torch.equal(lse_crowd[5:5 + DRAFT], lse)
    single, single_lse = flashjit.single_prefill_with_kv_cache(alone.q, alone.k, alone.v, return_lse=True,
                                                               custom_mask=mine.view(DRAFT, 3000 + DRAFT),
                                                               batch_invariant=True)
    assert torch.equal(single, out) and torch.equal(single_lse, lse)
    ref, ref_lse = alone.reference(mine)
    alone.check(mask_spec(alone.op, BF16, 128), out, lse, ref, ref_lse, error_report, "batch_invariant_mask")


def test_single_prefill_takes_a_two_dimensional_or_flat_mask(built):
    p = Problem("single", F16, 64, (8, 2), [37], [300])
    mask = make_mask("dense", [37], [300])
    out, lse = p.run(mask)
    flat_out, flat_lse = flashjit.single_prefill_with_kv_cache(p.q, p.k, p.v, custom_mask=mask, return_lse=True)
    assert torch.equal(out, flat_out) and torch.equal(lse, flat_lse)
    ref, _ = attention_reference(p.q, p.k, p.v, mask=mask.view(37, 300).cpu())
    assert flashjit.tolerance(mask_spec("single_prefill", F16, 64), q=p.q, k=p.k, v=p.v, kv_len=300,
                              sm_scale=1 / 8).assert_close(out, ref, "single 2-D mask") <= 1.0
