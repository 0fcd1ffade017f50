"""MultiLevelCascadeAttentionWrapper on CPU: its composition (which level gets
which page table, causal on the last level only, the merge of every level into
the last one's state, graph mode's fixed buffers) with a stand-in level wrapper
that computes each level's attention in float64 from the same page tables, and
every bad input the cascade checks before any level is planned."""

from __future__ import annotations

import math

import pytest
import torch

import flashjit
from flashjit.ops import cascade
from flashjit.reference import attention_reference
from test_bad_input_wrappers import _workspace
from test_torch_ops import _compiled_graphs, _targets, host_launch, no_compile  # noqa: F401 (fixtures)

PAGE, HEADS, DIM = 4, (4, 2), 16


class LevelStandIn:
    """A paged prefill wrapper's plan()/run() contract in float64 on CPU: run()
    returns (out in q's dtype, base-2 LSE in float32), writes out= / lse= when given."""

    created: list = []

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, backend="auto", strict=None,
                 **buffers):
        self.use_cuda_graph, self.buffers, self.backend = use_cuda_graph, buffers, backend
        self.plans, self.runs, self.plan_error = [], [], None
        LevelStandIn.created.append(self)

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, **kw):
        if self.plan_error is not None:
            raise self.plan_error
        self.plans.append(dict(qo=qo_indptr.tolist(), kv=kv_indptr.tolist(), indices=kv_indices.tolist(),
                               last=last_page_len.tolist(), page_size=page_size, **kw))

    def run(self, q, cache, out=None, lse=None, return_lse=False):
        assert return_lse
        plan = self.plans[-1]
        self.runs.append((out, lse))
        outs, lses = [], []
        for r in range(len(plan["qo"]) - 1):
            pages = plan["indices"][plan["kv"][r]:plan["kv"][r + 1]]
            n = (len(pages) - 1) * plan["page_size"] + plan["last"][r] if pages else 0
            k = cache[pages, 0].reshape(-1, *cache.shape[-2:])[:n]
            v = cache[pages, 1].reshape(-1, *cache.shape[-2:])[:n]
            o, s = attention_reference(q[plan["qo"][r]:plan["qo"][r + 1]], k, v, causal=plan["causal"],
                                       sm_scale=plan["sm_scale"], logits_soft_cap=plan["logits_soft_cap"])
            outs.append(o.nan_to_num(0.0))
            lses.append(s)
        o, s = torch.cat(outs).to(q.dtype), torch.cat(lses).float()
        if out is None:
            return o, s
        out.copy_(o)
        lse.copy_(s)
        return out, lse


@pytest.fixture
def stand_in(monkeypatch):
    LevelStandIn.created = []
    monkeypatch.setattr(cascade.MultiLevelCascadeAttentionWrapper, "_level_wrapper", LevelStandIn)
    return LevelStandIn


