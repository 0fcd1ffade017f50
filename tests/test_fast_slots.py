"""The fast slot of each op (ops._calls.Signatures.fast / fast_out): a repeat
of the last call's signature is recognised by a C check of the tensors
(ops._guards) before any Python key is built; anything else (a changed stride,
dtype, device, shape, alignment, out, lse, option, or torch without usable
guards) takes the key path and its checks. The stand-in GPU of
test_prepared_calls."""

from __future__ import annotations

import pytest
import torch

import flashjit
import test_prepared_calls
import test_prepared_runs
from flashjit.ops import _dispatch, _guards, decode, prefill
from test_prepared_calls import SINGLE, SINGLE_CHANGES, bf16, cuda, pointers
from test_prepared_runs import BATCH_CHANGES, WRAPPERS, mla

no_compile, gpu = test_prepared_calls.no_compile, test_prepared_calls.gpu


def test_guards_tell_apart_what_signatures_do():
    assert _guards._USABLE  # else the CPU suite would not exercise the fast slots
    q = torch.empty(4, 8, 128, dtype=torch.bfloat16)
    check = _guards.metadata_check((q,), (0,))
    assert check(torch.empty(9, 8, 128, dtype=torch.bfloat16))  # the token count is free
    for other in (torch.empty(4, 8, 128), torch.empty(4, 8, 256, dtype=torch.bfloat16)[..., :128],
                  torch.empty(4, 4, 128, dtype=torch.bfloat16), cuda(q), None, "q"):
        assert not check(other)
    static = _guards.metadata_check((q,))
    assert static(q.clone()) and not static(torch.empty(5, 8, 128, dtype=torch.bfloat16))
    assert not static(q.clone().requires_grad_())


def _no_key_path(monkeypatch):
    """Makes every op's Python signature path fail: what still runs took a fast slot."""
    def fail(*args, **kwargs):
        raise AssertionError("took the key path")
    for module in (prefill, decode):
        monkeypatch.setattr(module, "run_single_request", fail)
    for cls in (flashjit.BatchPrefillWithRaggedKVCacheWrapper, flashjit.BatchPrefillWithPagedKVCacheWrapper,
                flashjit.BatchDecodeWithPagedKVCacheWrapper, flashjit.BatchMLAPagedAttentionWrapper):
        monkeypatch.setattr(cls, "_run", fail)


@pytest.mark.parametrize("op", SINGLE)
def test_a_repeat_takes_the_fast_slot_and_reads_its_token_counts(op, gpu, monkeypatch):
    fn, make = SINGLE[op]
    q, k, v = make()
    fn(q, k, v)
    _no_key_path(monkeypatch)
    k2, v2 = bf16(40, 2, 128), bf16(40, 2, 128)
    out = fn(q, k2, v2)
    addresses, counts = pointers(gpu.launches[-1])
    assert addresses == (q.data_ptr(), k2.data_ptr(), v2.data_ptr(), out.data_ptr(), 0) and counts[2] == 40
    if op == "prefill":
        q3 = bf16(7, 8, 128)
        fn(q3, k2, v2)
        assert pointers(gpu.launches[-1])[1][1] == 7
    with pytest.raises(ValueError, match=r"^v: expected 40 tokens \(as k\) in layout NHD"):
        fn(q, k2, bf16(41, 2, 128))
    with pytest.raises(AssertionError, match="key path"):  # another option: not the slot's call
        fn(q, k2, v2, return_lse=True)


def test_hnd_layout_reads_its_token_dimension(gpu, monkeypatch):
    q, k, v = bf16(8, 128), bf16(2, 16, 128), bf16(2, 16, 128)
    flashjit.single_decode_with_kv_cache(q, k, v, kv_layout="HND")
    _no_key_path(monkeypatch)
    k2 = cuda(torch.randn(2, 64, 128).to(torch.bfloat16)[:, :16])  # 16 of 64 tokens: HND strides as before
    v2 = cuda(torch.randn(2, 64, 128).to(torch.bfloat16)[:, :16])
    flashjit.single_decode_with_kv_cache(q, bf16(2, 16, 128), bf16(2, 16, 128), kv_layout="HND")
    assert pointers(gpu.launches[-1])[1][2] == 16
    with pytest.raises(AssertionError, match="key path"):  # other head strides: another signature
        flashjit.single_decode_with_kv_cache(q, k2, v2, kv_layout="HND")


