"""Shared by every attention op: choose the configuration, fill the C params
from tensors, launch on torch's current stream."""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass

import torch

from .. import arch, jit
from ..loader import AttentionParams, KernelModule
from ..spec import KernelSpec, canonical_dtype
from . import _checks, _invariant
from ._plan import CHUNK_ALIGN, MIN_CHUNK_KEYS, ceil_div, single_request_band_items

log = logging.getLogger("flashjit")
_announced: set = set()


def select_spec(op: str, dtype: torch.dtype, head_dim: int, *, backend: str, use_tensor_cores: bool | None,
                causal: bool, window: bool, soft_cap: bool, return_lse: bool, strict: bool | None = None,
                head_dim_vo: int | None = None, batch_invariant: bool = False) -> KernelSpec:
    """Resolves backend/tensor cores (logging the choice once per configuration) and validates.
    strict: an explicit backend this GPU or op cannot run raises instead of running fa2
    (None: FLASHJIT_STRICT_BACKEND). head_dim_vo: V's width where it differs from head_dim (MLA).
    batch_invariant: ops._invariant.kernel_choice (decode on its prefill op's backend and tiling)."""
    name = canonical_dtype(dtype)
    backend_op = op
    if batch_invariant:
        backend_op, use_tensor_cores, causal = _invariant.kernel_choice(op, name, causal)
    chosen_backend, tc, reason = arch.choose_backend(backend_op, name, use_tensor_cores, backend, strict=strict)
    if batch_invariant:
        reason += f"; batch-invariant mode: {backend_op}'s backend and tiling" if backend_op != op \
            else "; batch-invariant mode"
    spec = KernelSpec.make(op, name, head_dim, head_dim_vo=head_dim_vo, backend=chosen_backend, use_tensor_cores=tc,
                           causal=bool(causal), sliding_window=window, soft_cap=soft_cap,
                           return_lse=return_lse).validate()
    if (backend == "auto" or use_tensor_cores is None or batch_invariant) and spec not in _announced:
        _announced.add(spec)
        log.info("flashjit: %s -> %s (%s)", op, spec.name, reason)
    return spec


# FlashjitAttentionParams starts with thirteen pointers and six per-call counts
# (num_work, qo_len, kv_len, num_splits, kv_chunk, band_items); everything after them is fixed
# per call signature (configuration, heads, strides, scalars): packed once into `tail`.
PER_CALL = struct.Struct("=13Q6i")
NO_BATCH = (0, 0, 0, 0, 0, 0)  # qo/kv indptr, page indices, last page lens, work, merge indptr
_CACHE_LIMIT = 4096


def make_params(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_strides: tuple[int, int],
                lse_stride: int, kv_layout: str, sm_scale: float, window_left: int, soft_cap: float
                ) -> AttentionParams:
    """The non-pointer fields for q/o [tokens, heads, dim] and k/v in kv_layout."""
    _, num_kv_heads, _, k_sn, k_sh = _checks.kv_dims("k", k, kv_layout)
    _, _, _, v_sn, v_sh = _checks.kv_dims("v", v, kv_layout)
    return fill_params(q, num_kv_heads, (k_sn, k_sh, 0), (v_sn, v_sh, 0), 0, out_strides, lse_stride, sm_scale,
                       window_left, soft_cap)


def check_kv_strides(name: str, strides: tuple, page_size: int, element_size: int) -> None:
    """Decode kernels address K/V rows with 32-bit byte strides: each stride
    below 2 GiB, and one page's tokens below 4 GiB."""
    for label, stride in zip(("token", "head", "page"), strides):
        if stride * element_size >= 2**31:
            raise ValueError(f"{name}: expected a {label} stride below 2 GiB, got {stride * element_size} bytes "
                             f"({stride} elements)")
    if page_size and strides[0] * element_size * page_size >= 2**32:
        raise ValueError(f"{name}: expected the {page_size} tokens of a page to span below 4 GiB, got "
                         f"{strides[0] * element_size * page_size} bytes")


