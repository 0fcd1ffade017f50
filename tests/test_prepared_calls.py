"""Prepared calls (ops._calls) of single_prefill / single_decode: a call with
the signature of an earlier one skips the checks and the packing; a call whose
signature changed in any way (shape, stride, dtype, device, a pointer's
alignment, an option) after a cached call gets the first call's check and its
error; torch's current stream and device are read anew. No GPU: tensors that
claim to live on cuda:0 or cuda:1, a stand-in kernel module whose launch
records its params, torch's device and stream getters replaced (the `gpu`
fixture, which test_prepared_runs uses for the wrappers)."""

from __future__ import annotations

import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import flashjit
from flashjit import jit, loader
from flashjit.errors import KernelLaunchError
from flashjit.ops import _batch, _calls, decode, prefill
import helpers_cache

no_compile = helpers_cache.no_compile  # a fixture: pytest finds it here
BF16 = torch.bfloat16
_real_empty = torch.empty


class _OnCuda0(torch.Tensor):
    """A CPU tensor that claims to live on cuda:0 (what torch makes from it claims so too)."""

    @property
    def device(self):
        return torch.device("cuda", 0)


class _OnCuda1(torch.Tensor):
    @property
    def device(self):
        return torch.device("cuda", 1)


def cuda(t: torch.Tensor, index: int = 0) -> torch.Tensor:
    return torch.Tensor._make_subclass(_OnCuda1 if index else _OnCuda0, t)


def bf16(*shape, index: int = 0) -> torch.Tensor:
    return cuda(torch.randn(*shape).to(BF16), index)


def misaligned(*shape) -> torch.Tensor:
    """A bf16 tensor on cuda:0 whose address is 2 bytes off 16 (contiguous strides)."""
    n = 1
    for s in shape:
        n *= s
    return cuda(torch.randn(n + 8).to(BF16)[1:n + 1].view(*shape))


def _empty(*size, dtype=None, device=None, **kwargs):
    """torch.empty where a device named cuda gives a CPU tensor that claims it."""
    device = torch.device(device) if device is not None else None
    t = _real_empty(*size, dtype=dtype, **kwargs)
    return cuda(t, device.index or 0) if device is not None and device.type == "cuda" else t


@pytest.fixture
def gpu(request, monkeypatch):
    """Launches recorded as (params bytes, stream); state.device: torch's current
    device, state.stream: its current stream; state.code: what the launch returns.
    No kernel is built (no_compile) before jit.get_module is replaced."""
    request.getfixturevalue("no_compile")
    state = SimpleNamespace(launches=[], code=0, device=0, stream=7, elsewhere=[], modules=0)

    def record(block):
        head = loader.LAUNCH_HEAD.size
        state.launches.append((block[head:], loader.LAUNCH_HEAD.unpack_from(block)[0]))
        return state.code

    def get_module(spec):
        state.modules += 1
        return loader.KernelModule(spec=spec, path=Path("stand-in"), manifest={}, rows_per_cta=64, split_align=64,
                                   _run=record, _error_string=lambda code: b"an injected error",
                                   _ctas_per_sm=lambda: 2)

    def launch_elsewhere(launcher, block, device_index):
        state.elsewhere.append(device_index)
        return launcher(block)

    monkeypatch.setattr(jit, "get_module", get_module)
    monkeypatch.setattr(_calls, "resident_ctas", lambda module, device: 132)
    monkeypatch.setattr(_batch, "resident_ctas", lambda module, device: 132)
    monkeypatch.setattr(_calls, "_current_device", lambda: state.device)
    monkeypatch.setattr(_calls, "_raw_stream", lambda device_index: state.stream)
    monkeypatch.setattr(_calls, "launch_elsewhere", launch_elsewhere)
    monkeypatch.setattr(torch, "empty", _empty)
    caches = (prefill._prepared, decode._prepared)
    for cache in caches:  # prepared calls of stand-in modules must not outlive the test
        cache.reset()
    yield state
    for cache in caches:
        cache.reset()


def pointers(launch) -> tuple:
    """(q, k, v, o, lse) addresses and (num_work, qo_len, kv_len) of a recorded launch."""
    values = _calls.PER_CALL.unpack_from(launch[0])
    return values[:5], values[13:16]


# ---------------------------------------------------------------------------
# single_prefill / single_decode


def _decode_args():
    return bf16(8, 128), bf16(16, 2, 128), bf16(16, 2, 128)


def _prefill_args():
    return bf16(4, 8, 128), bf16(16, 2, 128), bf16(16, 2, 128)


SINGLE = {"decode": (flashjit.single_decode_with_kv_cache, _decode_args),
          "prefill": (flashjit.single_prefill_with_kv_cache, _prefill_args)}


