"""The shared-memory offsets of the tile copies (fa2_primitives.cuh: SwizzledTile,
TileRows, span_at) on the CPU, for the layouts fa3 at head dim 96 copies into:
the formulas restated in Python, each thread's copies enumerated, and every
(row, 16-byte chunk) of the data written exactly once, where the wgmma
descriptors read it (BlockedTile: 64-column blocks of 128-byte rows, chunk c of
row r at c ^ (r % 8)), from the row's own bytes."""

from __future__ import annotations

import pytest


def blocked_at(rows: int, row: int, chunk: int) -> int:
    """SwizzledTile<128, rows * 128>::at: block chunk // 8, then the XOR within the 128-byte line."""
    return row * 128 + (chunk // 8) * rows * 128 + (((chunk % 8) ^ (row % 8)) << 4)


def pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def span_at(off: int, j: int, span_bytes: int, spans: int, rows: int) -> int:
    """TileRows::span_at for a BlockedTile of `rows` rows."""
    if span_bytes % 128 == 0 or spans == 1:
        return off + (j * span_bytes // 128) * rows * 128
    return (off ^ ((j & 1) << 6)) + (j // 2) * rows * 128


def copies(rows: int, dim: int, threads: int, span_bytes: int):
    """(shared offset, row, source byte within the row) of every thread's copies (PagedTileCopy::issue,
    copy_q_tile), with TileRows' split of rows and chunks over the threads."""
    data_chunks = span_bytes // 16
    chunks = pow2_at_least(data_chunks)
    spans = dim * 2 // span_bytes
    per_pass = threads // chunks
    per_thread = rows // per_pass if rows >= per_pass else 1
    assert (span_bytes % 128 == 0 or span_bytes == dim * 2 or span_bytes == 64) and dim * 2 % span_bytes == 0
    out = []
    for tid in range(threads):
        chunk, row0 = tid % chunks, tid // chunks
        if chunk >= data_chunks or (per_pass > rows and row0 >= rows):
            continue
        for i in range(per_thread):
            row = row0 + i * per_pass
            off = blocked_at(rows, row0, chunk) + i * per_pass * 128 if per_pass % 8 == 0 else \
                blocked_at(rows, row, chunk)
            for j in range(spans):
                out.append((span_at(off, j, span_bytes, spans, rows), row, j * span_bytes + chunk * 16))
    return out


@pytest.mark.parametrize("rows,dim,threads,span", [
    (128, 96, 128, 64),    # fa3's paged gather at 96: 64-byte halves, 4 threads a row
    (64, 96, 128, 192),    # fa3's Q copy at 96: the whole row, 16 threads a row (4 copy nothing)
    (128, 128, 128, 128),  # d128's gather: 128-byte lines
    (128, 256, 128, 128),
    (64, 192, 128, 128),
])
def test_each_chunk_of_the_data_lands_once_where_wgmma_reads_it(rows, dim, threads, span):
    got = copies(rows, dim, threads, span)
    expected = {(blocked_at(rows, r, c), r, 16 * c) for r in range(rows) for c in range(dim // 8)}
    assert len(got) == len(expected) and set(got) == expected


def test_a_64_byte_span_is_its_chunks_four_on():
    """span_at's XOR of bit 6: chunk c < 4 of a row and chunk c + 4 differ in chunk bit 2 alone, which the
    swizzle XORs with the row's and no row or block offset sets."""
    for rows in (64, 128):
        for row in range(rows):
            for c in range(4):
                for j in range(3):
                    assert span_at(blocked_at(rows, row, c), j, 64, 3, rows) == blocked_at(rows, row, c + 4 * j)