def indptr(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


class Levels:
    """Requests in groups: level 0 pages shared by everyone, level 1 (3 levels) pages
    shared by a group, the last level each request's own; each level's keys, in
    order, and each request's concatenation of them."""

    def __init__(self, qo_lens, own_lens, shared_len=13, group_lens=None, groups=None, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.cache = torch.randn(200, 2, PAGE, HEADS[1], DIM, generator=gen, dtype=torch.float64)
        free = iter(torch.randperm(200, generator=gen).tolist())
        self.qo_lens, batch = qo_lens, len(qo_lens)
        tokens = sum(qo_lens)
        groups = groups or [batch]
        level_lens = [[shared_len]] + ([group_lens] if group_lens else []) + [own_lens]
        level_qo = [[tokens]]
        if group_lens:
            starts = [sum(groups[:g]) for g in range(len(groups))]
            level_qo.append([sum(qo_lens[s:s + n]) for s, n in zip(starts, groups)])
        level_qo.append(qo_lens)
        self.qo, self.kv, self.indices, self.last, self.keys = [], [], [], [], []
        for lens, qo in zip(level_lens, level_qo):
            pages = [[next(free) for _ in range(math.ceil(n / PAGE))] for n in lens]
            self.qo.append(indptr(qo))
            self.kv.append(indptr([len(p) for p in pages]))
            self.indices.append(torch.tensor([p for ps in pages for p in ps], dtype=torch.int32))
            self.last.append(torch.tensor([(n - 1) % PAGE + 1 if n else 1 for n in lens], dtype=torch.int32))
            self.keys.append([self.cache[ps, :].transpose(0, 1).reshape(2, -1, HEADS[1], DIM)[:, :n]
                              for ps, n in zip(pages, lens)])
        owner = [g for g, n in enumerate(groups) for _ in range(n)]
        self.requests = []  # (k, v) of request r: every level's keys in level order
        for r in range(batch):
            parts = [self.keys[0][0]] + ([self.keys[1][owner[r]]] if group_lens else []) + [self.keys[-1][r]]
            kv = torch.cat(parts, dim=1)
            self.requests.append((kv[0], kv[1]))

    def plan_args(self):
        return self.qo, self.kv, self.indices, self.last

    def reference(self, q, causal):
        outs, start = [], 0
        for (k, v), n in zip(self.requests, self.qo_lens):
            outs.append(attention_reference(q[start:start + n], k, v, causal=causal)[0])
            start += n
        return torch.cat(outs)


CASES = {  # name -> (qo_lens, own key lengths, Levels kwargs)
    "decode_2_levels": ([1] * 5, [1, 9, 4, 17, 0], {}),
    "chunks_2_levels": ([4] * 4, [4, 11, 8, 30], {}),
    "decode_3_levels": ([1] * 6, [3, 1, 8, 0, 5, 12], dict(group_lens=[7, 0, 10], groups=[2, 1, 3])),
    "chunks_3_levels": ([4] * 5, [4, 5, 9, 16, 7], dict(group_lens=[12, 3], groups=[3, 2])),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(CASES))
def test_levels_merge_to_attention_over_the_concatenated_keys(stand_in, case, causal):
    qo_lens, own, kw = CASES[case]
    levels = Levels(qo_lens, own, **kw)
    num_levels = len(levels.qo)
    w = flashjit.MultiLevelCascadeAttentionWrapper(num_levels, torch.empty(16, dtype=torch.uint8))
    w.plan(*levels.plan_args(), *HEADS, DIM, PAGE, causal=causal, q_data_type=torch.float32)
    assert [p["causal"] for p in w._batch_prefill_wrappers[0].plans + w._batch_prefill_wrappers[-1].plans] \
        == [False, causal]
    assert all(p["window_left"] == -1 for lvl in stand_in.created for p in lvl.plans)
    for level, wrapper in enumerate(stand_in.created):
        assert wrapper.plans[-1]["qo"] == levels.qo[level].tolist()
        assert wrapper.plans[-1]["indices"] == levels.indices[level].tolist()
    q = torch.randn(sum(qo_lens), HEADS[0], DIM)
    out = w.run(q, levels.cache)
    torch.testing.assert_close(out.double(), levels.reference(q, causal), rtol=1e-5, atol=1e-5)


def test_graph_mode_writes_the_same_buffers_on_every_run(stand_in):
    qo_lens, own, kw = CASES["decode_3_levels"]
    levels = Levels(qo_lens, own, **kw)
    page_bufs = [torch.zeros(64, dtype=torch.int32) for _ in range(3)]
    w = flashjit.MultiLevelCascadeAttentionWrapper(3, torch.empty(16, dtype=torch.uint8), use_cuda_graph=True,
                                                   paged_kv_indices_buf_arr=page_bufs)
    assert w.is_cuda_graph_enabled
    assert [lvl.use_cuda_graph for lvl in stand_in.created] == [True] * 3
    assert [lvl.buffers["paged_kv_indices_buf"] is buf for lvl, buf in zip(stand_in.created, page_bufs)] == [True] * 3
    w.plan(*levels.plan_args(), *HEADS, DIM, PAGE, q_data_type=torch.float32)
    addresses = set()
    for seed in range(3):
        q = torch.randn(sum(qo_lens), HEADS[0], DIM, generator=torch.Generator().manual_seed(seed))
        out = w.run(q, levels.cache)
        torch.testing.assert_close(out.double(), levels.reference(q, False), rtol=1e-5, atol=1e-5)
        addresses.add(out.data_ptr())
        assert all(o is not None and lse is not None for lvl in stand_in.created for o, lse in lvl.runs)
    assert len(addresses) == 1
    with pytest.raises(ValueError, match=r"^q: expected at most 6 rows"):
        w.run(torch.zeros(7, HEADS[0], DIM), levels.cache)


def test_run_before_plan_and_unsupported_options(stand_in):
    levels = Levels(*CASES["decode_2_levels"][:2])
    w = flashjit.MultiLevelCascadeAttentionWrapper(2, torch.empty(16, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match=r"run\(\) called before plan\(\)"):
        w.run(torch.zeros(5, HEADS[0], DIM), levels.cache)
    args = (*levels.plan_args(), *HEADS, DIM, PAGE)
    with pytest.raises(NotImplementedError, match=r"^window_left=64: a sliding window spans levels"):
        w.plan(*args, window_left=64)
    with pytest.raises(NotImplementedError, match=r"^pos_encoding_mode='ROPE_LLAMA'"):
        w.plan(*args, pos_encoding_mode="ROPE_LLAMA")
    with pytest.raises(NotImplementedError, match=r"^reset_workspace_buffer"):
        w.reset_workspace_buffer(torch.empty(16, dtype=torch.uint8), [])
    w.prewarm_paged_kv_stride_variant()
    with pytest.raises(ValueError, match=r"^variant: expected 'independent'"):
        w.prewarm_paged_kv_stride_variant("shared")
    assert not any(lvl.plans for lvl in stand_in.created)


def replaced(arrays, level, value):
    out = list(arrays)
    out[level] = value
    return out


def bad_plans(levels):
    qo, kv, indices, last = levels.plan_args()
    return [
        (dict(qo_indptr_arr=qo + [qo[-1]]), r"^qo_indptr_arr: expected 2 entries \(num_levels\), got 3"),
        (dict(paged_kv_indices_arr=indices[:1]), r"^paged_kv_indices_arr: expected 2 entries \(num_levels\), got 1"),
        (dict(paged_kv_last_page_len=tuple(last[:1])), r"^paged_kv_last_page_len: expected 2 entries"),
        (dict(paged_kv_indptr_arr=kv[0]), r"^paged_kv_indptr_arr: expected a list of 2 tensors"),
        (dict(paged_kv_indices_arr=replaced(indices, 1, indices[1][:-1])),
         r"^paged_kv_indices_arr\[1\]: expected at least \d+ elements \(the pages paged_kv_indptr_arr\[1\]\[-1\]"),
        (dict(paged_kv_indices_arr=replaced(indices, 0, indices[0].long())),
         r"^paged_kv_indices_arr\[0\]: expected a 1-D int32 tensor"),
        (dict(paged_kv_indptr_arr=replaced(kv, 1, kv[1][:-1])),
         r"^paged_kv_indptr_arr\[1\]: expected 6 elements \(the 5 requests of qo_indptr_arr\[1\], plus one\), got 5"),
        (dict(paged_kv_indptr_arr=replaced(kv, 1, kv[1].flip(0))),
         r"^paged_kv_indptr_arr\[1\]: expected non-decreasing offsets"),
        (dict(qo_indptr_arr=replaced(qo, 1, qo[1] * 2)),
         r"^qo_indptr_arr\[1\]: expected its last element to be 5 \(as in qo_indptr_arr\[0\]"),
        (dict(paged_kv_last_page_len=replaced(last, 1, last[1][:-1])),
         r"^paged_kv_last_page_len\[1\]: expected 5 elements \(one per request of qo_indptr_arr\[1\]\)"),
        (dict(paged_kv_last_page_len=replaced(last, 0, torch.tensor([PAGE + 1], dtype=torch.int32))),
         r"^paged_kv_last_page_len\[0\]: expected 1\.\.4 \(page_size\)"),
        (dict(page_size=0), r"^page_size: expected a positive int"),
    ]


@pytest.mark.parametrize("index", range(12))
def test_bad_levels_are_refused_before_any_level_plans(stand_in, index):
    levels = Levels(*CASES["decode_2_levels"][:2])
    w = flashjit.MultiLevelCascadeAttentionWrapper(2, torch.empty(16, dtype=torch.uint8))
    qo, kv, indices, last = levels.plan_args()
    args = dict(qo_indptr_arr=qo, paged_kv_indptr_arr=kv, paged_kv_indices_arr=indices, paged_kv_last_page_len=last,
                num_qo_heads=HEADS[0], num_kv_heads=HEADS[1], head_dim=DIM, page_size=PAGE)
    change, match = bad_plans(levels)[index]
    with pytest.raises(ValueError, match=match):
        w.plan(**{**args, **change})
    assert not any(lvl.plans for lvl in stand_in.created)


def test_page_ids_on_another_device_than_the_workspace():
    levels = Levels(*CASES["decode_2_levels"][:2])
    with pytest.raises(ValueError, match=r"^paged_kv_indices_arr\[0\]: expected a tensor on cuda:0 \(the workspace's "
                                         r"device\), got cpu"):
        cascade.check_levels(2, torch.device("cuda:0"), *levels.plan_args(), PAGE)


def test_a_level_wrappers_error_names_the_cascade_argument(stand_in):
    levels = Levels(*CASES["decode_2_levels"][:2])
    w = flashjit.MultiLevelCascadeAttentionWrapper(2, torch.empty(16, dtype=torch.uint8))
    stand_in.created[1].plan_error = ValueError("paged_kv_indices: expected page ids >= 0, got -3")
    with pytest.raises(ValueError, match=r"^paged_kv_indices_arr\[1\]: expected page ids >= 0, got -3$"):
        w.plan(*levels.plan_args(), *HEADS, DIM, PAGE)
    stand_in.created[1].plan_error = ValueError("num_qo_heads (4) must be a multiple of num_kv_heads (3) for GQA/MQA")
    with pytest.raises(ValueError, match=r"^num_qo_heads \(4\)"):
        w.plan(*levels.plan_args(), *HEADS, DIM, PAGE)
    with pytest.raises(RuntimeError, match=r"before plan"):  # a half-planned cascade does not run
        w.run(torch.zeros(5, HEADS[0], DIM), levels.cache)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_levels=0), r"^num_levels: expected a positive int, got 0"),
    (dict(num_levels=True), r"^num_levels: expected a positive int, got True"),
    (dict(num_levels="2"), r"^num_levels: expected a positive int, got '2'"),
    (dict(kv_layout="NDH"), r"^kv_layout: expected 'NHD' or 'HND'"),
    (dict(use_cuda_graph=True), r"^paged_kv_indices_buf_arr: use_cuda_graph=True needs one page-id buffer per level"),
    (dict(use_cuda_graph=True, paged_kv_indices_buf_arr=[torch.zeros(8, dtype=torch.int32)]),
     r"^paged_kv_indices_buf_arr: expected 2 entries \(num_levels\), got 1"),
    (dict(use_cuda_graph=True, paged_kv_indices_buf_arr=[torch.zeros(8, dtype=torch.int32)] * 2,
          qo_indptr_buf_arr=[torch.zeros(8, dtype=torch.int32)] * 3), r"^qo_indptr_buf_arr: expected 2 entries"),
])
def test_bad_construction(stand_in, kwargs, match):
    with pytest.raises(ValueError, match=match):
        flashjit.MultiLevelCascadeAttentionWrapper(**{"num_levels": 2, "float_workspace_buffer": torch.empty(16),
                                                      **kwargs})
    assert not stand_in.created