@pytest.mark.parametrize("op", SINGLE)
def test_a_repeated_call_prepares_once_and_packs_each_calls_addresses(op, gpu):
    fn, make = SINGLE[op]
    q, k, v = make()
    out = fn(q, k, v)
    assert gpu.modules == 1 and len(gpu.launches) == 1
    k2, v2 = bf16(40, 2, 128), bf16(40, 2, 128)  # other tensors, other token count: same signature
    out2 = fn(q, k2, v2)
    assert gpu.modules == 1 and len(gpu.launches) == 2
    addresses, counts = pointers(gpu.launches[1])
    assert addresses == (q.data_ptr(), k2.data_ptr(), v2.data_ptr(), out2.data_ptr(), 0)
    assert counts[2] == 40 and out2.shape == q.shape and out2.is_contiguous() and out.data_ptr() != 0
    assert gpu.launches[1][1] == 7


def _change(name, index, make, match):
    return pytest.param(index, make, match, id=name)


# (which argument, its replacement) after a cached call; the first call's check must answer.
SINGLE_CHANGES = [
    _change("k-dtype", 1, lambda t: cuda(t.half()), r"^k: expected dtype torch.bfloat16 \(the dtype of q\), got "
                                                    r"torch.float16"),
    _change("k-device", 1, lambda t: cuda(t, 1), r"^k: expected a tensor on cuda:0 \(where q is\), got cuda:1"),
    _change("v-on-cpu", 2, lambda t: t.as_subclass(torch.Tensor), r"^v: expected a CUDA tensor, got a tensor on cpu"),
    _change("q-on-cpu", 0, lambda t: t.as_subclass(torch.Tensor), r"^q: expected a CUDA tensor, got a tensor on cpu"),
    _change("k-stride", 1, lambda t: cuda(torch.randn(t.shape[0], 2, 132).to(BF16)[..., :128]),
            r"^k: expected a 16-byte aligned tensor with strides that are multiples of 8 elements"),
    _change("k-head_dim-not-contiguous", 1, lambda t: cuda(t.transpose(1, 2).contiguous().transpose(1, 2)),
            r"^k: the last \(head_dim\) dimension must be contiguous"),
    _change("k-misaligned", 1, lambda t: misaligned(*t.shape), r"^k: expected a 16-byte aligned tensor"),
    _change("v-misaligned", 2, lambda t: misaligned(*t.shape), r"^v: expected a 16-byte aligned tensor"),
    _change("k-heads", 1, lambda t: bf16(t.shape[0], 3, 128), r"^v: expected 16 tokens x 3 heads in layout NHD "
                                                              r"\(as k\), got shape \(16, 2, 128\)"),
    _change("v-tokens", 2, lambda t: bf16(t.shape[0] + 1, 2, 128), r"^v: expected 16 tokens \(as k\) in layout NHD"),
    _change("q-head_dim", 0, lambda t: cuda(t[..., :64].contiguous()), r"^k: expected head_dim 64 \(as q\), got 128"),
]


@pytest.mark.parametrize("index,make,match", SINGLE_CHANGES)
@pytest.mark.parametrize("op", SINGLE)
def test_a_changed_signature_after_a_cached_call_gets_its_check(op, index, make, match, gpu):
    fn, make_args = SINGLE[op]
    args = list(make_args())
    fn(*args)
    fn(*args)
    changed = list(args)
    changed[index] = make(args[index])
    with pytest.raises(ValueError, match=match):
        fn(*changed)
    assert len(gpu.launches) == 2
    fn(*args)  # the cached signature still runs
    assert len(gpu.launches) == 3


def test_long_decode_splits_its_keys_and_prefill_tiles_get_bands(gpu):
    q, k, v = bf16(8, 128), bf16(4096, 2, 128), bf16(4096, 2, 128)
    flashjit.single_decode_with_kv_cache(q, k, v)
    flashjit.single_decode_with_kv_cache(q, k, v)
    values = _calls.PER_CALL.unpack_from(gpu.launches[-1][0])
    partial_o, partial_lse, (num_work, qo_len, kv_len, splits, chunk, _) = values[11], values[12], values[13:]
    assert (num_work, qo_len, kv_len) == (1, 1, 4096) and splits > 1 and chunk * splits >= 4096
    assert partial_o and partial_lse == partial_o + 4 * 8 * splits * 128  # after the partial outputs
    q = bf16(64, 8, 128)  # 256 rows of 64: four row tiles
    flashjit.single_prefill_with_kv_cache(q, k[:64], v[:64], causal=True)
    flashjit.single_prefill_with_kv_cache(q, k[:64], v[:64], causal=True)
    assert _calls.PER_CALL.unpack_from(gpu.launches[-1][0])[13:16] == (4, 64, 64)


def test_the_unsplit_block_is_the_stream_and_the_struct_head_with_null_batch_pointers():
    pack = _calls.block_packer("5Q64x3i", _calls._UNSPLIT_COUNTS + b"tail")
    assert pack(9, 1, 2, 3, 4, 5, 6, 7, 8, _calls._UNSPLIT_COUNTS + b"tail") == loader.LAUNCH_HEAD.pack(9) + \
        _calls.PER_CALL.pack(1, 2, 3, 4, 5, 0, 0, 0, 0, 0, 0, 0, 0, 6, 7, 8, 1, 0, 0) + b"tail"