def fill_params(q: torch.Tensor, num_kv_heads: int, k_strides: tuple, v_strides: tuple, page_size: int,
                out_strides: tuple[int, int], lse_stride: int, sm_scale: float, window_left: int, soft_cap: float
                ) -> AttentionParams:
    """The non-pointer fields; k/v strides are (token, head, page) in elements.
    Raises ValueError for K/V strides the kernels cannot address (see check_kv_strides)."""
    for name, strides in (("k", k_strides), ("v", v_strides)):
        check_kv_strides(name, strides, page_size, q.element_size())
    p = AttentionParams()
    p.num_qo_heads, p.num_kv_heads, p.page_size = q.shape[-2], num_kv_heads, page_size
    p.q_stride_n, p.q_stride_h = (q.stride(0), q.stride(1)) if q.dim() == 3 else (0, q.stride(0))
    p.k_stride_n, p.k_stride_h, p.k_stride_page = k_strides
    p.v_stride_n, p.v_stride_h, p.v_stride_page = v_strides
    p.o_stride_n, p.o_stride_h = out_strides
    p.lse_stride_n = lse_stride
    p.sm_scale, p.logits_soft_cap, p.window_left = sm_scale, soft_cap, window_left
    return p


@dataclass(frozen=True)
class Prepared:
    """Everything a call needs beyond the tensors' addresses and token counts,
    computed once per call signature (heads, dims, strides, dtypes, devices,
    scalars), so a repeated call costs a dict lookup, the output allocations and
    one packed struct."""

    module: KernelModule
    tail: bytes
    out_shape: tuple
    lse_shape: tuple | None
    device_index: int
    group: int = 1                         # query heads per KV head
    split_ctas: int = 0                    # split the keys while fewer CTAs than this; 0: never
    aligned_args: tuple = ("k", "v")       # tensors the kernel reads with 16-byte vectors
    invariant_chunk: int = 0               # batch-invariant mode: keys per chunk, whatever the grid (0: normal)

    @staticmethod
    def make(module: KernelModule, params: AttentionParams, out_shape, lse_shape, device: torch.device,
             group: int = 1, invariant_chunk: int = 0) -> "Prepared":
        """A single-request launch; it splits the keys across CTAs (flash-decoding)
        when the grid would not fill one full wave of the GPU (as ops._plan), or,
        with invariant_chunk, into chunks of that many keys whatever the grid."""
        split_ctas = resident_ctas(module, device)
        # Tensor-core kernels also copy Q (and write O) in 16-byte vectors.
        aligned = ("q", "k", "v", "out") if module.spec.use_tensor_cores else ("k", "v")
        return Prepared(module, bytes(params)[PER_CALL.size:], tuple(out_shape) if out_shape else (),
                        tuple(lse_shape) if lse_shape is not None else None, device.index, group, split_ctas,
                        aligned, invariant_chunk=invariant_chunk)

    @property
    def num_kv_heads(self) -> int:
        return self.out_shape[-2] // self.group

    def num_work(self, qo_len: int) -> int:
        """CTAs per KV head for one request of qo_len tokens (single-request launches)."""
        return ceil_div(qo_len * self.group, self.module.rows_per_cta)

    def _split(self, num_work: int, kv_len: int) -> tuple[int, int]:
        """(num_splits, kv_chunk): enough splits to reach split_ctas CTAs, each of
        at least MIN_CHUNK_KEYS keys; (1, 0) when the grid is large enough."""
        if self.invariant_chunk:
            return _invariant.single_split(kv_len, self.invariant_chunk)
        ctas = num_work * self.num_kv_heads
        if not 0 < ctas < self.split_ctas or kv_len < 2 * MIN_CHUNK_KEYS:
            return 1, 0
        splits = min(ceil_div(self.split_ctas, ctas), kv_len // MIN_CHUNK_KEYS)
        chunk = ceil_div(ceil_div(kv_len, splits), CHUNK_ALIGN) * CHUNK_ALIGN
        return ceil_div(kv_len, chunk), chunk

    def launch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor | None, num_work: int = 0, qo_len: int = 0, kv_len: int = 0) -> None:
        qp, kp, vp, op = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
        if (kp | vp | (qp | op if len(self.aligned_args) > 2 else 0)) & 15:
            for name, ptr in zip(("q", "k", "v", "out"), (qp, kp, vp, op)):
                if name in self.aligned_args and ptr & 15:
                    raise ValueError(f"{name}: expected a 16-byte aligned tensor (e.g. .contiguous()), "
                                     f"got data_ptr % 16 = {ptr % 16}")
        splits, chunk = self._split(num_work, kv_len)
        if splits > 1:
            # Freed when this call returns: the caching allocator hands the block out
            # again only to work queued after this kernel on the same stream.
            rows, dim = qo_len * self.out_shape[-2], self.out_shape[-1]
            partial = torch.empty(rows * splits * (dim + 1), dtype=torch.float32, device=q.device)
            partial_o = partial.data_ptr()
            partial_lse = partial_o + 4 * rows * splits * dim
        else:
            partial_o = partial_lse = 0
        # One row tile (every decode) launches in the same order whatever the bands.
        bands = single_request_band_items(qo_len, kv_len, group=self.group, rows_per_cta=self.module.rows_per_cta,
                                          num_kv_heads=self.num_kv_heads, resident_ctas=self.split_ctas,
                                          causal=self.module.spec.causal) if num_work > 1 else 0
        params = PER_CALL.pack(qp, kp, vp, op, 0 if lse is None else lse.data_ptr(), *NO_BATCH, partial_o,
                               partial_lse, num_work, qo_len, kv_len, splits, chunk, bands) + self.tail
        run_on(self.module, params, self.device_index)


