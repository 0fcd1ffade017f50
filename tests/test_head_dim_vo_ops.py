"""head_dim_vo below head_dim_qk (192/128) in the ops without a GPU: their
checks and plan() errors, the output, strides and split-KV partial states as
the launch receives them (the stand-in GPU of test_prepared_calls), and the
torch.compile operators' output shapes. Validation, selectors and sources:
tests/test_head_dim_vo.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.library import opcheck

import flashjit
import test_prepared_calls
from flashjit import jit, loader
from flashjit.ops import _batch
from test_bad_input_wrappers import _i32, _workspace
from test_prepared_calls import BF16, bf16, cuda
from test_torch_ops import OPCHECK, _compiled_graphs, _op, _targets

# Fixtures: pytest looks them up by name in the test module.
no_compile, gpu = test_prepared_calls.no_compile, test_prepared_calls.gpu

QK, VO = 192, 128

# ---------------------------------------------------------------------------
# The ops' checks (no kernel is built for a bad input)


def _qkv(vo=VO, device="meta", qo=7, kv=40):
    return (torch.empty(qo, 8, QK, dtype=BF16, device=device), torch.empty(kv, 2, QK, dtype=BF16, device=device),
            torch.empty(kv, 2, vo, dtype=BF16, device=device))


def test_v_of_another_width_names_the_pairs_and_the_ops(no_compile):
    with FakeTensorMode():
        q, k, v = _qkv(64, "cuda")
        with pytest.raises(ValueError, match=r"^v: expected head_dim 192 \(as q\) or 128 \(head_dim_vo\), got 64; "
                                             r"head_dim_qk/head_dim_vo pairs generated: 192/128$"):
            flashjit.single_prefill_with_kv_cache(q, k, v)
        q1, k, v = torch.empty(8, QK, dtype=BF16, device="cuda"), *_qkv(VO, "cuda")[1:]
        with pytest.raises(ValueError, match=r"^v: expected head_dim 192 \(as q\), got 128; a V narrower than q and k "
                                             r"\(head_dim_qk/head_dim_vo 192/128\) is taken by "
                                             r"single_prefill_with_kv_cache and BatchPrefillWithRaggedKVCacheWrapper "
                                             r"only$"):
            flashjit.single_decode_with_kv_cache(q1, k, v)


PAGED_PLAN = dict(qo_indptr=_i32(0, 3, 8), paged_kv_indptr=_i32(0, 2, 5), paged_kv_indices=_i32(4, 0, 1, 2, 3),
                  paged_kv_last_page_len=_i32(7, 16), num_qo_heads=8, num_kv_heads=2, head_dim_qk=QK, page_size=16,
                  head_dim_vo=VO, q_data_type=BF16)
RAGGED_PLAN = dict(qo_indptr=[0, 3, 8], kv_indptr=[0, 10, 30], num_qo_heads=8, num_kv_heads=2, head_dim_qk=QK,
                   head_dim_vo=VO, q_data_type=BF16)


@pytest.mark.parametrize("change,match", [
    ({"head_dim_qk": 128, "head_dim_vo": 192}, r"^head_dim_vo: 192 above head_dim_qk 128 is not generated; expected "
                                               r"128 \(as head_dim_qk\), or the V width of a pair \(192/128\)$"),
    ({"head_dim_vo": 64}, r"^head_dim_vo: expected 192 \(as head_dim_qk\), or the V width of a generated "
                          r"head_dim_qk/head_dim_vo pair \(192/128\), got 64 with head_dim_qk 192$"),
    ({"head_dim_vo": 100}, r"^head_dim_vo: expected a head_dim that is a multiple of 16"),
    ({"kv_data_type": torch.float8_e4m3fn}, r"an FP8 KV cache with head_dim_qk=192 != head_dim_vo=128 is not yet "
                                            r"generated"),
    ({"q_data_type": torch.float32, "use_tensor_cores": True}, r"Nearest working choice: "
                                                               r"batch_prefill_ragged_f32_qk192_vo128_fa2_cc_lse$"),
], ids=["above", "no-pair", "not-a-head-dim", "fp8", "fp32-tensor-cores"])
def test_ragged_plan_errors(no_compile, change, match):
    with pytest.raises(ValueError, match=match):
        flashjit.BatchPrefillWithRaggedKVCacheWrapper(_workspace()).plan(**{**RAGGED_PLAN, **change})


def test_ragged_plan_with_strict_fa3_and_paged_plan_refuse(no_compile):
    with pytest.raises(ValueError, match=r"^backend='fa3' cannot run here: "):
        flashjit.BatchPrefillWithRaggedKVCacheWrapper(_workspace(), backend="fa3", strict=True).plan(**RAGGED_PLAN)
    with pytest.raises(ValueError, match=r"^head_dim_vo: expected 192 \(as head_dim_qk\) for batch_prefill_paged, got "
                                         r"128; a V narrower than Q and K \(head_dim_qk/head_dim_vo 192/128\) is taken "
                                         r"by BatchPrefillWithRaggedKVCacheWrapper and single_prefill_with_kv_cache$"):
        flashjit.BatchPrefillWithPagedKVCacheWrapper(_workspace()).plan(**PAGED_PLAN)


# ---------------------------------------------------------------------------
# What the launch receives (the stand-in GPU): output, strides, partial states


def _params(launch) -> loader.AttentionParams:
    return loader.AttentionParams.from_buffer_copy(launch[0][:loader.ctypes.sizeof(loader.AttentionParams)])


def test_single_prefill_writes_o_of_v_width(gpu):
    q, k, v = bf16(4, 8, QK), bf16(16, 2, QK), bf16(16, 2, VO)
    for _ in range(2):  # the first call and the prepared one
        out, lse = flashjit.single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True)
        assert out.shape == (4, 8, VO) and out.is_contiguous() and lse.shape == (4, 8)
    p = _params(gpu.launches[-1])
    assert (p.o_stride_n, p.o_stride_h, p.k_stride_n, p.v_stride_n, p.v_stride_h) == (8 * VO, VO, 2 * QK, 2 * VO, VO)
    assert gpu.launches[-1][0] and p.o == out.data_ptr()


def test_single_prefill_split_keys_size_the_partial_states_by_v(gpu):
    q, k, v = bf16(16, 8, QK), bf16(4096, 2, QK), bf16(4096, 2, VO)
    flashjit.single_prefill_with_kv_cache(q, k, v)
    p = _params(gpu.launches[-1])
    assert p.num_splits > 1 and p.partial_lse == p.partial_o + 4 * 16 * 8 * p.num_splits * VO


def _ragged(workspace_bytes=1 << 20, **plan_kwargs):
    w = flashjit.BatchPrefillWithRaggedKVCacheWrapper(cuda(torch.empty(workspace_bytes, dtype=torch.uint8)))
    w._device = torch.device("cpu")  # the plan's metadata stays on the host
    w.plan(**{**RAGGED_PLAN, **plan_kwargs})
    w._device = torch.device("cuda", 0)
    return w


def test_ragged_run_writes_o_of_v_width_and_checks_v_and_out(gpu):
    w = _ragged()
    assert w._plan.module.spec.name == "batch_prefill_ragged_bf16_qk192_vo128_fa2_tc_lse"
    q, k, v = bf16(8, 8, QK), bf16(30, 2, QK), bf16(30, 2, VO)
    out, lse = w.run(q, k, v, return_lse=True)
    assert out.shape == (8, 8, VO) and lse.shape == (8, 8)
    p = _params(gpu.launches[-1])
    assert (p.o_stride_n, p.o_stride_h, p.v_stride_n, p.k_stride_n) == (8 * VO, VO, 2 * VO, 2 * QK)
    given = cuda(torch.empty(8, 8, VO, dtype=BF16))
    assert w.run(q, k, v, out=given) is given
    with pytest.raises(ValueError, match=r"^out: expected a contiguous torch.bfloat16 tensor of shape \(8, 8, 128\) "
                                         r"\(q's rows x num_qo_heads x head_dim_vo, q's dtype\)"):
        w.run(q, k, v, out=cuda(torch.empty(8, 8, QK, dtype=BF16)))
    with pytest.raises(ValueError, match=r"^v: expected 2 kv heads of head_dim_vo 128 as planned \(layout NHD\), got "
                                         r"2 of 192"):
        w.run(q, k, bf16(30, 2, QK))


def test_ragged_split_keys_size_the_partial_states_by_v(gpu):
    w = _ragged(qo_indptr=[0, 4], kv_indptr=[0, 4096], fixed_split_size=512)
    assert w._plan.work.kv_chunk == 512
    w.run(bf16(4, 8, QK), bf16(4096, 2, QK), bf16(4096, 2, VO))
    p = _params(gpu.launches[-1])
    rows_fit = (1 << 20) // (4 * 8 * (VO + 1))
    assert p.partial_lse - p.partial_o == 4 * rows_fit * 8 * VO


# ---------------------------------------------------------------------------
# torch.compile operators


def test_single_prefill_operator_gives_o_of_v_width():
    (o, lse), graphs = _compiled_graphs(lambda q, k, v: flashjit.single_prefill_with_kv_cache(
        q, k, v, causal=True, return_lse=True), *_qkv(), backend="aot_eager")
    assert "flashjit.single_prefill.default" in _targets(graphs)
    assert (o.shape, lse.shape) == ((7, 8, VO), (7, 8)) and o.is_contiguous()
    for return_lse in (False, True):
        opcheck(_op("single_prefill"), (*_qkv(), "NHD", True, None, -1, None, "auto", return_lse, None, None),
                test_utils=OPCHECK)


@pytest.fixture
def host_ragged(no_compile, monkeypatch):
    """A ragged 192/128 wrapper planned on the host with a stand-in launch that
    writes V's first key into every output row."""
    monkeypatch.setattr(jit, "get_module", lambda spec: SimpleNamespace(spec=spec, rows_per_cta=64, split_align=64))
    monkeypatch.setattr(_batch, "resident_ctas", lambda module, device: 132)

    def launch(self, q, k, v, k_strides, v_strides, out, lse, v_offset=0, scales=None, sinks=0):
        out.copy_(v[:1].repeat_interleave(4, dim=1).expand_as(out))
        if lse is not None:
            lse.copy_(q.float().sum(-1))
    monkeypatch.setattr(_batch.BatchAttention, "_launch", launch)
    w = flashjit.BatchPrefillWithRaggedKVCacheWrapper(_workspace())
    w._device = torch.device("cpu")
    w.plan(**RAGGED_PLAN, causal=True)
    return w


