"""The torch.ops.flashjit operators on a GPU (configurations the prewarmed sweep
builds: bf16, head_dim 64): opcheck on CUDA tensors, the single-request ops
compiled against eager, and a compiled decoder layer against eager, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch.library import opcheck

import flashjit
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