def test_q_misaligned_on_tensor_cores_only(gpu):
    q, k, v = _prefill_args()
    flashjit.single_prefill_with_kv_cache(q, k, v, use_tensor_cores=True)
    with pytest.raises(ValueError, match=r"^q: expected a 16-byte aligned tensor"):
        flashjit.single_prefill_with_kv_cache(misaligned(*q.shape), k, v, use_tensor_cores=True)
    flashjit.single_prefill_with_kv_cache(q, k, v, use_tensor_cores=False)
    flashjit.single_prefill_with_kv_cache(misaligned(*q.shape), k, v, use_tensor_cores=False)  # CUDA cores: scalar Q
    assert len(gpu.launches) == 3


def test_options_are_part_of_the_signature(gpu):
    q, k, v = _decode_args()
    flashjit.single_decode_with_kv_cache(q, k, v)
    with pytest.raises(ValueError, match=r"^window_left: expected -1"):
        flashjit.single_decode_with_kv_cache(q, k, v, window_left=-2)
    with pytest.raises(NotImplementedError, match=r"^pos_encoding_mode='ROPE_LLAMA'"):
        flashjit.single_decode_with_kv_cache(q, k, v, pos_encoding_mode="ROPE_LLAMA")
    out, lse = flashjit.single_decode_with_kv_cache(q, k, v, return_lse=True)
    assert lse.shape == (8,) and lse.dtype == torch.float32
    assert pointers(gpu.launches[-1])[0][4] == lse.data_ptr() and gpu.modules == 2  # the LSE variant


def test_stream_and_device_are_read_on_every_call(gpu):
    q, k, v = _decode_args()
    flashjit.single_decode_with_kv_cache(q, k, v)
    gpu.stream = 99
    flashjit.single_decode_with_kv_cache(q, k, v)
    assert [stream for _, stream in gpu.launches] == [7, 99] and gpu.elsewhere == []
    gpu.device = 1  # torch's current device is not the tensors': the launch goes through a device guard
    flashjit.single_decode_with_kv_cache(q, k, v)
    assert gpu.elsewhere == [0] and len(gpu.launches) == 3


def test_a_failed_launch_raises_naming_the_configuration(gpu):
    q, k, v = _decode_args()
    flashjit.single_decode_with_kv_cache(q, k, v)
    gpu.code = 700
    with pytest.raises(KernelLaunchError, match=r"single_decode_bf16_d128.*: CUDA error 700 \(an injected error\)"):
        flashjit.single_decode_with_kv_cache(q, k, v)


def test_a_long_grouped_causal_prompt_on_fa3_takes_a_walk(gpu, monkeypatch):
    """fa3's persistent grid (ops._walk): a single causal GQA prompt whose rounds
    would not balance gets a walk on the device, named by p.cta_walk in the
    launch's params, made once per shape; a balanced (non-causal) one keeps the
    rounds (cta_walk null), as does any once the walks kept fill their budget."""
    from flashjit import arch
    from flashjit.ops import _plan, _walk

    monkeypatch.setattr(arch, "backend_targets", lambda: ("sm_90a",))
    monkeypatch.setattr(_walk, "_WALKS", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CPU build's torch lacks it
    walk_at = loader.AttentionParams.cta_walk.offset
    q, k, v = bf16(2048, 32, 128), bf16(2048, 8, 128), bf16(2048, 8, 128)  # 128 tiles of 64 rows x 8 KV heads

    def launched_walk(causal: bool) -> int:
        flashjit.single_prefill_with_kv_cache(q, k, v, causal=causal, backend="fa3")
        return struct.unpack_from("=Q", gpu.launches[-1][0], walk_at)[0]

    address = launched_walk(True)
    assert address != 0 and launched_walk(True) == address and len(_walk._WALKS) == 1
    (_, buffer), = _walk._WALKS.values()
    assert buffer.data_ptr() == address
    values = _calls.PER_CALL.unpack_from(gpu.launches[-1][0])
    bands = values[18]
    costs = [_plan._item_cost(2048, 2048, t, 64, 4, True, 64) for t in reversed(range(128))]
    assert bands > 0 and buffer.tolist() == _plan.deal_positions(costs, 8, bands, 132)
    assert buffer.tolist()[0] == 132  # the grid it is for: one CTA per SM of the stand-in's wave
    assert launched_walk(False) == 0
    # Once the walks kept hold their budget, a new shape runs the rounds.
    monkeypatch.setattr(_walk, "_WALKS", {})
    monkeypatch.setattr(_walk, "_walk_bytes", _walk._WALKS_BYTES)
    assert launched_walk(True) == 0 and _walk._WALKS == {}
