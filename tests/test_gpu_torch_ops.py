"""The torch.ops.flashjit operators on a GPU (configurations the prewarmed sweep
builds: bf16, head_dim 64, and MLA): opcheck on CUDA tensors, the single-request
ops compiled against eager, and a compiled decoder layer and a compiled MLA
attention step against eager, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch.library import opcheck

import flashjit
from sweep import MLA_BACKENDS
from test_gpu_attention import randn
from test_gpu_mla import CKV, KPE, MODES, MlaBatch, mla_wrapper
from test_torch_ops import BF16, OPCHECK, _op, _qkv, _single_ops

pytestmark = pytest.mark.gpu


def test_gpu_single_ops_opcheck_and_compiled(prewarmed):
    q, k, v = _qkv("cuda", dim=64)
    opcheck(_op("single_prefill"), (q, k, v, "NHD", True, None, -1, None, "auto", True, None, None),
            test_utils=OPCHECK)
    opcheck(_op("single_decode"), (q[0], k, v, "NHD", False, None, -1, None, "auto", True, None), test_utils=OPCHECK)
    eager = _single_ops(q, k, v)
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        compiled = torch.compile(_single_ops, fullgraph=True, backend=backend)(q, k, v)
        assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True)), backend


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_gpu_compiled_decoder_layer_is_bit_identical(backend, prewarmed):
    """A GQA attention layer (fused QKV projection, K/V appended to a paged cache,
    ragged causal prefill, then one paged decode step, output projection and
    residual) compiled with fullgraph=True against eager: outputs and caches equal."""
    torch.manual_seed(0)
    heads, kv_heads, dim, page, prompt = 8, 2, 64, 16, [37, 70]
    hidden = heads * dim
    w_qkv = torch.randn(hidden, (heads + 2 * kv_heads) * dim, device="cuda").div(hidden ** 0.5).to(BF16)
    w_o = torch.randn(hidden, hidden, device="cuda").div(hidden ** 0.5).to(BF16)
    pages = [-(-(n + 1) // page) for n in prompt]  # room for the prompt and one decoded token
    indptr = torch.tensor([0, pages[0], sum(pages)], dtype=torch.int32, device="cuda")
    indices = torch.randperm(sum(pages) + 2, device="cuda")[:sum(pages)].to(torch.int32)
    cache = torch.zeros(sum(pages) + 2, 2, page, kv_heads, dim, device="cuda", dtype=BF16)
    ragged = flashjit.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(32 << 20, dtype=torch.uint8, device="cuda"))
    qo = [0, prompt[0], sum(prompt)]
    ragged.plan(qo, qo, heads, kv_heads, dim, causal=True, q_data_type=BF16)
    decode = flashjit.BatchDecodeWithPagedKVCacheWrapper(torch.empty(32 << 20, dtype=torch.uint8, device="cuda"),
                                                         use_tensor_cores=True)

    def step(seq_lens, append_indptr):
        seq = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        last = torch.tensor([(n - 1) % page + 1 for n in seq_lens], dtype=torch.int32, device="cuda")
        append = torch.tensor(append_indptr, dtype=torch.int32, device="cuda")
        return (*flashjit.get_batch_indices_positions(append, seq, append_indptr[-1]), last)

    def layer(x, cache, batch_indices, positions, last, prefill: bool):
        qkv = x @ w_qkv
        q = qkv[:, :hidden].view(-1, heads, dim)
        k, v = qkv[:, hidden:].view(-1, 2, kv_heads, dim).unbind(1)
        flashjit.append_paged_kv_cache(k, v, batch_indices, positions, cache, indices, indptr, last)
        o = ragged.run(q, k, v) if prefill else decode.run(q, cache)
        return x + o.reshape(x.shape[0], hidden) @ w_o, o

    prefill_args = step(prompt, qo)
    decode_args = step([n + 1 for n in prompt], [0, 1, 2])
    decode.plan(indptr, indices, decode_args[2], heads, kv_heads, dim, page, q_data_type=BF16)
    x_prefill = torch.randn(sum(prompt), hidden, device="cuda").to(BF16)
    x_decode = torch.randn(2, hidden, device="cuda").to(BF16)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    results = []
    for fn in (layer, compiled):
        c = cache.clone()
        results.append((*fn(x_prefill, c, *prefill_args, True), *fn(x_decode, c, *decode_args, False), c))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    assert results[0][-1].abs().sum() > 0 and not torch.isnan(results[0][0]).any()

    q, cache = torch.randn(2, heads, dim, device="cuda").to(BF16), results[0][-1]
    for return_lse in (False, True):
        opcheck(_op("batch_decode_paged_run"), (decode._handle, q, cache, None, return_lse, None), test_utils=OPCHECK)
    opcheck(_op("batch_decode_paged_run_out"), (decode._handle, q, cache, None, torch.empty_like(q),
                                                torch.empty(2, heads, device="cuda"), None), test_utils=OPCHECK)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("mode", MODES, ids=["decode", "qo4_causal"])
@pytest.mark.parametrize("mla_backend", MLA_BACKENDS)
def test_gpu_compiled_mla_is_bit_identical(mla_backend, backend, mode, prewarmed, error_report):
    """An absorbed MLA attention step (q_nope and q_pe as views of one projection,
    MLA over a paged latent cache with ragged lengths and an empty request, the
    output projected back) compiled with fullgraph=True against eager, on each
    MLA kernel (fa3 where it runs): the MLA outputs and the out= / lse= form equal
    bit for bit (under aot_eager every output; under inductor, whose projections
    may round otherwise, eager MLA on the graph's own q_nope / q_pe), and within
    the kernel's profile of float64; then opcheck of both operators on CUDA
    tensors."""
    torch.manual_seed(0)
    qo_len, causal = mode
    heads, hidden = 16, 256
    batch = MlaBatch([qo_len] * 5, [1, 300, 0, 2000, 65], 16, heads, BF16)
    wrapper = mla_wrapper(mla_backend)
    batch.plan(wrapper, causal)
    assert wrapper._plan.module.spec.backend == mla_backend
    w_q = randn(hidden, heads * (CKV + KPE), dtype=torch.float32).div(hidden ** 0.5).to(BF16)
    w_o = randn(heads * CKV, hidden, dtype=torch.float32).div((heads * CKV) ** 0.5).to(BF16)
    x = randn(5 * qo_len, hidden, dtype=BF16)

    def step(x, ckv, kpe):
        q_nope, q_pe = (x @ w_q).view(x.shape[0], heads, CKV + KPE).split([CKV, KPE], dim=-1)
        o, lse = wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True)
        out = torch.empty(q_nope.shape, dtype=BF16, device="cuda")
        out_lse = torch.empty(q_nope.shape[:2], dtype=torch.float32, device="cuda")
        wrapper.run(q_nope, q_pe, ckv, kpe, out=out, lse=out_lse, return_lse=True)
        return x + o.reshape(x.shape[0], -1) @ w_o, o, lse, out, out_lse, q_nope, q_pe

    eager = step(x, batch.ckv, batch.kpe)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)(x, batch.ckv, batch.kpe)
    if backend == "aot_eager":
        for a, b in zip(eager, compiled, strict=True):
            assert torch.equal(a, b)
    # Inductor may run the projections with other GEMM kernels (other roundings of
    # q_nope / q_pe): the operator's outputs must equal eager MLA on the compiled
    # graph's own q_nope / q_pe, in both run() forms.
    o, lse = wrapper.run(compiled[-2], compiled[-1], batch.ckv, batch.kpe, return_lse=True)
    for a, b in zip((o, lse, o, lse), compiled[1:5], strict=True):
        assert torch.equal(a, b)
    batch.q_nope, batch.q_pe = eager[-2], eager[-1]  # strided views of the projection, as the kernel read them
    batch.check(eager[1], eager[2], causal, error_report, f"mla_compiled_{backend}", mla_backend, qo_len=qo_len)

    q_nope, q_pe = batch.q_nope.contiguous(), batch.q_pe.contiguous()
    for return_lse in (False, True):
        opcheck(_op("mla_paged_run"), (wrapper._handle, q_nope, q_pe, batch.ckv, batch.kpe, return_lse),
                test_utils=OPCHECK)
    opcheck(_op("mla_paged_run_out"), (wrapper._handle, q_nope, q_pe, batch.ckv, batch.kpe, torch.empty_like(q_nope),
                                       torch.empty(q_nope.shape[:2], device="cuda")), test_utils=OPCHECK)
