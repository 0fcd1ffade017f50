"""Prepared run() of the batch wrappers and MLA (ops._calls): a run with the
signature of an earlier one (every tensor's shape, strides, dtype and device,
out / lse, the options) skips the checks against the plan and the packing; a
changed signature gets the first run's check and its error; plan() drops the
prepared runs. The stand-in GPU of test_prepared_calls."""

from __future__ import annotations

import pytest
import torch

import flashjit
import test_prepared_calls
from flashjit.ops import _calls
from test_prepared_calls import BF16, _change, bf16, cuda, misaligned, pointers

# Fixtures: pytest looks them up by name in the test module.
no_compile, gpu = test_prepared_calls.no_compile, test_prepared_calls.gpu


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def _wrapper(cls, *plan_args, ctor=None, **plan_kwargs):
    """Planned on the host (metadata and page ids on the CPU), then run on cuda:0."""
    w = cls(cuda(torch.empty(1 << 16, dtype=torch.uint8)), **(ctor or {}))
    _plan(w, *plan_args, **plan_kwargs)
    return w


def _plan(w, *plan_args, **plan_kwargs) -> None:
    w._device = torch.device("cpu")
    w.plan(*plan_args, **plan_kwargs)
    w._device = torch.device("cuda", 0)


def ragged():
    w = _wrapper(flashjit.BatchPrefillWithRaggedKVCacheWrapper, [0, 3, 8], [0, 10, 30], 8, 2, 128,
                 q_data_type=BF16)
    return w, [bf16(8, 8, 128), bf16(30, 2, 128), bf16(30, 2, 128)]


def paged_decode(use_tensor_cores=False):
    w = _wrapper(flashjit.BatchDecodeWithPagedKVCacheWrapper, _i32(0, 2, 5), _i32(4, 0, 1, 2, 3), _i32(7, 16), 8, 2,
                 128, 16, q_data_type=BF16, ctor={"use_tensor_cores": use_tensor_cores})
    return w, [bf16(2, 8, 128), bf16(5, 2, 16, 2, 128)]


def paged_prefill():
    w = _wrapper(flashjit.BatchPrefillWithPagedKVCacheWrapper, _i32(0, 3, 8), _i32(0, 2, 5), _i32(4, 0, 1, 2, 3),
                 _i32(7, 16), 8, 2, 128, 16, q_data_type=BF16)
    return w, [bf16(8, 8, 128), bf16(5, 2, 16, 2, 128)]


WRAPPERS = {"ragged": ragged, "paged_prefill": paged_prefill, "decode": paged_decode}


@pytest.mark.parametrize("kind", WRAPPERS)
def test_a_repeated_run_launches_with_each_calls_addresses(kind, gpu):
    w, args = WRAPPERS[kind]()
    out = w.run(*args)
    given = cuda(torch.empty_like(args[0]))
    assert w.run(*args, out=given) is given
    out3, lse = w.run(*args, return_lse=True)
    w.run(*args)
    assert len(gpu.launches) == 4
    for (params, _), o, lse_ptr in zip(gpu.launches, (out, given, out3, None), (0, 0, lse.data_ptr(), 0)):
        addresses, _ = pointers((params,))
        assert addresses[0] == args[0].data_ptr() and addresses[1] == args[1].data_ptr()
        if o is not None:
            assert addresses[3] == o.data_ptr()
        assert addresses[4] == lse_ptr
    if kind != "ragged":  # one 5-D cache: V is the second half of each page
        cache = args[1]
        assert pointers(gpu.launches[0])[0][2] == cache[:, 1].data_ptr()
    assert len(w._launches) == 3  # without out, with out, with LSE


def _batch_change(name, kinds, change, match):
    return pytest.param(kinds, change, match, id=name)


