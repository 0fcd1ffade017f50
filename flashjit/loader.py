"""Loading a compiled library and calling it through its plain C ABI (ctypes).

The library is linked against the static CUDA runtime, so nothing but the
driver must be found at load time. A launch passes one block of bytes: torch's
raw stream handle (8 bytes, LAUNCH_HEAD) and the params struct right after it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import FlashjitError, KernelLaunchError
from .spec import UTILITY_OPS, KernelSpec

ABI_VERSION = 12  # FLASHJIT_ABI_VERSION in templates/include/flashjit/common/attention_params.cuh

# A launch block's head: the stream, in front of the params (FlashjitAttentionLaunch).
LAUNCH_HEAD = struct.Struct("=Q")

_p = ctypes.c_void_p
_i32 = ctypes.c_int32
_i64 = ctypes.c_int64


class AttentionParams(ctypes.Structure):
    """Mirror of FlashjitAttentionParams (attention_params.cuh); field order matters."""

    _fields_ = [
        ("q", _p), ("k", _p), ("v", _p), ("o", _p), ("lse", _p),
        ("qo_indptr", _p), ("kv_indptr", _p), ("kv_page_indices", _p), ("kv_last_page_len", _p),
        ("work", _p), ("merge_indptr", _p), ("partial_o", _p), ("partial_lse", _p),
        ("num_work", _i32), ("qo_len", _i32), ("kv_len", _i32), ("num_splits", _i32), ("kv_chunk", _i32),
        ("band_items", _i32),
        ("num_qo_heads", _i32), ("num_kv_heads", _i32), ("page_size", _i32),
        ("q_stride_n", _i64), ("q_stride_h", _i64),
        ("k_stride_n", _i64), ("k_stride_h", _i64), ("k_stride_page", _i64),
        ("v_stride_n", _i64), ("v_stride_h", _i64), ("v_stride_page", _i64),
        ("o_stride_n", _i64), ("o_stride_h", _i64), ("lse_stride_n", _i64),
        ("sm_scale", ctypes.c_float), ("logits_soft_cap", ctypes.c_float), ("window_left", _i32),
        ("invariant_chunk", _i32),
        ("k_scale", ctypes.c_float), ("v_scale", ctypes.c_float), ("k_scale_ptr", _p), ("v_scale_ptr", _p),
        ("sinks", _p), ("custom_mask", _p), ("mask_indptr", _p), ("mask_full_keys", _p), ("cta_walk", _p),
        ("q_pe_stride_n", _i64), ("q_pe_stride_h", _i64), ("q_pe", _p),
    ]


class AppendParams(ctypes.Structure):
    """Mirror of FlashjitAppendParams (append_paged.cuh); field order matters."""

    _fields_ = [
        ("key", _p), ("value", _p), ("k_cache", _p), ("v_cache", _p),
        ("batch_indices", _p), ("positions", _p), ("kv_indices", _p), ("kv_indptr", _p),
        ("nnz", _i32), ("num_heads", _i32), ("page_size", _i32), ("reserved", _i32),
        ("key_stride_n", _i64), ("key_stride_h", _i64), ("value_stride_n", _i64), ("value_stride_h", _i64),
        ("k_stride_page", _i64), ("k_stride_slot", _i64), ("k_stride_h", _i64),
        ("v_stride_page", _i64), ("v_stride_slot", _i64), ("v_stride_h", _i64),
        ("k_scale", ctypes.c_float), ("v_scale", ctypes.c_float), ("k_scale_ptr", _p), ("v_scale_ptr", _p),
    ]


@dataclass
class KernelModule:
    """A loaded configuration: call `run(params, stream)`; `tolerance` is its profile.
    _run: the C entry point, (launch block) -> cudaError_t value."""

    spec: KernelSpec
    path: Path
    manifest: dict
    rows_per_cta: int
    split_align: int   # split-KV chunks must be multiples of this many keys
    _run: object
    _error_string: object
    _ctas_per_sm: object = None
    _occupancy: dict = None  # device index -> CTAs per SM
    # Libraries whose kernel depends on the head count (fa2 MLA): C entry points
    # (rows per CTA, split align, CTAs per SM) of the kernel `heads` heads run.
    _for_heads: tuple | None = None
    _views: dict = None  # heads -> the module as planned for them

    def for_group(self, heads: int) -> "KernelModule":
        """This module with the rows per CTA, split-KV alignment and occupancy of
        the kernel that `heads` query heads per KV head run; itself where the
        library has one kernel shape."""
        if self._for_heads is None:
            return self
        rows_for, align_for, ctas_for = self._for_heads
        if (rows_for(heads), align_for(heads)) == (self.rows_per_cta, self.split_align):
            return self
        if self._views is None:
            self._views = {}
        view = self._views.get(heads)
        if view is None:
            view = dataclasses.replace(self, rows_per_cta=rows_for(heads), split_align=align_for(heads),
                                       _ctas_per_sm=lambda: ctas_for(heads), _occupancy=None, _for_heads=None)
            self._views[heads] = view
        return view

    @property
    def tolerance_profile(self) -> dict:
        """The profile stored at build time, or, for a library built under an older
        error model (the cache key does not hold the model), today's."""
        from .error_model import MODEL_VERSION, profile

        stored = self.manifest["tolerance"]
        return stored if stored.get("model") == MODEL_VERSION else profile(self.spec)

    def ctas_per_sm(self, device_index: int) -> int:
        """CTAs of the kernel one SM holds on that (current) device; at least 1."""
        if self._occupancy is None:
            self._occupancy = {}
        if device_index not in self._occupancy:
            self._occupancy[device_index] = max(1, int(self._ctas_per_sm()))
        return self._occupancy[device_index]

    def run(self, params: bytes, stream: int) -> None:
        """params: the bytes of an AttentionParams (see ops._calls)."""
        code = self._run(LAUNCH_HEAD.pack(stream) + params)
        if code != 0:
            raise self.launch_error(code)

    @property
    def launcher(self):
        """The bare C entry point, (launch block: stream and params bytes) ->
        cudaError_t value: the prepared calls of ops._calls keep it and skip
        run()'s Python frame."""
        return self._run

    def launch_error(self, code: int) -> KernelLaunchError:
        message = self._error_string(code).decode(errors="replace")
        return KernelLaunchError(f"{self.spec.name}: CUDA error {code} ({message}) at launch")


