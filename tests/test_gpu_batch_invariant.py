"""Batch-invariant mode on a GPU, bit for bit: a request's output alone and
among 1 to 64 others of random lengths; prefill of a prompt against decode of
its tokens one at a time (append, then decode, each step); ragged against
paged prefill at page sizes 1, 16 and 64; chunk boundaries of the split-KV
policy; repeated runs and CUDA-graph replays. Each compared output is also
checked against float64 within its tolerance profile somewhere below, so the
mode is not identical by being wrong."""

from __future__ import annotations

import math
import random

import pytest
import torch

import flashjit
from flashjit.ops import _invariant
from flashjit.reference import ragged_reference
from test_gpu_attention import randn

pytestmark = pytest.mark.gpu

C = _invariant.CHUNK_KEYS
BACKENDS = ["auto", "fa2"]  # auto: fa3 on sm_90a; fa2 everywhere (on sm_90a its ragged tilings are the wide ones)


class Request:
    """A request's queries and its keys/values; the queries are the last qo_len of the kv_len positions."""

    def __init__(self, qo_len, kv_len, heads, head_dim, dtype, kv=None):
        self.q = randn(qo_len, heads[0], head_dim, dtype=dtype)
        self.k, self.v = kv if kv is not None else (randn(kv_len, heads[1], head_dim, dtype=dtype),
                                                    randn(kv_len, heads[1], head_dim, dtype=dtype))

    @property
    def qo_len(self):
        return self.q.shape[0]

    @property
    def kv_len(self):
        return self.k.shape[0]

    def step(self, j: int) -> "Request":
        """Query j alone, against the keys it sees: what a decode step at that position computes."""
        keys = j + self.kv_len - self.qo_len + 1
        step = Request.__new__(Request)
        step.q, step.k, step.v = self.q[j:j + 1], self.k[:keys], self.v[:keys]
        return step


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same(a, b, what: str) -> None:
    assert a.shape == b.shape, f"{what}: shapes {tuple(a.shape)} and {tuple(b.shape)}"
    if not torch.equal(bits(a), bits(b)):
        diff = (a.double() - b.double()).abs()
        raise AssertionError(f"{what}: {int((bits(a) != bits(b)).sum())} of {a.numel()} elements differ "
                             f"(max {float(diff.nan_to_num(float('inf')).max()):.3g})")


def indptr(lengths) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)


def workspace(nbytes=64 << 20):
    return torch.empty(nbytes, dtype=torch.uint8, device="cuda")


def ragged(reqs, backend="auto", causal=True, **plan_kw):
    """(out, lse) of each request, run as one ragged batch."""
    heads, d = (reqs[0].q.shape[1], reqs[0].k.shape[1]), reqs[0].q.shape[2]
    w = flashjit.BatchPrefillWithRaggedKVCacheWrapper(workspace(), backend=backend)
    w.plan(indptr([r.qo_len for r in reqs]), indptr([r.kv_len for r in reqs]), *heads, d, causal=causal,
           q_data_type=reqs[0].q.dtype, batch_invariant=True, **plan_kw)
    out, lse = w.run(torch.cat([r.q for r in reqs]), torch.cat([r.k for r in reqs]), torch.cat([r.v for r in reqs]),
                     return_lse=True)
    return split_rows(out, lse, [r.qo_len for r in reqs])


def split_rows(out, lse, lengths):
    bounds = indptr(lengths).tolist()
    return [(out[a:b], lse[a:b]) for a, b in zip(bounds, bounds[1:])]