def run_on(module: KernelModule, params: bytes, device_index: int) -> None:
    """Launches on torch's current stream of the tensors' device."""
    if device_index != _current_device():
        with torch.cuda.device(device_index):
            module.run(params, _raw_stream(device_index))
    else:
        module.run(params, _raw_stream(device_index))


_SM_COUNTS: dict = {}


def resident_ctas(module: KernelModule, device: torch.device) -> int:
    """CTAs of the module's kernel that run at once on the device: one full wave."""
    if device.index not in _SM_COUNTS:
        _SM_COUNTS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    with torch.cuda.device(device):  # the occupancy query asks the current device
        return _SM_COUNTS[device.index] * module.ctas_per_sm(device.index)


def prepare_single_request(op: str, q, k, v, kv_layout: str, head_dim: int, num_qo_heads: int, num_kv_heads: int,
                           *, causal: bool, sm_scale, window_left, logits_soft_cap, backend: str,
                           use_tensor_cores, return_lse: bool, strict: bool | None = None,
                           batch_invariant: bool = False) -> Prepared:
    """The shared end of single_prefill / single_decode preparation, after their
    own structural checks: scalars, configuration, placement, kernel, params.
    The output is allocated [tokens, heads, dim] (decode: [heads, dim]) contiguous."""
    sm_scale, window_left, cap, has_window, has_cap = _checks.variant_values(sm_scale, head_dim, window_left,
                                                                             logits_soft_cap)
    spec = select_spec(op, q.dtype, head_dim, backend=backend, use_tensor_cores=use_tensor_cores, causal=causal,
                       window=has_window, soft_cap=has_cap, return_lse=return_lse, strict=strict,
                       batch_invariant=batch_invariant)
    check_placement(q, k, v, spec)
    module = jit.get_module(spec)
    params = make_params(q, k, v, (num_qo_heads * head_dim, head_dim), num_qo_heads, kv_layout, sm_scale,
                         window_left, cap)
    chunk = _invariant.chunk_keys(None, True, module.split_align) if batch_invariant else 0
    return Prepared.make(module, params, (num_qo_heads, head_dim), (num_qo_heads,) if return_lse else None,
                         q.device, group=num_qo_heads // num_kv_heads, invariant_chunk=chunk)


def remember(cache: dict, key, prep: Prepared) -> Prepared:
    """Stores a prepared call; a cache that outgrows its bound starts over."""
    if key is not None:
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        cache[key] = prep
    return prep


def signature(q, k, v, kv_layout: str, q_has_tokens: bool, options: tuple) -> tuple | None:
    """What a prepared call depends on: everything but the token counts (which
    only enter the per-call counts), or None for arguments we cannot hash."""
    try:
        # NHD: drop the token count from K/V shapes. HND: the head stride holds
        # it anyway, so the full shape costs nothing more.
        ks, vs = (k.shape[1:], v.shape[1:]) if kv_layout == "NHD" else (k.shape, v.shape)
        return (q.shape[1:] if q_has_tokens else q.shape, q.stride(), q.dtype, q.device, ks, k.stride(), k.dtype,
                k.device, vs, v.stride(), v.dtype, v.device, kv_layout, options)
    except (AttributeError, TypeError):
        return None


def kv_tokens(k: torch.Tensor, v: torch.Tensor, kv_layout: str) -> int:
    token_dim = 1 if kv_layout == "HND" else 0
    n = k.shape[token_dim]
    if v.shape[token_dim] != n:
        raise ValueError(f"v: expected {n} tokens (as k) in layout {kv_layout}, got shape {tuple(v.shape)}")
    return n


# torch's raw getters answer what current_device() and current_stream(i).cuda_stream
# do, several times cheaper (no lazy-init check, no Stream object).
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda device_index: torch.cuda.current_stream(device_index).cuda_stream)


