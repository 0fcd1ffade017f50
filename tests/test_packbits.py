"""packbits / segment_packbits on CPU against numpy.packbits and a bit-by-bit
loop: both bit orders, lengths that are not multiples of 8, empty segments,
non-bool inputs, bad input as a ValueError naming the argument."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashjit


def bit_by_bit(values: list[bool], bitorder: str) -> list[int]:
    """Byte b holds elements 8b..8b+7: the first in the top bit ("big") or the bottom one ("little")."""
    out = []
    for start in range(0, len(values), 8):
        byte = 0
        for k, bit in enumerate(values[start:start + 8]):
            if bit:
                byte |= 1 << (7 - k if bitorder == "big" else k)
        out.append(byte)
    return out


@pytest.mark.parametrize("bitorder", ["big", "little"])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 63, 1000])
def test_packbits_matches_numpy_and_bit_by_bit(n, bitorder):
    gen = torch.Generator().manual_seed(n)
    x = torch.rand(n, generator=gen) < 0.5
    y = flashjit.packbits(x, bitorder=bitorder)
    assert y.dtype == torch.uint8 and tuple(y.shape) == ((n + 7) // 8,)
    assert y.tolist() == np.packbits(x.numpy(), bitorder=bitorder).tolist()
    assert y.tolist() == bit_by_bit(x.tolist(), bitorder)


def test_packbits_default_is_big_as_flashinfer():
    """FlashInfer 0.7.2's packbits defaults to "big" (its docstring example: 0b10110011);
    its prefill wrappers pack custom masks with bitorder="little"."""
    x = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1], dtype=torch.bool)
    assert flashjit.packbits(x).tolist() == [0b10110011]
    assert flashjit.packbits(x, "little").tolist() == [0b11001101]


def test_packbits_takes_nonzero_as_one():
    x = torch.tensor([0.0, -2.5, float("nan"), 0.0, 1e-30, 0.0, 0.0, 3.0, 7.0])
    bits = [False, True, True, False, True, False, False, True, True]
    assert flashjit.packbits(x, "little").tolist() == bit_by_bit(bits, "little")
    as_int = torch.tensor([0, 5, -1, 0, 1, 0, 0, 2, 9], dtype=torch.int32)
    assert flashjit.packbits(as_int, "big").tolist() == bit_by_bit(bits, "big")


def test_a_custom_mask_packs_row_major_little():
    """A [qo_len, kv_len] mask flattened row-major: pair (i, j) is bit (i*kv_len + j) % 8
    of byte (i*kv_len + j) // 8, as FlashInfer's plan() packs custom_mask."""
    qo_len, kv_len = 3, 5
    mask = torch.ones(qo_len, kv_len, dtype=torch.bool).tril(kv_len - qo_len)
    packed = flashjit.packbits(mask.reshape(-1), bitorder="little")
    for i in range(qo_len):
        for j in range(kv_len):
            bit = i * kv_len + j
            assert bool(packed[bit // 8] >> (bit % 8) & 1) == bool(mask[i, j]), (i, j)


def reference_segments(x: torch.Tensor, indptr: list[int], bitorder: str) -> tuple[list[int], list[int]]:
    data, new_indptr = [], [0]
    for start, end in zip(indptr[:-1], indptr[1:]):
        data += np.packbits(x[start:end].numpy(), bitorder=bitorder).tolist()
        new_indptr.append(len(data))
    return data, new_indptr


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("bitorder", ["big", "little"])
def test_segment_packbits_matches_numpy_per_segment(bitorder, index_dtype):
    lengths = [0, 1, 7, 8, 9, 0, 0, 23, 64, 65, 3, 0]  # empty segments first, between and last
    indptr = [0]
    for n in lengths:
        indptr.append(indptr[-1] + n)
    x = torch.rand(indptr[-1], generator=torch.Generator().manual_seed(7)) < 0.5
    y, new_indptr = flashjit.segment_packbits(x, torch.tensor(indptr, dtype=index_dtype), bitorder=bitorder)
    data, expected_indptr = reference_segments(x, indptr, bitorder)
    assert y.dtype == torch.uint8 and new_indptr.dtype == torch.int32
    assert y.tolist() == data
    assert new_indptr.tolist() == expected_indptr
    for i, n in enumerate(lengths):
        assert expected_indptr[i + 1] - expected_indptr[i] == (n + 7) // 8
        segment = y[expected_indptr[i]:expected_indptr[i + 1]].tolist()
        assert segment == bit_by_bit(x[indptr[i]:indptr[i + 1]].tolist(), bitorder)


def test_segment_packbits_flashinfer_example_and_offsets():
    x = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1], dtype=torch.bool)
    y, new_indptr = flashjit.segment_packbits(x, torch.tensor([0, 4, 7, 11]), bitorder="big")
    assert y.tolist() == [0b10110000, 0b00100000, 0b11010000] and new_indptr.tolist() == [0, 1, 2, 3]
    # Segments need not start at 0 nor reach the end: only x[indptr[0]:indptr[-1]] is read.
    y, new_indptr = flashjit.segment_packbits(x, torch.tensor([2, 4, 10]), bitorder="little")
    assert y.tolist() == bit_by_bit([True, True], "little") + bit_by_bit(x[4:10].tolist(), "little")
    assert new_indptr.tolist() == [0, 1, 2]


