"""append_paged_kv_cache / get_batch_indices_positions / get_seq_lens and the
merge_state family: every bad input is a ValueError naming the argument (CPU),
and the results match a float64 Python reference, on CPU tensors here and on
CUDA tensors under the gpu mark, where CUDA-graph capture is checked too."""

from __future__ import annotations

import math

import pytest
import torch

import flashjit
from flashjit.spec import unit_roundoff

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
U32 = 2.0**-24
I32 = torch.int32


# ---------------------------------------------------------------------------
# Paged append


def paged_batch(page_size: int, layout: str, form: str, dtype, device, seed: int = 0, heads: int = 2, dim: int = 16):
    """A random batch (some requests append nothing) over pages in random order."""
    g = torch.Generator().manual_seed(seed)
    batch = 5
    seq = torch.randint(1, 3 * page_size + 6, (batch,), generator=g)
    app = torch.minimum(torch.randint(0, 2 * page_size + 4, (batch,), generator=g), seq)
    pages = (seq + page_size - 1) // page_size
    num_pages = int(pages.sum()) + 3  # spare pages, which must stay untouched
    kv_indptr = torch.cat([torch.zeros(1, dtype=torch.long), pages.cumsum(0)]).to(I32)
    kv_indices = torch.randperm(num_pages, generator=g)[: int(pages.sum())].to(I32)
    last = (seq - (pages - 1) * page_size).to(I32)
    append_indptr = torch.cat([torch.zeros(1, dtype=torch.long), app.cumsum(0)]).to(I32)
    nnz = int(app.sum())
    key = torch.randn(nnz, heads, dim, generator=g).to(dtype)
    value = torch.randn(nnz, heads, dim, generator=g).to(dtype)
    per_page = (page_size, heads, dim) if layout == "NHD" else (heads, page_size, dim)
    cache = torch.randn(num_pages, 2, *per_page, generator=g).to(dtype)
    if form == "tuple":
        cache = (cache[:, 0].contiguous(), cache[:, 1].contiguous())
    to = (lambda t: t.to(device))
    cache = tuple(map(to, cache)) if form == "tuple" else to(cache)
    return dict(key=to(key), value=to(value), cache=cache, kv_indices=to(kv_indices), kv_indptr=to(kv_indptr),
                last=to(last), append_indptr=to(append_indptr), seq=seq.tolist(), nnz=nnz)


