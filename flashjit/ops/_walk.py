"""fa3's persistent grids take the launch positions in the order a plan deals
them out (ops._plan.deal_positions, work.cuh CtaWalk) where the kernel's own
rounds would not balance: which configurations do, and single requests' walks
on the device (a batch's walk is a section of its plan's ints, ops._batch)."""

from __future__ import annotations

import torch

from ..kernels import fa3 as fa3_kernels
from ..spec import MLA_OPS, KernelSpec
from ._plan import deal_positions, single_request_costs

# Single requests' walks on the device, by everything a walk depends on:
# (address, the tensor holding it). Never freed: a captured CUDA graph may hold
# the address. Once they hold _WALKS_BYTES (a 16k-token prompt's walk at four
# query heads per KV head: 17 KB), new shapes take the kernel's rounds.
_WALKS: dict = {}
_WALKS_BYTES = 16 << 20
_walk_bytes = 0


def single_request_walk(qo_len: int, kv_len: int, *, group: int, rows_per_cta: int, key_tile: int,
                        num_kv_heads: int, band_items: int, ctas: int, causal: bool, device: torch.device) -> int:
    """The device address of a single request's walk (p.cta_walk), 0 for the
    kernel's rounds: where they balance, once the walks kept hold _WALKS_BYTES,
    or while a CUDA graph is being captured (no copy to the device then)."""
    global _walk_bytes
    key = (device.index, qo_len, kv_len, group, rows_per_cta, key_tile, num_kv_heads, band_items, ctas, causal)
    if key in _WALKS:
        return _WALKS[key][0]
    if _walk_bytes >= _WALKS_BYTES or torch.cuda.is_current_stream_capturing():
        return 0
    costs = single_request_costs(qo_len, kv_len, group=group, rows_per_cta=rows_per_cta, causal=causal,
                                 key_tile=key_tile)
    walk = deal_positions(costs, num_kv_heads, band_items, ctas)
    buffer = None
    if walk is not None:
        buffer = torch.empty(len(walk), dtype=torch.int32, device=device)
        buffer.copy_(torch.tensor(walk, dtype=torch.int32))
        _walk_bytes += 4 * len(walk)
    _WALKS[key] = (0 if buffer is None else buffer.data_ptr(), buffer)
    return _WALKS[key][0]


def walks_positions(spec: KernelSpec) -> bool:
    """Whether the configuration's kernel runs a persistent grid of one CTA per
    SM that takes a plan's walk (p.cta_walk; fa3_launch.cuh)."""
    return spec.backend == "fa3" and spec.op not in MLA_OPS and fa3_kernels.tiling(spec).persistent