def test_segment_packbits_without_segments_or_bits():
    y, new_indptr = flashjit.segment_packbits(torch.zeros(0, dtype=torch.bool), torch.tensor([0]))
    assert y.shape == (0,) and y.dtype == torch.uint8 and new_indptr.tolist() == [0]
    y, new_indptr = flashjit.segment_packbits(torch.zeros(4, dtype=torch.bool), torch.tensor([0, 0, 0]))
    assert y.shape == (0,) and new_indptr.tolist() == [0, 0, 0]


def test_packbits_traces_under_torch_compile():
    compiled = torch.compile(flashjit.packbits, backend="eager", fullgraph=True)
    x = torch.rand(21) < 0.5
    assert torch.equal(compiled(x, "little"), flashjit.packbits(x, "little"))


BAD_PACKBITS = [
    (dict(x=torch.zeros(2, 8, dtype=torch.bool)), r"^x: expected a 1-D tensor, got shape \(2, 8\)"),
    (dict(x=torch.tensor(True)), r"^x: expected a 1-D tensor"),
    (dict(x=[True, False]), r"^x: expected a 1-D torch.Tensor, got list"),
    (dict(x=torch.zeros(3, dtype=torch.complex64)), r"^x: expected a bool, integer or floating-point tensor"),
    (dict(x=torch.zeros(3, dtype=torch.bool), bitorder="middle"), r"^bitorder: expected 'big' or 'little'"),
    (dict(x=torch.zeros(3, dtype=torch.bool), bitorder="BIG"), r"^bitorder: expected 'big' or 'little'"),
]


@pytest.mark.parametrize("kwargs,match", BAD_PACKBITS)
def test_packbits_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        flashjit.packbits(**kwargs)


X = torch.zeros(10, dtype=torch.bool)
BAD_SEGMENTS = [
    (dict(indptr=torch.tensor([0, 6, 4])), r"^indptr: expected non-decreasing offsets, got indptr\[1\] = 6 > "),
    (dict(indptr=torch.tensor([0, 11])), r"^indptr: its last offset 11 is past the end of x \(10 elements\)"),
    (dict(indptr=torch.tensor([-1, 4])), r"^indptr: expected non-negative offsets"),
    (dict(indptr=torch.tensor([], dtype=torch.int32)), r"^indptr: expected at least one element"),
    (dict(indptr=torch.tensor([0.0, 4.0])), r"^indptr: expected a 1-D int32 or int64 tensor, got torch.float32"),
    (dict(indptr=torch.tensor([[0, 4]])), r"^indptr: expected a 1-D int32 or int64 tensor"),
    (dict(indptr=[0, 4]), r"^indptr: expected a 1-D int32 or int64 torch.Tensor, got list"),
    (dict(indptr=torch.tensor([0, 4]), bitorder="native"), r"^bitorder: expected 'big' or 'little'"),
    (dict(x=X.view(2, 5), indptr=torch.tensor([0, 4])), r"^x: expected a 1-D tensor"),
    (dict(indptr=torch.tensor([0, 4], device="meta")), r"^indptr: expected a tensor on cpu \(where x is\), got meta"),
]


@pytest.mark.parametrize("kwargs,match", BAD_SEGMENTS)
def test_segment_packbits_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        flashjit.segment_packbits(**{"x": X, **kwargs})