def paged_cache(reqs, page_size, layout="NHD"):
    """A 5-D cache holding each request's keys in pages of random ids, the
    other slots random (they must not reach any output); indptr, ids, last lens."""
    heads, d, dtype = reqs[0].k.shape[1], reqs[0].k.shape[2], reqs[0].k.dtype
    pages = [math.ceil(r.kv_len / page_size) for r in reqs]
    cache = randn(sum(pages) + 2, 2, page_size, heads, d, dtype=dtype)
    ids = torch.randperm(sum(pages) + 2, device="cuda")[:sum(pages)].to(torch.int32)
    first = indptr(pages).tolist()
    for r, req in enumerate(reqs):
        pos = torch.arange(req.kv_len, device="cuda")
        page = ids[first[r] + pos // page_size].long()
        cache[page, 0, pos % page_size] = req.k
        cache[page, 1, pos % page_size] = req.v
    last = [(r.kv_len - 1) % page_size + 1 if r.kv_len else page_size for r in reqs]
    if layout == "HND":
        cache = cache.transpose(2, 3).contiguous()
    return cache, indptr(pages).cuda(), ids, torch.tensor(last, dtype=torch.int32, device="cuda")


def paged_prefill(reqs, page_size, backend="auto", layout="NHD", **plan_kw):
    heads, d = (reqs[0].q.shape[1], reqs[0].k.shape[1]), reqs[0].q.shape[2]
    cache, kv_indptr, ids, last = paged_cache(reqs, page_size, layout)
    w = flashjit.BatchPrefillWithPagedKVCacheWrapper(workspace(), layout, backend=backend)
    w.plan(indptr([r.qo_len for r in reqs]), kv_indptr, ids, last, *heads, d, page_size, causal=True,
           q_data_type=reqs[0].q.dtype, batch_invariant=True, **plan_kw)
    out, lse = w.run(torch.cat([r.q for r in reqs]), cache, return_lse=True)
    return split_rows(out, lse, [r.qo_len for r in reqs])


def paged_decode(reqs, page_size, backend="auto", tensor_cores=False, **plan_kw):
    """Each request's one query (its last position) against its keys, as one decode batch."""
    heads, d = (reqs[0].q.shape[1], reqs[0].k.shape[1]), reqs[0].q.shape[2]
    cache, kv_indptr, ids, last = paged_cache(reqs, page_size)
    w = flashjit.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD", use_tensor_cores=tensor_cores, backend=backend)
    w.plan(kv_indptr, ids, last, *heads, d, page_size, q_data_type=reqs[0].q.dtype, batch_invariant=True, **plan_kw)
    out, lse = w.run(torch.cat([r.q[-1:] for r in reqs]), cache, return_lse=True)
    return split_rows(out, lse, [1] * len(reqs))


def others(n, heads, head_dim, dtype, max_len=6000, seed=0):
    """n requests of random lengths: prompts, chunks of prompts (queries fewer than keys) and decode rows."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        kv = rng.choice([rng.randint(1, 200), rng.randint(1, max_len), rng.randint(C - 64, C + 64)])
        qo = rng.choice([kv, 1, rng.randint(1, kv)])
        out.append(Request(qo, kv, heads, head_dim, dtype))
    return out


def check_reference(out, lse, req, dtype, head_dim, what):
    ref, _ = ragged_reference(req.q, req.k, req.v, [0, req.qo_len], [0, req.kv_len], causal=True)
    spec = flashjit.KernelSpec.make("batch_prefill_paged", dtype, head_dim, use_tensor_cores=dtype != torch.float32,
                                    causal=True)
    flashjit.tolerance(spec, q=req.q, k=req.k, v=req.v, kv_len=req.kv_len).assert_close(out, ref, what)
    assert torch.isfinite(lse).all(), what


HEADS = (8, 2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n_others", [1, 7, 64])
def test_prefill_alone_and_in_batches(backend, n_others):
    torch.manual_seed(n_others)
    target = Request(C + 900, C + 900, HEADS, 128, torch.bfloat16)
    alone = ragged([target], backend)[0]
    check_reference(*alone, target, torch.bfloat16, 128, "alone")
    batch = others(n_others, HEADS, 128, torch.bfloat16, seed=n_others)
    at = n_others // 2
    batch.insert(at, target)
    for name, res in (("ragged", ragged(batch, backend)), ("paged 16", paged_prefill(batch, 16, backend))):
        assert_same(res[at][0], alone[0], f"{name} among {n_others}: out")
        assert_same(res[at][1], alone[1], f"{name} among {n_others}: lse")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n_others", [1, 7, 64])
@pytest.mark.parametrize("kv_len", [300, C, 3 * C + 5])
def test_decode_alone_and_in_batches(backend, n_others, kv_len):
    torch.manual_seed(kv_len)
    target = Request(1, kv_len, HEADS, 128, torch.bfloat16)
    alone = paged_decode([target], 16, backend)[0]
    batch = others(n_others, HEADS, 128, torch.bfloat16, max_len=3 * C, seed=n_others)
    batch.insert(0, target)
    for tc in (False, True):
        res = paged_decode(batch, 16, backend, tensor_cores=tc)[0]
        assert_same(res[0], alone[0], f"decode tc={tc} among {n_others}")
        assert_same(res[1], alone[1], f"decode tc={tc} among {n_others}: lse")
    prefill = ragged([target], backend)[0]  # its one query row, through the prefill path
    assert_same(prefill[0], alone[0], "ragged prefill of the query row")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_prefill_then_decode_step_by_step(backend, page_size, dtype):
    """A prompt prefilled at once, then the same tokens appended to a paged
    cache and decoded one per step, each step among other decode requests."""
    torch.manual_seed(page_size)
    n = 300
    prompt = Request(n, n, HEADS, 128, dtype)
    prefill = paged_prefill([prompt], page_size, backend)[0]
    check_reference(*prefill, prompt, dtype, 128, "prefill")
    assert_same(ragged([prompt], backend)[0][0], prefill[0], "ragged against paged prefill")
    pages = math.ceil(n / page_size)
    cache = torch.zeros(pages, 2, page_size, HEADS[1], 128, dtype=dtype, device="cuda")
    ids = torch.randperm(pages, device="cuda").to(torch.int32)
    w = flashjit.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD", backend=backend)
    rng = random.Random(page_size)
    for i in range(n):
        used = i // page_size + 1
        kv_indptr = torch.tensor([0, used], dtype=torch.int32, device="cuda")
        last = torch.tensor([i % page_size + 1], dtype=torch.int32, device="cuda")
        flashjit.append_paged_kv_cache(prompt.k[i:i + 1], prompt.v[i:i + 1], torch.zeros(1, dtype=torch.int32,
                                       device="cuda"), torch.tensor([i], dtype=torch.int32, device="cuda"), cache,
                                       ids, kv_indptr, last)
        if i % 37 == 0:  # now and then the step runs among others of random lengths
            step = paged_decode([prompt.step(i)] + others(rng.randint(1, 8), HEADS, 128, dtype, C + 100, i),
                                page_size, backend)[0]
        else:
            w.plan(kv_indptr, ids[:used], last, *HEADS, 128, page_size, q_data_type=dtype, batch_invariant=True)
            step = w.run(prompt.q[i:i + 1], cache, return_lse=True)
        assert_same(step[0], prefill[0][i:i + 1], f"decode step {i}")
        assert_same(step[1], prefill[1][i:i + 1], f"decode step {i}: lse")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_long_prompt_across_chunk_boundaries(backend, head_dim):
    """Rows at and around the chunk boundaries of a prompt of 2C + 300 tokens,
    through every op: ragged and paged prefill (pages of 1 and 64), chunked
    prefill, paged decode on either core setting, and the single-request ops."""
    if backend == "fa2" and head_dim == 256 and _sm90a_only():
        pytest.skip("fa2 on sm_90a: ragged d256 takes 64-key tiles, paged 32 (docs/numerics.md)")
    torch.manual_seed(head_dim)
    n = 2 * C + 300
    prompt = Request(n, n, HEADS, head_dim, torch.bfloat16)
    out, lse = ragged([prompt], backend)[0]
    check_reference(out, lse, prompt, torch.bfloat16, head_dim, "ragged")
    for page_size in (1, 64):
        got = paged_prefill([prompt], page_size, backend)[0]
        assert_same(got[0], out, f"paged prefill, pages of {page_size}")
    half = n // 2 + 7  # the prompt prefilled in two chunks, the second against all keys so far
    second = Request.__new__(Request)
    second.q, second.k, second.v = prompt.q[half:], prompt.k, prompt.v
    assert_same(paged_prefill([second], 16, backend)[0][0], out[half:], "second chunk of a chunked prefill")
    single = flashjit.single_prefill_with_kv_cache(prompt.q, prompt.k, prompt.v, causal=True, backend=backend,
                                                   batch_invariant=True)
    assert_same(single, out, "single_prefill")
    picks = random.Random(head_dim).sample(range(n), 8)
    rows = sorted({0, 1, C - 2, C - 1, C, C + 1, 2 * C - 1, 2 * C, 2 * C + 1, n - 1, *picks})
    steps = [prompt.step(j) for j in rows]
    for tc in (False, True):
        got = paged_decode(steps, 16, backend, tensor_cores=tc)
        for j, (o, s) in zip(rows, got):
            assert_same(o, out[j:j + 1], f"paged decode tc={tc} of row {j}")
            assert_same(s, lse[j:j + 1], f"paged decode tc={tc} of row {j}: lse")
    for j, step in zip(rows, steps):
        o = flashjit.single_decode_with_kv_cache(step.q[0], step.k, step.v, backend=backend, batch_invariant=True)
        assert_same(o, out[j], f"single_decode of row {j}")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_chunks_folded_in_the_kernel_or_split(monkeypatch, head_dim):
    """The same requests with every multi-chunk CTA folding its chunks itself
    (fa3 prefill) and with the chunks split across CTAs and merged: the same
    bits, through ragged and paged prefill and the single-request op; decode
    (which splits under both policies: ops._invariant.folds) against them."""
    torch.manual_seed(head_dim + 1)
    prompts = [Request(n, n, HEADS, head_dim, torch.bfloat16) for n in (3 * C + 77, C + 1, 300)]
    decodes = [Request(1, kv, HEADS, head_dim, torch.bfloat16) for kv in (3 * C + 5, 2 * C, C + 1, 64)] * 8
    got = {}
    for policy in ("always", "never"):
        monkeypatch.setattr(_invariant, "fold_policy", policy)
        got[policy] = (ragged(prompts), paged_prefill(prompts, 16),
                       flashjit.single_prefill_with_kv_cache(prompts[0].q, prompts[0].k, prompts[0].v, causal=True,
                                                             batch_invariant=True),
                       paged_decode(decodes, 16))
    (ragged_f, paged_f, single_f, decode_f), (ragged_s, paged_s, single_s, decode_s) = got["always"], got["never"]
    for i, prompt in enumerate(prompts):
        check_reference(*ragged_f[i], prompt, torch.bfloat16, head_dim, f"folded, prompt {i}")
        for what, a, b in (("ragged", ragged_f[i], ragged_s[i]), ("paged", paged_f[i], paged_s[i]),
                           ("paged against ragged", paged_f[i], ragged_s[i])):
            assert_same(a[0], b[0], f"{what}, prompt {i}: out")
            assert_same(a[1], b[1], f"{what}, prompt {i}: lse")
    assert_same(single_f, ragged_s[0][0], "single_prefill folded against ragged split")
    assert_same(single_s, ragged_s[0][0], "single_prefill split against ragged split")
    for i, ((a, la), (b, lb)) in enumerate(zip(decode_f, decode_s)):
        assert_same(a, b, f"decode {i}: out")
        assert_same(la, lb, f"decode {i}: lse")
    step = decodes[0]
    assert_same(decode_f[0][0], ragged([step])[0][0], "a decode row against its prefill row")


def _sm90a_only() -> bool:
    from flashjit import arch

    return arch.device_arch() == "sm_90a"


@pytest.mark.parametrize("heads", [(12, 2), (32, 8), (4, 4), (16, 1)], ids=lambda h: f"h{h[0]}kv{h[1]}")
def test_groups_and_tiles(heads):
    """Groups that do not divide a CTA's rows (6: tiles share a token), MHA and MQA."""
    torch.manual_seed(heads[0])
    n = C + 200
    prompt = Request(n, n, heads, 128, torch.bfloat16)
    out, lse = ragged([prompt])[0]
    check_reference(out, lse, prompt, torch.bfloat16, 128, "ragged")
    rows = [0, C - 1, C, n - 1, *random.Random(heads[0]).sample(range(n), 6)]
    got = paged_decode([prompt.step(j) for j in rows], 1)
    for j, (o, _) in zip(rows, got):
        assert_same(o, out[j:j + 1], f"decode of row {j}")
    batch = others(9, heads, 128, torch.bfloat16, seed=3) + [prompt]
    assert_same(paged_prefill(batch, 16)[-1][0], out, "paged prefill among others")


def test_float32_on_cuda_cores():
    torch.manual_seed(32)
    n = C + 150
    prompt = Request(n, n, HEADS, 64, torch.float32)
    out, lse = ragged([prompt])[0]
    check_reference(out, lse, prompt, torch.float32, 64, "ragged fp32")
    rows = [0, C - 1, C, C + 1, n - 1]
    for j, (o, s) in zip(rows, paged_decode([prompt.step(j) for j in rows], 16)):
        assert_same(o, out[j:j + 1], f"fp32 decode of row {j}")
        assert_same(s, lse[j:j + 1], f"fp32 decode of row {j}: lse")
    assert_same(paged_prefill(others(5, HEADS, 64, torch.float32) + [prompt], 64)[-1][0], out, "fp32 paged")


def test_repeated_runs_and_cuda_graph_replays():
    """The same plan run twice, and a CUDA graph replayed as the contexts grow
    (chunks are added, never resized), give the bits of an eager plan."""
    torch.manual_seed(7)
    base, grows = (100, C - 5, 2 * C + 3, 40), (0, 700, C + 1)
    full = [Request(1, n + grows[-1], HEADS, 128, torch.bfloat16) for n in base]
    first = paged_decode(full, 16)
    for (a, _), (b, _) in zip(first, paged_decode(full, 16)):
        assert_same(a, b, "a second run")
    cache, full_indptr, ids, _ = paged_cache(full, 16)
    bounds = full_indptr.tolist()
    buf = torch.empty(ids.numel(), dtype=torch.int32, device="cuda")
    w = flashjit.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD", use_cuda_graph=True,
                                                    paged_kv_indices_buffer=buf)
    q = torch.cat([r.q for r in full])
    out = torch.empty_like(q)
    graph = None
    for grow in grows:
        lens = [n + grow for n in base]
        pages = [math.ceil(n / 16) for n in lens]
        table = torch.cat([ids[b:b + p] for b, p in zip(bounds, pages)])
        last = torch.tensor([(n - 1) % 16 + 1 for n in lens], dtype=torch.int32, device="cuda")
        w.plan(indptr(pages).cuda(), table, last, *HEADS, 128, 16, q_data_type=torch.bfloat16, batch_invariant=True)
        if graph is None:
            w.run(q, cache, out=out)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                w.run(q, cache, out=out)
        out.zero_()
        graph.replay()
        steps = []
        for r, n in zip(full, lens):
            step = Request.__new__(Request)
            step.q, step.k, step.v = r.q, r.k[:n], r.v[:n]
            steps.append(step)
        for i, (o, _) in enumerate(paged_decode(steps, 16)):
            assert_same(out[i:i + 1], o, f"graph replay after growing by {grow}, request {i}")
