"""Attention sinks on a GPU: every attention op with sinks= against the float64
reference within its profile (LSE too), bf16, head dims 64/128/256, GQA 8/2,
plain and sliding window (window_left=127, as gpt-oss): random sinks, sinks
that dominate every row (the output, divided by the factor the sink takes
off, still within the profile), sinks of -inf bit for bit equal to none,
rows without keys (o = 0, lse = the sink), split-KV (the merge counts the
sink once), a CUDA graph replayed after the sinks tensor changed in place,
batch-invariant mode. Only configurations the sweep builds (sweep.all_specs,
test_sinks.py checks used_specs() against it)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import flashjit
from flashjit import jit
from flashjit.error_model import evaluate_lse, measure, profile, sink_absmax
from flashjit.ops import _calls
from flashjit.reference import ragged_reference
from sweep import HEAD_DIMS, fa3_runs_here, path_kwargs, spec_for, spec_path
from test_gpu_attention import RAGGED_BATCHES, poison_allocator, randn, skip_unless_runs
from test_gpu_paged import DECODE_LENS, PREFILL_KV, PREFILL_QO, PagedBatch, indptr_of, workspace

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
HEADS = (8, 2)
WINDOW = 127
PREFILL_PATHS = ["cc", "fa2", "fa3"]
DECODE_PATHS = ["cc", "tc"]
KINDS = ["randn", "dominant"]
# op -> (its paths, its variants): single ops' "window" returns no LSE (the sweep builds no window+LSE single op).
OPS = {"single_prefill": (PREFILL_PATHS, ["lse", "window"]), "single_decode": (["cc"], ["lse", "window"]),
       "batch_prefill_ragged": (PREFILL_PATHS, ["plain", "window"]),
       "batch_prefill_paged": (PREFILL_PATHS, ["plain"]), "batch_decode_paged": (DECODE_PATHS, ["plain", "window"])}
SINGLE_SHAPES = [(37, 300), (16, 5000)]  # (qo_len, kv_len); 5000 keys split across CTAs
SPLITS = {"batch_decode_paged": ([20000, 33001, 5], {"fixed_split_size": 40}),
          "batch_prefill_ragged": ([30000, 100, 9000], {"fixed_split_size": 512}),
          "batch_prefill_paged": ([30000, 100, 9000], {"fixed_split_size": 8})}


def case_spec(op: str, path: str, head_dim: int, causal: bool = False, variant: str = "plain"):
    if op == "batch_decode_paged":
        return spec_for(op, BF16, head_dim, False, variant, tensor_cores=path == "tc")
    return spec_for(op, BF16, head_dim, causal, variant, **spec_path(path))


def used_specs() -> list:
    """Every configuration these tests run (fa3 included), for the check against sweep.all_specs()."""
    specs = [case_spec(op, path, d, causal, variant) for op, (paths, variants) in OPS.items() for path in paths
             for d in HEAD_DIMS for causal in (False, True) for variant in variants]
    specs += [case_spec(op, path, 128, True) for op in SPLITS for path in OPS[op][0]]
    specs += [case_spec(op, path, 128, True, variant) for op, variant in (("batch_prefill_ragged", "plain"),
                                                                          ("single_prefill", "lse"))
              for path in ("fa2", "fa3")]
    return list(dict.fromkeys(specs))


def make_sinks(kind: str, heads: int = HEADS[0]) -> torch.Tensor:
    """randn: N(0, 1); dominant: 30 (e^30 against row sums of e^11 at most here); none: -inf; mixed: randn, -inf
    on even heads."""
    if kind == "dominant":
        return torch.full((heads,), 30.0, device="cuda")
    if kind == "none":
        return torch.full((heads,), -math.inf, device="cuda")
    sinks = torch.randn(heads, device="cuda")
    if kind == "mixed":
        sinks[::2] = -math.inf
    return sinks


@dataclass
class Problem:
    """What check() needs of a run: the configuration, the packed NHD inputs, the lengths."""
    spec: object
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    qo_lens: list
    kv_lens: list
    causal: bool = False
    window: int = -1

    def reference(self, sinks):
        return ragged_reference(self.q, self.k, self.v, indptr_of(self.qo_lens), indptr_of(self.kv_lens),
                                causal=self.causal, window_left=self.window, sinks=sinks)


class Case:
    """One op's inputs and (batch ops) planned wrapper, per request's qo/kv lengths."""

    def __init__(self, op, path, head_dim, qo_lens, kv_lens, causal=False, variant="plain", plan_kw=None,
                 batch_invariant=False):
        skip_unless_runs(path)
        self.op, self.path = op, path
        causal = causal and op not in ("single_decode", "batch_decode_paged")
        window = WINDOW if variant == "window" else -1
        self.lse = not (op.startswith("single") and variant == "window")
        num_qo, num_kv = HEADS
        q = randn(sum(qo_lens), num_qo, head_dim, dtype=BF16)
        self.kw = {"use_tensor_cores": True, "backend": "fa2"} if path == "tc" else path_kwargs(path)
        if op in ("batch_prefill_paged", "batch_decode_paged"):
            self.batch = PagedBatch(kv_lens, 16, num_kv, head_dim, BF16)
            k, v = self.batch.k, self.batch.v
        else:
            k, v = (randn(sum(kv_lens), num_kv, head_dim, dtype=BF16) for _ in range(2))
        self.problem = Problem(case_spec(op, path, head_dim, causal, variant), q, k, v, list(qo_lens), list(kv_lens),
                               causal, window)
        common = dict(q_data_type=BF16, window_left=window, **(plan_kw or {}))
        if op == "batch_decode_paged":
            self.wrapper = flashjit.BatchDecodeWithPagedKVCacheWrapper(workspace(), use_tensor_cores=path == "tc")
            self.wrapper.plan(self.batch.indptr, self.batch.indices, self.batch.last, num_qo, num_kv, head_dim, 16,
                              **common)
        elif op == "batch_prefill_paged":
            self.wrapper = flashjit.BatchPrefillWithPagedKVCacheWrapper(workspace(), backend=self.kw["backend"])
            self.wrapper.plan(torch.tensor(indptr_of(qo_lens), dtype=torch.int32), self.batch.indptr,
                              self.batch.indices, self.batch.last, num_qo, num_kv, head_dim, 16, causal=causal,
                              use_tensor_cores=self.kw["use_tensor_cores"], **common)
        elif op == "batch_prefill_ragged":
            self.wrapper = flashjit.BatchPrefillWithRaggedKVCacheWrapper(workspace(), backend=self.kw["backend"])
            self.wrapper.plan(torch.tensor(indptr_of(qo_lens)), torch.tensor(indptr_of(kv_lens)), num_qo, num_kv,
                              head_dim, causal=causal, use_tensor_cores=self.kw["use_tensor_cores"],
                              batch_invariant=batch_invariant or None, **common)

    def run(self, sinks):
        """(out [rows, H, D], lse [rows, H] or None) with these sinks (None: none), into poisoned memory."""
        p = self.problem
        poison_allocator()
        if self.op == "single_prefill":
            res = flashjit.single_prefill_with_kv_cache(p.q, p.k, p.v, causal=p.causal, window_left=p.window,
                                                        return_lse=self.lse, sinks=sinks, **self.kw)
        elif self.op == "single_decode":
            res = flashjit.single_decode_with_kv_cache(p.q[0], p.k, p.v, window_left=p.window, return_lse=self.lse,
                                                       sinks=sinks)
            res = tuple(t[None] for t in res) if self.lse else res[None]
        elif self.op == "batch_prefill_ragged":
            res = self.wrapper.run(p.q, p.k, p.v, return_lse=True, sinks=sinks)
        else:
            res = self.wrapper.run(p.q, self.batch.cache, return_lse=True, sinks=sinks)
        torch.cuda.synchronize()
        return res if self.lse else (res, None)

    def single_splits(self) -> int:
        """How many chunks a single op's launch splits the keys into (ops._calls' policy)."""
        p = self.problem
        module = jit.get_module(p.spec)
        group = HEADS[0] // HEADS[1]
        ctas = -(-p.qo_lens[0] * group // module.rows_per_cta) * HEADS[1]
        return _calls.single_request_split(p.kv_lens[0], ctas, _calls.resident_ctas(module, p.q.device))[0]


def check(p: Problem, sinks, out, lse, report, what, dominant=False, **info):
    """Within the profile (the sinks' terms included), LSE too; rows without keys
    give o = 0; with a dominant sink, o divided by the factor the sink takes off
    (from the float64 LSEs with and without it) is within the profile of the
    output without sinks."""
    ref, ref_lse = p.reference(sinks)
    ref0, lse0 = p.reference(None)
    kv_len, sm_scale = max(max(p.kv_lens), 1), 1 / math.sqrt(p.q.shape[-1])
    tol = flashjit.tolerance(p.spec, q=p.q, k=p.k, v=p.v, kv_len=kv_len, sm_scale=sm_scale, sinks=sinks)
    assert not torch.isnan(out).any(), f"{what}: NaN in the output (unwritten or invalid)"
    row = {"config": p.spec.name, "what": what, "ratio": tol.assert_close(out, ref, what), "rtol": tol.rtol,
           "atol": tol.atol, "max_err": float((out.double() - ref).abs().max()), **info}
    if lse is not None:
        _, logit_absmax = measure(p.q, p.k, p.v, sm_scale)
        lse_tol = evaluate_lse(profile(p.spec), kv_len=kv_len, logit_absmax=logit_absmax,
                               sink_absmax=sink_absmax(sinks))
        row["lse_ratio"] = lse_tol.assert_close(lse, ref_lse, f"{what} LSE")
    empty = torch.isneginf(lse0)
    assert (out[empty] == 0).all(), f"{what}: a row without keys is not 0"
    if dominant:
        factor = torch.where(empty, 1.0, torch.exp2(lse0 - ref_lse))
        assert float(factor[~empty].max()) < 1e-6, "the sink does not dominate"
        row["scaled_ratio"] = tol.assert_close(out.double() / factor[..., None], ref0, f"{what} / sink factor")
    report.append(row)


def run_and_check(case, kind, report, what, **info):
    sinks = make_sinks(kind)
    out, lse = case.run(sinks)
    check(case.problem, sinks, out, lse, report, what, dominant=kind == "dominant", kind=kind, **info)
    return sinks, out, lse


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("qo_len,kv_len", SINGLE_SHAPES, ids=lambda n: str(n))
@pytest.mark.parametrize("variant", ["lse", "window"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("path", PREFILL_PATHS)
def test_single_prefill(prewarmed, error_report, path, head_dim, causal, variant, qo_len, kv_len, kind):
    case = Case("single_prefill", path, head_dim, [qo_len], [kv_len], causal, variant)
    run_and_check(case, kind, error_report, "single_prefill_sinks", shape=f"{qo_len}x{kv_len}")
    if kv_len == 5000:
        assert case.single_splits() > 1, "the launch was meant to split its keys"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("kv_len", [255, 5000])
@pytest.mark.parametrize("variant", ["lse", "window"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_single_decode(prewarmed, error_report, head_dim, variant, kv_len, kind):
    case = Case("single_decode", "cc", head_dim, [1], [kv_len], variant=variant)
    run_and_check(case, kind, error_report, "single_decode_sinks", shape=f"1x{kv_len}")
    if kv_len == 5000:
        assert case.single_splits() > 1, "the launch was meant to split its keys"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch", ["mixed", "empty_kv"])
@pytest.mark.parametrize("variant", ["plain", "window"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("path", PREFILL_PATHS)
def test_batch_prefill_ragged(prewarmed, error_report, path, head_dim, causal, variant, batch, kind):
    """empty_kv: requests without keys, whose rows give o = 0 and lse = sinks * log2(e)."""
    case = Case("batch_prefill_ragged", path, head_dim, *RAGGED_BATCHES[batch], causal, variant)
    run_and_check(case, kind, error_report, "ragged_sinks", shape=batch)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("path", PREFILL_PATHS)
def test_batch_prefill_paged(prewarmed, error_report, path, head_dim, causal, kind):
    """Causal: the request of 300 queries against 16 keys has rows that see no key."""
    case = Case("batch_prefill_paged", path, head_dim, PREFILL_QO, PREFILL_KV, causal)
    run_and_check(case, kind, error_report, "paged_prefill_sinks")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("variant", ["plain", "window"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("path", DECODE_PATHS)
def test_batch_decode_paged(prewarmed, error_report, path, head_dim, variant, kind):
    """DECODE_LENS holds a request without keys: o = 0, lse = sinks * log2(e)."""
    case = Case("batch_decode_paged", path, head_dim, [1] * len(DECODE_LENS), DECODE_LENS, variant=variant)
    sinks, _, lse = run_and_check(case, kind, error_report, "paged_decode_sinks")
    empty = DECODE_LENS.index(0)
    assert torch.allclose(lse[empty].double(), sinks.double() / math.log(2), rtol=1e-6, atol=0)


def _op_paths(ops):
    return [pytest.param(op, path, id=f"{op}-{path}") for op in ops for path in OPS[op][0]]


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("op,path", _op_paths(OPS))
def test_sinks_of_minus_inf_are_no_sinks(prewarmed, op, path, head_dim):
    """Bit for bit, out and LSE, split launches included; with -inf on some heads, those heads."""
    lens = {"single_prefill": ([16], [5000]), "single_decode": ([1], [5000]),
            "batch_decode_paged": ([1] * len(DECODE_LENS), DECODE_LENS),
            "batch_prefill_paged": (PREFILL_QO, PREFILL_KV), "batch_prefill_ragged": RAGGED_BATCHES["mixed"]}[op]
    case = Case(op, path, head_dim, *lens, causal=True, variant=OPS[op][1][0])
    out, lse = case.run(None)
    out_inf, lse_inf = case.run(make_sinks("none"))
    assert torch.equal(out_inf, out) and torch.equal(lse_inf, lse)
    mixed = make_sinks("mixed")
    out_mixed, lse_mixed = case.run(mixed)
    none = torch.isneginf(mixed)
    assert torch.equal(out_mixed[:, none], out[:, none]) and torch.equal(lse_mixed[:, none], lse[:, none])
    assert not torch.equal(lse_mixed[:, ~none], lse[:, ~none]), "the finite sinks changed nothing"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op,path", _op_paths(SPLITS))
def test_split_kv_counts_the_sink_once(prewarmed, error_report, op, path, kind):
    kv_lens, plan_kw = SPLITS[op]
    qo_lens = [1] * len(kv_lens) if op == "batch_decode_paged" else [3, 1, 20]
    case = Case(op, path, 128, qo_lens, kv_lens, causal=True, plan_kw=plan_kw)
    work = case.wrapper._plan.work
    assert work.kv_chunk > 0 and work.merge_indptr is not None, "the plan was meant to split"
    run_and_check(case, kind, error_report, "split_kv_sinks", shape=str(kv_lens))


@pytest.mark.parametrize("path", DECODE_PATHS)
def test_cuda_graph_replays_with_the_sinks_written_in_place(prewarmed, error_report, path):
    """Captured once with a sinks tensor; values written into it, and plans of
    new lengths (long enough to split, then a request without keys), reach
    each replay: bit for bit an eager run, within the profile."""
    head_dim, (num_qo, num_kv), page_size, bsz, num_pages = 128, HEADS, 16, 4, 4096
    cache = randn(num_pages, 2, page_size, num_kv, head_dim, dtype=BF16)
    page_buf = torch.zeros(num_pages, dtype=torch.int32, device="cuda")
    wrapper = flashjit.BatchDecodeWithPagedKVCacheWrapper(workspace(), use_cuda_graph=True,
                                                          use_tensor_cores=path == "tc",
                                                          paged_kv_indices_buffer=page_buf)
    q_buf, sinks = randn(bsz, num_qo, head_dim, dtype=BF16), make_sinks("randn")
    out_buf, lse_buf = torch.empty_like(q_buf), torch.empty(bsz, num_qo, device="cuda")
    k_all, v_all = (cache[:, i].flatten(0, 1) for i in (0, 1))

    def plan(kv_lens):
        """Plans kv_lens over random pages; returns the Problem of the reference."""
        pages = [math.ceil(n / page_size) for n in kv_lens]
        indices = torch.randperm(num_pages, device="cuda")[:sum(pages)].to(torch.int32)
        last = torch.tensor([(n - 1) % page_size + 1 if n else 0 for n in kv_lens], dtype=torch.int32)
        wrapper.plan(torch.tensor(indptr_of(pages), dtype=torch.int32), indices, last, num_qo, num_kv, head_dim,
                     page_size, q_data_type=BF16)
        starts = indptr_of(pages)
        rows = torch.cat([(indices[starts[r]:starts[r + 1]].long()[:, None] * page_size
                           + torch.arange(page_size, device="cuda")).flatten()[:n] for r, n in enumerate(kv_lens)])
        return Problem(case_spec("batch_decode_paged", path, head_dim), q_buf, k_all[rows], v_all[rows], [1] * bsz,
                       list(kv_lens))

    plan([100, 7, 300, 64])
    wrapper.run(q_buf, cache, out=out_buf, lse=lse_buf, return_lse=True, sinks=sinks)  # checked outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q_buf, cache, out=out_buf, lse=lse_buf, return_lse=True, sinks=sinks)
    for kv_lens, kind in (([100, 7, 300, 64], "dominant"), ([30000, 1, 12000, 17], "randn"),
                          ([30000, 1, 12000, 17], "dominant"), ([0, 5000, 33, 1], "mixed"),
                          ([0, 5000, 33, 1], "none")):
        problem = plan(kv_lens)
        sinks.copy_(make_sinks(kind))
        q_buf.copy_(randn(bsz, num_qo, head_dim, dtype=BF16))
        out_buf.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager_out, eager_lse = wrapper.run(q_buf, cache, return_lse=True, sinks=sinks)
        assert torch.equal(out_buf, eager_out) and torch.equal(lse_buf, eager_lse), f"{kind} {kv_lens}"
        if kind == "none":
            assert torch.equal(out_buf, wrapper.run(q_buf, cache))
        check(problem, sinks, out_buf, lse_buf, error_report, "cuda_graph_sinks", dominant=kind == "dominant",
              kind=kind, shape=str(kv_lens))


@pytest.mark.parametrize("kind", KINDS)
def test_batch_invariant_mode_with_sinks(prewarmed, error_report, kind):
    """A request's output and LSE alone and among others, and from single
    prefill in the mode, bit for bit; within the profile."""
    path = "fa3" if fa3_runs_here() else "fa2"
    sinks = make_sinks(kind)
    alone = Case("batch_prefill_ragged", path, 128, [700], [3000], causal=True, batch_invariant=True)
    crowd = Case("batch_prefill_ragged", path, 128, [5, 700, 90], [40, 3000, 5000], causal=True,
                 batch_invariant=True)
    a, c = alone.problem, crowd.problem
    c.q[5:705], c.k[40:3040], c.v[40:3040] = a.q, a.k, a.v
    out, lse = alone.run(sinks)
    out_crowd, lse_crowd = crowd.run(sinks)
    assert torch.equal(out_crowd[5:705], out) and torch.equal(lse_crowd[5:705], lse)
    single, single_lse = flashjit.single_prefill_with_kv_cache(a.q, a.k, a.v, causal=True, return_lse=True,
                                                               batch_invariant=True, sinks=sinks, **path_kwargs(path))
    assert torch.equal(single, out) and torch.equal(single_lse, lse)
    dominant = kind == "dominant"
    check(a, sinks, out, lse, error_report, "batch_invariant_sinks", dominant=dominant, kind=kind)
    check(c, sinks, out_crowd, lse_crowd, error_report, "batch_invariant_sinks", dominant=dominant, kind=kind)