def test_ragged_run_operators_give_o_of_v_width(host_ragged):
    w = host_ragged
    q, k, v = torch.randn(8, 8, QK).to(BF16), torch.randn(30, 2, QK).to(BF16), torch.randn(30, 2, VO).to(BF16)

    def runs(q, k, v):
        o, lse = w.run(q, k, v, return_lse=True)
        out = torch.empty(8, 8, VO, dtype=BF16)
        w.run(q, k, v, out=out)
        o2, lse2 = w.run(q, k, v, lse=torch.empty(8, 8), return_lse=True)  # out allocated in the graph
        return o, lse, out, o2

    eager = runs(q, k, v)
    compiled, graphs = _compiled_graphs(runs, q, k, v, backend="aot_eager")
    assert {"flashjit.batch_prefill_ragged_run.default", "flashjit.batch_prefill_ragged_run_out.default"} \
        <= set(_targets(graphs))
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)
    assert compiled[0].shape == compiled[3].shape == (8, 8, VO)
    for return_lse in (False, True):
        opcheck(_op("batch_prefill_ragged_run"), (w._handle, q, k, v, return_lse), test_utils=OPCHECK)
    opcheck(_op("batch_prefill_ragged_run_out"), (w._handle, q, k, v, torch.empty(8, 8, VO, dtype=BF16),
                                                  torch.empty(8, 8)), test_utils=OPCHECK)
    with FakeTensorMode():
        o = w.run(*(torch.empty(t.shape, dtype=BF16, device="cuda") for t in (q, k, v)))
    assert o.shape == (8, 8, VO)