# change(args) -> (args, run() keywords) after a cached run(); the first run's check must answer.
BATCH_CHANGES = [
    _batch_change("q-dtype", ["ragged", "decode"], lambda a: ([cuda(a[0].half()), *a[1:]], {}),
                  r"^q: expected dtype torch.bfloat16 as planned \(q_data_type\), got torch.float16"),
    _batch_change("q-rows", ["ragged", "decode"], lambda a: ([bf16(a[0].shape[0] + 1, 8, 128), *a[1:]], {}),
                  r"^q: expected \d+ rows"),
    _batch_change("q-device", ["ragged", "decode"], lambda a: ([cuda(a[0], 1), *a[1:]], {}),
                  r"^k: expected a tensor on cuda:1 \(where q is\), got cuda:0"),
    _batch_change("q-on-cpu", ["ragged", "decode"], lambda a: ([a[0].as_subclass(torch.Tensor), *a[1:]], {}),
                  r"^q: expected a CUDA tensor, got a tensor on cpu"),
    _batch_change("kv-device", ["ragged", "decode"], lambda a: ([a[0], *(cuda(t, 1) for t in a[1:])], {}),
                  r"^k: expected a tensor on cuda:0 \(where q is\), got cuda:1"),
    _batch_change("all-on-another-device", ["ragged", "decode"], lambda a: ([cuda(t, 1) for t in a], {}),
                  r"^q: expected a tensor on cuda:0 \(the workspace's device\), got cuda:1"),
    _batch_change("cache-dtype", ["decode"], lambda a: ([a[0], cuda(a[1].half())], {}),
                  r"^paged_kv_cache: expected dtype torch.bfloat16 as planned"),
    _batch_change("cache-pages", ["decode"], lambda a: ([a[0], bf16(4, 2, 16, 2, 128)], {}),
                  r"^indices: page id 4 is past the cache's 4 pages"),
    _batch_change("cache-stride", ["decode"],
                  lambda a: ([a[0], cuda(torch.randn(5, 2, 16, 2, 132).to(BF16)[..., :128])], {}),
                  r"^k: expected a 16-byte aligned tensor with strides that are multiples of 8 elements"),
    _batch_change("cache-misaligned", ["decode"], lambda a: ([a[0], misaligned(5, 2, 16, 2, 128)], {}),
                  r"^k: expected a 16-byte aligned tensor"),
    _batch_change("k-misaligned", ["ragged"], lambda a: ([a[0], misaligned(30, 2, 128), a[2]], {}),
                  r"^k: expected a 16-byte aligned tensor"),
    _batch_change("k-tokens", ["ragged"], lambda a: ([a[0], bf16(31, 2, 128), bf16(31, 2, 128)], {}),
                  r"^k: expected 30 tokens \(kv_indptr\[-1\] as planned\)"),
    _batch_change("v-stride", ["ragged"], lambda a: ([*a[:2], cuda(a[2].transpose(1, 2).contiguous().transpose(1, 2))],
                                                      {}), r"^v: the last \(head_dim\) dimension must be contiguous"),
    _batch_change("out-dtype", ["ragged", "decode"], lambda a: (a, {"out": cuda(torch.empty(a[0].shape))}),
                  r"^out: expected a contiguous torch.bfloat16 tensor .* got torch.float32"),
    _batch_change("out-strided", ["ragged", "decode"],
                  lambda a: (a, {"out": cuda(torch.empty_like(a[0]).transpose(0, 1).contiguous().transpose(0, 1))}),
                  r"^out: expected a contiguous .*contiguous=False"),
    _batch_change("out-device", ["ragged", "decode"], lambda a: (a, {"out": cuda(torch.empty_like(a[0]), 1)}),
                  r"^out: expected .* on cuda:0, got .* on cuda:1"),
    _batch_change("lse-shape", ["ragged", "decode"],
                  lambda a: (a, {"lse": cuda(torch.empty(a[0].shape[0], 4)), "return_lse": True}),
                  r"^lse: expected a contiguous torch.float32 tensor of shape"),
    _batch_change("window_left", ["decode"], lambda a: (a, {"window_left": 8}),
                  r"^window_left: expected -1 \(as planned\) or None, got 8"),
]


@pytest.mark.parametrize("kinds,change,match", BATCH_CHANGES)
def test_a_changed_run_signature_after_a_cached_run_gets_its_check(kinds, change, match, gpu):
    for kind in kinds:
        w, args = WRAPPERS[kind]()
        out = cuda(torch.empty_like(args[0]))
        w.run(*args)
        w.run(*args, out=out)
        w.run(*args, out=out)
        launches = len(gpu.launches)
        changed, kwargs = change(args)
        with pytest.raises(ValueError, match=match):
            w.run(*changed, **kwargs)
        assert len(gpu.launches) == launches
        w.run(*args, out=out)  # the cached signature still runs
        assert len(gpu.launches) == launches + 1