def nhd_float64(cache, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches as [pages, page_size, heads, dim] float64 (exact for every dtype)."""
    k, v = cache if isinstance(cache, tuple) else (cache[:, 0], cache[:, 1])
    if layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return k.double().cpu().clone(), v.double().cpu().clone()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["tuple", "5d"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 16, 32, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_append_matches_python_reference(dtype, page_size, layout, form, device):
    b = paged_batch(page_size, layout, form, dtype, device, seed=page_size)
    seq_lens = flashjit.get_seq_lens(b["kv_indptr"], b["last"], page_size)
    assert seq_lens.tolist() == b["seq"]
    batch_indices, positions = flashjit.get_batch_indices_positions(b["append_indptr"], seq_lens, b["nnz"])
    # Reference: the last append_len tokens of each request are the new ones.
    ap = b["append_indptr"].tolist()
    want_b = [r for r in range(len(ap) - 1) for _ in range(ap[r], ap[r + 1])]
    want_p = [b["seq"][r] - (ap[r + 1] - ap[r]) + j for r in range(len(ap) - 1) for j in range(ap[r + 1] - ap[r])]
    assert batch_indices.dtype == positions.dtype == I32
    assert batch_indices.tolist() == want_b and positions.tolist() == want_p

    ref_k, ref_v = nhd_float64(b["cache"], layout)
    indptr, indices = b["kv_indptr"].tolist(), b["kv_indices"].tolist()
    for i, (r, p) in enumerate(zip(want_b, want_p)):
        page = indices[indptr[r] + p // page_size]
        ref_k[page, p % page_size] = b["key"][i].double().cpu()
        ref_v[page, p % page_size] = b["value"][i].double().cpu()
    flashjit.append_paged_kv_cache(b["key"], b["value"], batch_indices, positions, b["cache"], b["kv_indices"],
                                   b["kv_indptr"], b["last"], kv_layout=layout)
    got_k, got_v = nhd_float64(b["cache"], layout)
    assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)  # a copy: exact, spare pages untouched


def test_batch_indices_positions_flashinfer_example_and_padding():
    append_indptr = torch.tensor([0, 1, 3, 6, 10], dtype=I32)
    seq_lens = torch.tensor([5, 5, 5, 5])
    bi, pos = flashjit.get_batch_indices_positions(append_indptr, seq_lens, 10)
    assert bi.tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    assert pos.tolist() == [4, 3, 4, 2, 3, 4, 1, 2, 3, 4]
    # Entries past append_indptr[-1] are padding; preallocated outputs are written in place.
    out_b, out_p = torch.full((12,), 7, dtype=I32), torch.full((12,), 7, dtype=I32)
    got = flashjit.get_batch_indices_positions(append_indptr, seq_lens, 12, out_b, out_p)
    assert got[0] is out_b and got[1] is out_p
    assert out_b.tolist()[10:] == [-1, -1] and out_p.tolist()[10:] == [0, 0]
    empty = torch.zeros(1, dtype=I32)
    assert flashjit.get_batch_indices_positions(empty, torch.zeros(0, dtype=I32), 2)[0].tolist() == [-1, -1]
    pages = torch.tensor([0, 3, 4, 6, 8], dtype=I32)
    assert flashjit.get_seq_lens(pages, torch.tensor([13, 8, 9, 6], dtype=I32), 16).tolist() == [45, 8, 25, 22]


def _append_args(layout="NHD", form="5d", dtype=torch.float16):
    b = paged_batch(16, layout, form, dtype, "cpu")
    seq_lens = flashjit.get_seq_lens(b["kv_indptr"], b["last"], 16)
    bi, pos = flashjit.get_batch_indices_positions(b["append_indptr"], seq_lens, b["nnz"])
    return dict(append_key=b["key"], append_value=b["value"], batch_indices=bi, positions=pos,
                paged_kv_cache=b["cache"], kv_indices=b["kv_indices"], kv_indptr=b["kv_indptr"],
                kv_last_page_len=b["last"], kv_layout=layout)


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


APPEND_MISTAKES = [
    ("kv_layout", lambda a: {"kv_layout": "NDH"}, r"^kv_layout: expected 'NHD' or 'HND', got 'NDH'"),
    ("key-f64", lambda a: {"append_key": a["append_key"].double()}, r"^append_key: expected dtype .*float64"),
    ("key-vs-cache-dtype", lambda a: {"append_key": a["append_key"].bfloat16()},
     r"^append_key: expected dtype torch.float16 \(the dtype of paged_kv_cache\), got torch.bfloat16"),
    ("value-dtype", lambda a: {"append_value": a["append_value"].float()}, r"^append_value: expected dtype torch.f"),
    ("key-rank", lambda a: {"append_key": a["append_key"][0]}, r"^append_key: expected 3 dimensions"),
    ("value-shape", lambda a: {"append_value": a["append_value"][:-1]}, r"^append_value: expected shape"),
    ("heads", lambda a: {"append_key": a["append_key"][:, :1], "append_value": a["append_value"][:, :1]},
     r"^paged_kv_cache: expected 1 heads x head_dim 16 \(as append_key\) in the NHD layout"),
    ("head_dim", lambda a: {"append_key": a["append_key"][..., :8], "append_value": a["append_value"][..., :8]},
     r"^paged_kv_cache: expected 2 heads x head_dim 8"),
    ("layout-mismatch", lambda a: {"kv_layout": "HND"}, r"^paged_kv_cache: .* HND layout.*is kv_layout right\?"),
    ("cache-4d", lambda a: {"paged_kv_cache": a["paged_kv_cache"][:, 0]}, r"^paged_kv_cache: expected 5 dim"),
    ("cache-not-kv", lambda a: {"paged_kv_cache": a["paged_kv_cache"][:, :1]},
     r"^paged_kv_cache: expected shape \[num_pages, 2, \.\.\.\]"),
    ("cache-triple", lambda a: {"paged_kv_cache": (a["paged_kv_cache"][:, 0],) * 3},
     r"^paged_kv_cache: expected a 5-D tensor or a \(k_cache, v_cache\) tuple, got a tuple of 3"),
    ("cache-dict", lambda a: {"paged_kv_cache": {}}, r"^paged_kv_cache: expected .* got dict"),
    ("tuple-k-rank", lambda a: {"paged_kv_cache": (a["paged_kv_cache"], a["paged_kv_cache"])},
     r"^paged_kv_cache\[0\]: expected 4 dimensions"),
    ("tuple-v-shape", lambda a: {"paged_kv_cache": (a["paged_kv_cache"][:, 0], a["paged_kv_cache"][1:, 1])},
     r"^paged_kv_cache\[1\]: expected shape"),
    ("tuple-v-dtype", lambda a: {"paged_kv_cache": (a["paged_kv_cache"][:, 0], a["paged_kv_cache"][:, 1].float())},
     r"^paged_kv_cache\[1\]: expected dtype torch.float16 \(the dtype of paged_kv_cache\[0\]\)"),
    ("tuple-v-device", lambda a: {"paged_kv_cache": (a["paged_kv_cache"][:, 0], _meta(a["paged_kv_cache"][:, 1]))},
     r"^paged_kv_cache\[1\]: expected a tensor on cpu \(where paged_kv_cache\[0\] is\), got meta"),
    ("batch_indices-int64", lambda a: {"batch_indices": a["batch_indices"].long()},
     r"^batch_indices: expected a 1-D int32 tensor, got torch.int64"),
    ("batch_indices-list", lambda a: {"batch_indices": a["batch_indices"].tolist()},
     r"^batch_indices: expected a 1-D int32 torch.Tensor, got list"),
    ("positions-length", lambda a: {"positions": a["positions"][1:]}, r"^positions: expected \d+ elements \(one"),
    ("positions-2d", lambda a: {"positions": a["positions"][None]}, r"^positions: expected a 1-D int32 tensor, got shape \(1, "),
    ("kv_indices-int64", lambda a: {"kv_indices": a["kv_indices"].long()}, r"^kv_indices: expected a 1-D int32 tensor, got torch.int64"),
    ("kv_indptr-float", lambda a: {"kv_indptr": a["kv_indptr"].float()}, r"^kv_indptr: expected a 1-D int32 tensor, got torch.float32"),
    ("kv_indptr-empty", lambda a: {"kv_indptr": a["kv_indptr"][:0]}, r"^kv_indptr: expected batch_size \+ 1"),
    ("last-length", lambda a: {"kv_last_page_len": a["kv_last_page_len"][1:]},
     r"^kv_last_page_len: expected 5 elements \(batch_size"),
    ("key-device", lambda a: {"append_key": _meta(a["append_key"])},
     r"^append_key: expected a tensor on cpu \(where paged_kv_cache is\), got meta"),
    ("kv_indices-device", lambda a: {"kv_indices": _meta(a["kv_indices"])}, r"^kv_indices: expected a tensor on cpu"),
]


@pytest.mark.parametrize("mutate, match", [pytest.param(m, r, id=n) for n, m, r in APPEND_MISTAKES])
def test_append_bad_input_names_the_argument_and_writes_nothing(mutate, match):
    args = _append_args()
    cache = args["paged_kv_cache"]
    before = cache.clone()
    args.update(mutate(args))
    with pytest.raises(ValueError, match=match):
        flashjit.append_paged_kv_cache(**args)
    assert torch.equal(before, cache)


@pytest.mark.parametrize("call, match", [
    (lambda ip, sl: (ip.long(), sl, 3), r"^append_indptr: expected a 1-D int32 tensor, got torch.int64"),
    (lambda ip, sl: (ip[:0], sl, 3), r"^append_indptr: expected batch_size \+ 1 elements"),
    (lambda ip, sl: (ip, sl[1:], 3), r"^seq_lens: expected 2 elements"),
    (lambda ip, sl: (ip, sl.float(), 3), r"^seq_lens: expected a 1-D int32 or int64 tensor, got torch.float32"),
    (lambda ip, sl: (ip, sl, -1), r"^nnz: expected a Python int >= 0, got -1"),
    (lambda ip, sl: (ip, sl, torch.tensor(3)), r"^nnz: expected a Python int"),
    (lambda ip, sl: (ip, _meta(sl), 3), r"^seq_lens: expected a tensor on cpu \(where append_indptr is\)"),
    (lambda ip, sl: (ip, sl, 3, torch.zeros(2, dtype=I32)), r"^batch_indices: expected 3 elements"),
    (lambda ip, sl: (ip, sl, 3, None, torch.zeros(3)), r"^positions: expected a 1-D int32 tensor, got torch.float32"),
])
def test_batch_indices_positions_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        flashjit.get_batch_indices_positions(*call(torch.tensor([0, 1, 3], dtype=I32), torch.tensor([4, 4])))


def test_seq_lens_bad_input():
    indptr, last = torch.tensor([0, 1, 3], dtype=I32), torch.tensor([4, 4], dtype=I32)
    with pytest.raises(ValueError, match=r"^page_size: expected a Python int >= 1, got 0"):
        flashjit.get_seq_lens(indptr, last, 0)
    with pytest.raises(ValueError, match=r"^kv_last_page_len: expected 2 elements"):
        flashjit.get_seq_lens(indptr, last[:1], 16)


# ---------------------------------------------------------------------------
# Merging attention states


def merge_reference(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64, v [L, N, H, D], s [L, N, H] (base 2): softmax over the states in natural log,
    an independent route from the kernels' exp2 with max subtraction."""
    logits = s.double() * math.log(2.0)
    merged = torch.logsumexp(logits, dim=1)
    w = torch.exp(logits - merged[:, None]).nan_to_num(0.0)  # all -inf: 0, not NaN
    out = (w[..., None] * v.double().nan_to_num(0.0).masked_fill(w[..., None] == 0, 0.0)).sum(1)
    return out, merged / math.log(2.0)


def assert_merge_close(v, s, ref_v, ref_s, dtype, num_states: int) -> None:
    """|v - ref| <= rtol |ref| + atol. Rounding the float32 result to dtype costs at most u|v|
    (u·tiny absolute in fp16's subnormal range). The float32 result: exp2 of s - max (a
    rounded difference), the division by the total and the product each move a weight by a
    few u32, and adding num_states weighted v's adds up to (num_states - 1)·u32 of their
    size; every term is at most max|v| and the weights sum to 1, so 4(n + 1)·u32·max|v|
    bounds it. rtol 2u leaves room for the float32 error riding on the rounding. The
    merged s = max + log2(total): log2 of a total off by n·u32 relative is off by at most
    n·u32/ln 2, and the final add rounds once (u32|s|)."""
    u = unit_roundoff(dtype)
    vmax = float(ref_v.abs().max()) if ref_v.numel() else 0.0
    v_atol = 4 * (num_states + 1) * U32 * vmax + u * torch.finfo(dtype).tiny
    empty = torch.isneginf(ref_s)
    assert v.dtype == dtype and s.dtype == torch.float32
    assert not v.isnan().any() and not s.isnan().any()
    assert torch.equal(torch.isneginf(s.cpu()), empty), "s = -inf exactly where every state is empty"
    assert (v.cpu()[empty] == 0).all(), "empty rows merge to v = 0"
    err = (v.cpu().double() - ref_v).abs()
    bound = v_atol + 2 * u * ref_v.abs()
    assert (err <= bound).all(), f"max err/bound {float((err / bound).max()):.3g}"
    s_err = (s.cpu().double() - ref_s)[~empty].abs()
    assert (s_err <= 4 * (num_states + 1) * U32 + 2 * U32 * ref_s[~empty].abs()).all()


def random_states(seq_len, num_states, heads, dim, dtype, device, seed=0):
    """s spread over tens of octaves (some weights vanish in float32), some states empty
    (s = -inf) with NaN in v, and rows where every state is empty."""
    g = torch.Generator().manual_seed(seed)
    v = (torch.randn(seq_len, num_states, heads, dim, generator=g) * 3).to(dtype)
    s = torch.randn(seq_len, num_states, heads, generator=g) * 8
    empty = torch.rand(seq_len, num_states, heads, generator=g) < 0.3
    empty[: seq_len // 4] = True
    s[empty] = float("-inf")
    v[empty] = float("nan")  # an empty segment's 0/0: must not leak into the merge
    return v.to(device), s.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_states", [1, 2, 7, 33])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_merge_states_matches_reference(dtype, num_states, device):
    v, s = random_states(16, num_states, 4, 64, dtype, device, seed=num_states)
    ref_v, ref_s = merge_reference(v.cpu(), s.cpu())
    out_v, out_s = flashjit.merge_states(v, s)
    assert out_v.shape == (16, 4, 64) and out_v.device == v.device
    assert_merge_close(out_v, out_s, ref_v, ref_s, dtype, num_states)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_merge_state_and_in_place(dtype, device):
    v, s = random_states(32, 2, 4, 128, dtype, device, seed=5)
    ref_v, ref_s = merge_reference(v.cpu(), s.cpu())
    out_v, out_s = flashjit.merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1])
    assert_merge_close(out_v, out_s, ref_v, ref_s, dtype, 2)
    mask = torch.arange(32, device=device) % 3 != 0
    iv, is_ = v[:, 0].clone(), s[:, 0].clone()
    flashjit.merge_state_in_place(iv, is_, v[:, 1], s[:, 1], mask=mask)
    # Same arithmetic as merge_state on the masked rows; the others keep their state bit for bit.
    assert torch.equal(iv[mask], out_v[mask]) and torch.equal(is_[mask], out_s[mask])
    assert torch.equal(iv[~mask].isnan(), v[:, 0][~mask].isnan())
    assert torch.equal(iv[~mask].nan_to_num(), v[:, 0][~mask].nan_to_num()) and torch.equal(is_[~mask], s[:, 0][~mask])
    flashjit.merge_state_in_place(v[:, 0], s[:, 0], v[:, 1], s[:, 1])  # a strided view: written through
    assert torch.equal(v[:, 0], out_v) and torch.equal(s[:, 0], out_s)