def test_a_cpu_workspace_is_refused_by_the_real_levels():
    with pytest.raises(ValueError, match=r"^float_workspace_buffer: expected a CUDA tensor"):
        flashjit.MultiLevelCascadeAttentionWrapper(2, torch.empty(1 << 20, dtype=torch.uint8))


def test_flashinfer_names():
    w = flashjit.MultiLevelCascadeAttentionWrapper
    assert w.begin_forward is w.plan and w.forward is w.run
    assert "MultiLevelCascadeAttentionWrapper" in flashjit.__all__


def test_run_traces_as_the_levels_operators_and_the_merge(host_launch):
    """Real level wrappers, plans made on the host, a stand-in launch (test_torch_ops):
    compiled with fullgraph=True, run() is the paged prefill operators and
    merge_state_in_place, no operator of its own, and gives eager's result."""
    w = flashjit.MultiLevelCascadeAttentionWrapper(2, _workspace())
    for wrapper in (w, *w._batch_prefill_wrappers):
        wrapper._device = torch.device("cpu")  # the plans' metadata stays on the host
    i32 = dict(dtype=torch.int32)
    w.plan([torch.tensor([0, 6], **i32), torch.tensor([0, 3, 6], **i32)],
           [torch.tensor([0, 2], **i32), torch.tensor([0, 1, 2], **i32)],
           [torch.tensor([0, 1], **i32), torch.tensor([2, 3], **i32)],
           [torch.tensor([16], **i32), torch.tensor([4, 9], **i32)], 8, 2, 128, 16, causal=True,
           q_data_type=torch.bfloat16)
    assert [lvl._plan.module.spec.causal for lvl in w._batch_prefill_wrappers] == [False, True]
    q, cache = torch.randn(6, 8, 128).to(torch.bfloat16), torch.randn(4, 2, 16, 2, 128).to(torch.bfloat16)
    eager = w.run(q, cache)
    compiled, graphs = _compiled_graphs(lambda q, cache: w.run(q, cache), q, cache, backend="aot_eager")
    assert len(graphs) == 1
    targets = _targets(graphs)
    assert targets.count("flashjit.batch_prefill_paged_run.default") == 2
    assert "flashjit.merge_state_in_place.default" in targets
    assert not [t for t in targets if "cascade" in t]
    assert torch.equal(compiled, eager)
    assert host_launch == [6] * 4