def test_alternating_signatures_prepare_each_once(gpu):
    q, k, v = bf16(8, 128), bf16(16, 2, 128), bf16(16, 2, 128)
    wide = cuda(torch.randn(16, 2, 256).to(torch.bfloat16)[..., :128])  # other strides, still aligned
    for _ in range(3):
        flashjit.single_decode_with_kv_cache(q, k, v)
        flashjit.single_decode_with_kv_cache(q, wide, v)
        flashjit.single_decode_with_kv_cache(q, k.clone().requires_grad_(), v)  # a guard miss, the same key
    assert gpu.modules == 2 and len(gpu.launches) == 9


@pytest.mark.parametrize("kind", [*WRAPPERS, "mla"])
def test_repeated_runs_take_the_fast_slots(kind, gpu, monkeypatch):
    w, args = mla() if kind == "mla" else WRAPPERS[kind]()
    given = cuda(torch.empty_like(args[0]))
    w.run(*args)
    w.run(*args, out=given)
    _no_key_path(monkeypatch)
    out = w.run(*args)
    assert w.run(*args, out=given) is given and out is not given and out.shape == args[0].shape
    assert pointers(gpu.launches[-2])[0][3] == out.data_ptr() and pointers(gpu.launches[-1])[0][3] == given.data_ptr()
    for changed in ({"return_lse": True}, {"lse": cuda(torch.empty(args[0].shape[:2]))}):
        with pytest.raises(AssertionError, match="key path"):
            w.run(*args, **changed)


def test_a_kv_pair_takes_its_own_fast_slot(gpu, monkeypatch):
    w, (q, cache) = WRAPPERS["decode"]()
    pair = (cuda(cache[:, 0]), cuda(cache[:, 1]))
    w.run(q, pair)
    w.run(q, cache, out=cuda(torch.empty_like(q)))
    run = type(w)._run
    _no_key_path(monkeypatch)
    w.run(q, pair)
    w.run(q, list(pair))
    assert pointers(gpu.launches[-1])[0][1:3] == (pair[0].data_ptr(), pair[1].data_ptr())
    with pytest.raises(AssertionError, match="key path"):  # one 5-D cache is another signature
        w.run(q, cache)
    monkeypatch.setattr(type(w), "_run", run)
    w.run(q, cache)
    assert pointers(gpu.launches[-1])[0][1:3] == (cache[:, 0].data_ptr(), cache[:, 1].data_ptr())


@pytest.mark.parametrize("kind", [*WRAPPERS, "pair", "mla"])
def test_run_operators_take_the_fast_slot(kind, gpu, monkeypatch):
    """The eager kernel of a compiled graph's run() operator tries run()'s fast slot too."""
    w, args = mla() if kind == "mla" else WRAPPERS["decode" if kind == "pair" else kind]()
    inputs, extra = args, ()
    if kind == "pair":
        args = [args[0], (cuda(args[1][:, 0]), cuda(args[1][:, 1]))]
    if kind in ("paged_prefill", "decode", "pair"):  # the cache as the operator takes it, then window_left
        inputs, extra = [args[0], *_dispatch.cache_args(args[1])], (None,)
    op = getattr(torch.ops.flashjit, f"{w._op}_run").default
    w.run(*args)
    _no_key_path(monkeypatch)
    (out,) = op(w._handle, *inputs, False, *extra)
    assert pointers(gpu.launches[-1])[0][3] == out.data_ptr() and out.shape == args[0].shape
    with pytest.raises(AssertionError, match="key path"):  # the slot holds runs without LSE
        op(w._handle, *inputs, True, *extra)


def test_return_lse_switches_slots(gpu):
    w, args = WRAPPERS["ragged"]()
    for _ in range(2):
        out, lse = w.run(*args, return_lse=True)
        assert lse.shape == (8, 8) and pointers(gpu.launches[-1])[0][4] == lse.data_ptr()
        plain = w.run(*args)
        assert isinstance(plain, torch.Tensor) and pointers(gpu.launches[-1])[0][4] == 0


# Every check of test_prepared_calls / test_prepared_runs, with torch's guards unusable: the key path alone.

@pytest.fixture
def no_guards(monkeypatch):
    monkeypatch.setattr(_guards, "_USABLE", False)


@pytest.mark.parametrize("index,make,match", SINGLE_CHANGES)
@pytest.mark.parametrize("op", SINGLE)
def test_single_changes_without_guards(op, index, make, match, gpu, no_guards):
    test_prepared_calls.test_a_changed_signature_after_a_cached_call_gets_its_check(op, index, make, match, gpu)
    assert prefill._prepared.fast[1] is _guards.never or decode._prepared.fast[1] is _guards.never


@pytest.mark.parametrize("kinds,change,match", BATCH_CHANGES)
def test_batch_changes_without_guards(kinds, change, match, gpu, no_guards):
    test_prepared_runs.test_a_changed_run_signature_after_a_cached_run_gets_its_check(kinds, change, match, gpu)