def check_placement(q, k, v, spec: KernelSpec) -> None:
    """After every structural and scalar check: devices, then 16-byte alignment of
    what the kernel reads with vectors (K/V; Q too on tensor cores)."""
    _checks.check_device("q", q)
    _checks.check_device("k", k, q.device)
    _checks.check_device("v", v, q.device)
    if spec.use_tensor_cores:
        _checks.check_vector_aligned("q", q)
    _checks.check_vector_aligned("k", k)
    _checks.check_vector_aligned("v", v)


def check_qkv(q, k, v, kv_layout: str, q_ndim: int = 3) -> tuple[int, int, int, int]:
    """Structure of q [tokens, qo_heads, dim] (or [qo_heads, dim]) against k/v;
    returns (kv_tokens, num_qo_heads, num_kv_heads, head_dim). Devices are
    check_placement's job, so that shape mistakes read the same on any machine."""
    _checks.check_layout(kv_layout)
    _checks.check_tensor("q", q, q_ndim)
    _checks.check_tensor("k", k, 3)
    _checks.check_tensor("v", v, 3)
    _checks.check_same_dtype(q=q, k=k, v=v)
    kv_tokens, num_kv_heads, head_dim_k, _, _ = _checks.kv_dims("k", k, kv_layout)
    v_tokens, v_heads, head_dim_v, _, _ = _checks.kv_dims("v", v, kv_layout)
    num_qo_heads, head_dim_q = q.shape[-2], q.shape[-1]
    _checks.check_head_dim("q.shape[-1] (head_dim)", head_dim_q)
    if head_dim_k != head_dim_q:
        raise ValueError(f"k: expected head_dim {head_dim_q} (as q), got {head_dim_k}")
    if head_dim_v != head_dim_q:
        raise ValueError(f"v: expected head_dim {head_dim_q} (as q; head_dim_qk != head_dim_vo is not "
                         f"supported for this op), got {head_dim_v}")
    if (v_tokens, v_heads) != (kv_tokens, num_kv_heads):
        raise ValueError(f"v: expected {kv_tokens} tokens x {num_kv_heads} heads in layout {kv_layout} (as k), "
                         f"got shape {tuple(v.shape)}")
    _checks.check_heads(num_qo_heads, num_kv_heads)
    return kv_tokens, num_qo_heads, num_kv_heads, head_dim_q