def test_out_must_be_aligned_on_tensor_cores(gpu):
    w, args = paged_decode(use_tensor_cores=True)
    w.run(*args, out=cuda(torch.empty_like(args[0])))
    with pytest.raises(ValueError, match=r"^out: expected a 16-byte aligned tensor"):
        w.run(*args, out=misaligned(*args[0].shape))
    with pytest.raises(ValueError, match=r"^q: expected a 16-byte aligned tensor"):
        w.run(misaligned(*args[0].shape), args[1])


def test_plan_drops_the_prepared_runs(gpu):
    w, args = paged_decode()
    w.run(*args)
    w.run(*args)
    _plan(w, _i32(0, 2, 5), _i32(4, 0, 1, 2, 3), _i32(7, 16), 16, 2, 128, 16, q_data_type=BF16)
    assert len(w._launches) == 0
    with pytest.raises(ValueError, match=r"^q: expected 16 qo heads \(num_qo_heads\) as planned, got 8"):
        w.run(*args)


def test_a_kv_tuple_and_a_5d_cache_are_other_signatures(gpu):
    w, (q, cache) = paged_decode()
    w.run(q, cache)
    w.run(q, (cuda(cache[:, 0]), cuda(cache[:, 1])))
    addresses = [pointers(launch)[0] for launch in gpu.launches]
    assert addresses[0][1:3] == addresses[1][1:3]
    with pytest.raises(ValueError, match=r"^paged_kv_cache\[1\]: expected dtype torch.bfloat16"):
        w.run(q, (cuda(cache[:, 0]), cuda(cache[:, 1].half())))


def test_compiled_graph_operator_takes_the_prepared_run(gpu):
    w, (q, cache) = paged_decode()
    op = torch.ops.flashjit.batch_decode_paged_run.default
    w.run(q, cache)
    (out,) = op(w._handle, q, cache, None, False, None)
    assert len(gpu.launches) == 2 and len(w._launches) == 1
    with pytest.raises(ValueError, match=r"^paged_kv_cache: expected dtype"):
        op(w._handle, q, cuda(cache.half()), None, False, None)


# ---------------------------------------------------------------------------
# MLA


def mla():
    w = _wrapper(flashjit.BatchMLAPagedAttentionWrapper, _i32(0, 1, 2), _i32(0, 1, 2), _i32(1, 0), _i32(64, 30), 16,
                 512, 64, 64, False, 0.1, BF16, BF16)
    return w, [bf16(2, 16, 512), bf16(2, 16, 64), bf16(2, 64, 512), bf16(2, 64, 64)]


@pytest.mark.parametrize("index,make,match", [
    _change("q_pe-misaligned", 1, lambda t: misaligned(*t.shape), r"^q_pe: expected a 16-byte aligned tensor"),
    _change("ckv-device", 2, lambda t: cuda(t, 1), r"^ckv_cache: expected a tensor on cuda:0"),
    _change("kpe-dtype", 3, lambda t: cuda(t.half()), r"^kpe_cache: expected a torch.bfloat16 tensor"),
    _change("q_nope-stride", 0, lambda t: cuda(torch.randn(2, 16, 516).to(BF16)[..., :512]),
            r"^q_nope: expected a 16-byte aligned tensor with strides"),
])
def test_mla_run_after_a_cached_run_checks_a_changed_signature(index, make, match, gpu):
    w, args = mla()
    w.run(*args)
    w.run(*args)
    assert len(w._launches) == 1 and gpu.modules == 1
    addresses = _calls.PER_CALL.unpack_from(gpu.launches[-1][0])[:4]
    assert addresses == (args[0].data_ptr(), args[2].data_ptr(), args[3].data_ptr(), addresses[3])
    assert gpu.launches[-1][0][-8:] == args[1].data_ptr().to_bytes(8, "little")  # q_pe, the struct's last field
    changed = list(args)
    changed[index] = make(args[index])
    with pytest.raises(ValueError, match=match):
        w.run(*changed)
    assert len(gpu.launches) == 2
    out, lse = w.run(*args, return_lse=True)
    assert out.shape == (2, 16, 512) and lse.shape == (2, 16) and pointers(gpu.launches[-1])[0][4] == lse.data_ptr()