def test_merging_halves_equals_attention_over_all_keys():
    """The semantics, not just the formula: states of two key segments merge into attention over both."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(5, 2, 64, generator=g, dtype=torch.float64) for _ in range(3))
    full_o, full_lse = flashjit.attention_reference(q, torch.cat([k, k]), torch.cat([v, -v]))
    oa, sa = flashjit.attention_reference(q, k, v)
    ob, sb = flashjit.attention_reference(q, k, -v)
    mo, ms = flashjit.merge_state(oa.float(), sa.float(), ob.float(), sb.float())
    torch.testing.assert_close(mo.double(), full_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ms.double(), full_lse, atol=1e-5, rtol=1e-6)
    no_states = flashjit.merge_states(torch.zeros(3, 0, 2, 8), torch.zeros(3, 0, 2))
    assert (no_states[0] == 0).all() and torch.isneginf(no_states[1]).all()


V, S = torch.randn(4, 3, 8).half(), torch.zeros(4, 3)
merge, in_place, states = flashjit.merge_state, flashjit.merge_state_in_place, flashjit.merge_states
MERGE_MISTAKES = [
    ("v_a-rank", lambda: merge(V[0], S, V, S), r"^v_a: expected 3 dimensions"),
    ("v_a-list", lambda: merge([], S, V, S), r"^v_a: expected a torch.Tensor, got list"),
    ("v_a-int", lambda: merge(V.int(), S, V, S), r"^v_a: expected dtype float16, bfloat16 or float32, got torch.int32"),
    ("v_b-shape", lambda: merge(V, S, V[:2], S), r"^v_b: expected shape \(4, 3, 8\) \(as v_a\)"),
    ("v_b-dtype", lambda: merge(V, S, V.float(), S),
     r"^v_b: expected dtype torch.float16 \(the dtype of v_a\), got torch.float32"),
    ("s_a-shape", lambda: merge(V, S[:, 0], V, S), r"^s_a: expected shape \(4, 3\) \(v_a's shape without head_dim\)"),
    ("s_b-int", lambda: merge(V, S, V, S.int()), r"^s_b: expected a float32 log-sum-exp"),
    ("s_b-device", lambda: merge(V, S, V, _meta(S)), r"^s_b: expected a tensor on cpu \(where v_a is\), got meta"),
    ("in-place-s-f16", lambda: in_place(V, S.half(), V, S),
     r"^s: expected dtype torch.float32 \(it is updated in place\), got torch.float16"),
    ("in-place-v_other", lambda: in_place(V, S, V.bfloat16(), S), r"^v_other: expected dtype"),
    ("mask-int", lambda: in_place(V, S, V, S, mask=torch.ones(4, dtype=I32)),
     r"^mask: expected a bool tensor of shape \(4,\) \(seq_len, from v\), got torch.int32"),
    ("mask-length", lambda: in_place(V, S, V, S, mask=torch.ones(3, dtype=torch.bool)), r"^mask: expected"),
    ("mask-device", lambda: in_place(V, S, V, S, mask=_meta(S[:, 0].bool())), r"^mask: expected a tensor on cpu"),
    ("states-rank", lambda: states(V, S), r"^v: expected 4 dimensions"),
    ("states-s-shape", lambda: states(V[None], S[None, :, :2]), r"^s: expected shape \(1, 4, 3\)"),
    ("states-s-device", lambda: states(V[None], _meta(S[None])), r"^s: expected a tensor on cpu \(where v is\)"),
]


@pytest.mark.parametrize("call, match", [pytest.param(c, m, id=n) for n, c, m in MERGE_MISTAKES])
def test_merge_bad_input_names_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.gpu
def test_no_host_sync_and_cuda_graph_capture():
    """Every op here is a device op: sync debug mode raises on a host sync, and a captured
    graph replays on new values written into the captured inputs."""
    b = paged_batch(16, "HND", "5d", torch.bfloat16, "cuda", seed=9)
    seq_lens = flashjit.get_seq_lens(b["kv_indptr"], b["last"], 16)
    v, s = random_states(64, 4, 8, 128, torch.bfloat16, "cuda", seed=9)

    def step():
        bi, pos = flashjit.get_batch_indices_positions(b["append_indptr"], seq_lens, b["nnz"])
        flashjit.append_paged_kv_cache(b["key"], b["value"], bi, pos, b["cache"], b["kv_indices"], b["kv_indptr"],
                                       b["last"], kv_layout="HND")
        return flashjit.merge_states(v, s)

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside capture, as torch recommends
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_v, out_s = step()
    b["key"].copy_(torch.randn_like(b["key"]))
    v.copy_(torch.randn_like(v))
    graph.replay()
    torch.cuda.synchronize()
    bi, pos = flashjit.get_batch_indices_positions(b["append_indptr"], seq_lens, b["nnz"])
    k_cache = b["cache"][:, 0].transpose(1, 2)  # HND -> [pages, page_size, heads, dim]
    page = b["kv_indices"][b["kv_indptr"][bi.long()] + pos // 16]
    assert torch.equal(k_cache[page.long(), (pos % 16).long()], b["key"]), "the replay wrote the new keys"
    eager = flashjit.merge_states(v, s)
    assert torch.equal(out_v, eager[0]) and torch.equal(out_s, eager[1])