def load_library(spec: KernelSpec, path: Path, manifest: dict) -> KernelModule:
    """dlopen()s the artifact (already verified against its manifest) and binds its C ABI.
    Raises FlashjitError if it cannot be loaded or speaks another ABI version."""
    try:
        lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
    except OSError as exc:
        raise FlashjitError(f"cannot load {path} for {spec.name}: {exc}") from exc
    lib.flashjit_abi_version.restype = ctypes.c_int
    if lib.flashjit_abi_version() != ABI_VERSION:
        raise FlashjitError(f"{path} speaks ABI {lib.flashjit_abi_version()}, this flashjit {ABI_VERSION}; "
                            f"run `flashjit cache clear`")
    utility = spec.op in UTILITY_OPS
    mirror = AppendParams if utility else AttentionParams
    lib.flashjit_params_size.restype = ctypes.c_int
    if lib.flashjit_params_size() != ctypes.sizeof(mirror):
        raise FlashjitError(f"{path}: its params struct is {lib.flashjit_params_size()} bytes, the host mirror "
                            f"{ctypes.sizeof(mirror)}; run `flashjit cache clear`")
    run = lib.flashjit_append_run if utility else lib.flashjit_attention_run
    # No argtypes: ctypes passes a bytes argument as a pointer to its buffer,
    # uncopied, where argtypes' converters cost as much again as the rest of the call.
    run.restype = ctypes.c_int
    err = lib.flashjit_error_string
    err.argtypes = [ctypes.c_int]
    err.restype = ctypes.c_char_p
    if utility:
        return KernelModule(spec=spec, path=path, manifest=manifest, rows_per_cta=0, split_align=0, _run=run,
                            _error_string=err)
    lib.flashjit_rows_per_cta.restype = ctypes.c_int
    lib.flashjit_split_align.restype = ctypes.c_int
    lib.flashjit_ctas_per_sm.restype = ctypes.c_int
    for_heads = None
    if hasattr(lib, "flashjit_rows_per_cta_for"):
        for_heads = (lib.flashjit_rows_per_cta_for, lib.flashjit_split_align_for, lib.flashjit_ctas_per_sm_for)
        for fn in for_heads:
            fn.argtypes = [ctypes.c_int]
            fn.restype = ctypes.c_int
    return KernelModule(spec=spec, path=path, manifest=manifest, rows_per_cta=lib.flashjit_rows_per_cta(),
                        split_align=lib.flashjit_split_align(), _run=run, _error_string=err,
                        _ctas_per_sm=lib.flashjit_ctas_per_sm, _for_heads=for_heads)
