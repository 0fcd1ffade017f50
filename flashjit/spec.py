"""What a kernel configuration is, its canonical name, and which ones exist.

A `KernelSpec` is fully resolved: no "auto" remains in it (flashjit.arch turns
"auto" into a backend). `validate()` raises ValueError for any combination we do
not generate, naming the supported set and the nearest working choice, before
anything is rendered or compiled.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass

# Canonical dtype names, their short form in kernel names, their CUDA type, and
# their unit roundoff (half an ulp at 1.0).
DTYPES = {
    "float16": ("f16", "__half", 2.0**-11),
    "bfloat16": ("bf16", "__nv_bfloat16", 2.0**-8),
    "float32": ("f32", "float", 2.0**-24),
    # FP8 (OCP formats, as torch names them): KV caches only, with per-tensor scales.
    "float8_e4m3fn": ("e4m3", "__nv_fp8_e4m3", 2.0**-4),
    "float8_e5m2": ("e5m2", "__nv_fp8_e5m2", 2.0**-3),
}
_DTYPE_ALIASES = {"fp16": "float16", "half": "float16", "f16": "float16", "bf16": "bfloat16",
                  "fp32": "float32", "float": "float32", "f32": "float32",
                  "e4m3": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e4m3fn": "float8_e4m3fn",
                  "e5m2": "float8_e5m2", "fp8_e5m2": "float8_e5m2"}
# KV-cache-only dtypes: dtype_kv may be one of them while q and o are fp16 or bf16.
KV_ONLY_DTYPES = ("float8_e4m3fn", "float8_e5m2")
# Largest finite value of each FP8 format: appends saturate there.
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
# Other platforms' FP8 formats (no negative zero, another exponent bias): named in errors.
FNUZ_DTYPES = ("float8_e4m3fnuz", "float8_e5m2fnuz")
# The configurations that read an FP8 KV cache (op, tensor cores); the rest say
# "not yet generated" and name this set. On tensor cores the fa2 backend reads
# them (its tiles widened in shared memory); FA3_FP8_OPS: those fa3 reads too.
FP8_KV_FAMILIES = (("single_decode", False), ("batch_decode_paged", False), ("append_paged", False),
                   ("single_decode", True), ("batch_decode_paged", True), ("single_prefill", True),
                   ("batch_prefill_ragged", True), ("batch_prefill_paged", True), ("mla_paged", True))
FA3_FP8_OPS: tuple[str, ...] = ("single_prefill", "batch_prefill_ragged", "batch_prefill_paged", "mla_paged")

ATTENTION_OPS = ("single_prefill", "single_decode", "batch_prefill_ragged", "batch_prefill_paged",
                 "batch_decode_paged")
# Latent attention (DeepSeek MLA) over a paged cache of ckv (512 wide, K and V)
# and kpe (64 wide, the rotary part of K): tensor cores only, one geometry.
MLA_OPS = ("mla_paged",)
MLA_HEAD_DIM_CKV = 512
MLA_HEAD_DIM_KPE = 64
# Ops that move KV data rather than attend: no tensor cores, no variant flags.
UTILITY_OPS = ("append_paged",)
OPS = ATTENTION_OPS + MLA_OPS + UTILITY_OPS
# Ops whose keys and values live in pages (kv_page_indices), and ops with one
# query token per request (their CUDA-core tiling splits keys across warps).
PAGED_OPS = ("batch_prefill_paged", "batch_decode_paged")
DECODE_OPS = ("single_decode", "batch_decode_paged")
# Ops not generated yet, and the available op nearest to each.
PLANNED_OPS: dict[str, str] = {}
# Every multiple of 16 from 32 to 256 (Phi's 80 and 96, 112, 160, 192, ...): every attention op.
HEAD_DIMS = tuple(range(32, 257, 16))
# Head dims past that run, generated for some (op, tensor cores) families only:
# 512 (models whose decode uses 512-wide heads) for decode on CUDA and tensor
# cores and for paged prefill on tensor cores, on fa2 (fa3 keeps FA3_HEAD_DIMS).
# Not for batch-invariant decode on CUDA cores, which runs the CUDA-core prefill
# kernel (spec.KernelSpec.invariant_decode), nor for head_dim_qk != head_dim_vo.
WIDE_HEAD_DIMS = (512,)
WIDE_HEAD_DIM_FAMILIES = (("single_decode", False), ("batch_decode_paged", False), ("single_decode", True),
                          ("batch_decode_paged", True), ("batch_prefill_paged", True))
ALL_HEAD_DIMS = HEAD_DIMS + WIDE_HEAD_DIMS
# Ops that take a custom mask (FlashInfer's custom_mask / packed_custom_mask),
# and whether the CUDA-core kernels read it yet.
MASK_OPS = ("single_prefill", "batch_prefill_ragged", "batch_prefill_paged")
MASK_ON_CUDA_CORES = False
# The head dims the fa3 backend generates; others run on fa2 (arch.choose_backend).
# 96 runs on tiles padded to whole 64-column blocks (docs/fa3.md). FA3_AUTO_HEAD_DIMS:
# those `auto` picks fa3 for, where a same-run table has it ahead of fa2; at the
# others fa3 runs when backend="fa3" asks for it. FA3_FP8_HEAD_DIMS: those whose
# fa3 kernels read an FP8 cache: whole 64-column blocks (fa3_fp8.cuh's loader).
FA3_HEAD_DIMS = (64, 96, 128, 192, 256)
FA3_AUTO_HEAD_DIMS = FA3_HEAD_DIMS  # 96: 1.7-2.0x fa2 (2026-12-07-h100-head-dims-sinks-speed.md)
FA3_FP8_HEAD_DIMS = tuple(d for d in FA3_HEAD_DIMS if d % 64 == 0)
# (head_dim_qk, head_dim_vo) pairs with V and O narrower than Q and K (DeepSeek-V2/V3's
# prefill), for QK_VO_OPS with K/V of q's dtype: CUDA cores, and fa2's tensor cores
# (its paged, FP8, TMA and split-keys kernels keep the two equal), and fa3's tensor cores.
QK_VO_HEAD_DIMS = ((192, 128),)
QK_VO_OPS = ("single_prefill", "batch_prefill_ragged")
BACKENDS = ("fa2", "fa3")
TENSOR_CORE_DTYPES = ("float16", "bfloat16")
TENSOR_CORE_OPS = ATTENTION_OPS + MLA_OPS
# Ops the fa3 backend (wgmma, sm_90a) generates; the others run on fa2.
FA3_OPS = ("single_prefill", "batch_prefill_ragged", "batch_prefill_paged", "mla_paged")
# A decode op with causal=True (no decode API has a causal mask: one query row
# sees every key) is batch-invariant mode's decode (ops/_invariant.py): its
# backend's prefill kernel, rows split over warps, on every backend, fa3 too.


def canonical_dtype(dtype) -> str:
    """Maps a torch dtype or a dtype name to its canonical name ("float16", "bfloat16",
    "float32", or for KV caches "float8_e4m3fn" / "float8_e5m2")."""
    name = str(dtype).removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name in FNUZ_DTYPES:
        raise ValueError(f"dtype: {name} is another platform's FP8 format (AMD's fnuz: no negative zero, exponent "
                         f"bias 8/16); NVIDIA GPUs use float8_e4m3fn and float8_e5m2, which flashjit reads")
    if name not in DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPES)} (or a torch dtype), got {dtype!r}")
    return name


def unit_roundoff(dtype) -> float:
    return DTYPES[canonical_dtype(dtype)][2]


def or_list(values) -> str:
    """'a, b or c'."""
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else ", ".join(values[:-1]) + " or " + values[-1]


def nearest_head_dims(value: int, dims=HEAD_DIMS) -> tuple[int, ...]:
    """The generated head dims either side of `value`, in order (100 -> (96, 112)),
    or the end of their range it lies beyond (8 -> (32,), 300 -> (256,)): the
    choices an error names for a head dim that is not generated."""
    below = [d for d in dims if d < value]
    above = [d for d in dims if d > value]
    return tuple(([max(below)] if below else []) + ([min(above)] if above else []))


def nearest_head_dim(value: int, dims=HEAD_DIMS) -> int:
    """The generated head dim closest to `value` (the smaller of two as close)."""
    return min(dims, key=lambda d: (abs(d - value), d))


def qk_vo_pairs() -> str:
    """The generated head_dim_qk/head_dim_vo pairs, in words ('192/128')."""
    return or_list(f"{qk}/{vo}" for qk, vo in QK_VO_HEAD_DIMS)


def qk_vo_text() -> str:
    """Where head_dim_qk != head_dim_vo is generated, in words (errors name it)."""
    return (f"head_dim_qk/head_dim_vo {qk_vo_pairs()} for {' and '.join(QK_VO_OPS)}, K/V of q's dtype, on CUDA cores "
            f"(fp16, bf16, fp32) or tensor cores (fp16, bf16; fa2, or fa3 on sm_90a)")


def head_dims_text(dims=HEAD_DIMS) -> str:
    """The generated head dims in words: 'a multiple of 16 from 32 to 256' where
    they are such a run, else the list ('64, 128 or 256')."""
    dims = sorted(dims)
    step = dims[1] - dims[0] if len(dims) > 2 else 0
    if step and dims == list(range(dims[0], dims[-1] + 1, step)) and dims[0] % step == 0:
        return f"a multiple of {step} from {dims[0]} to {dims[-1]}"
    return or_list(dims)


def takes_wide_head_dims(op: str, use_tensor_cores: bool) -> bool:
    """Whether (op, cores) is a family of WIDE_HEAD_DIM_FAMILIES."""
    return (op, bool(use_tensor_cores)) in WIDE_HEAD_DIM_FAMILIES


def head_dims_for(op: str, use_tensor_cores: bool | None = None) -> tuple[int, ...]:
    """The head dims generated for `op` on CUDA cores (False), tensor cores
    (True) or either (None): HEAD_DIMS, and WIDE_HEAD_DIMS for its families."""
    cores = (False, True) if use_tensor_cores is None else (use_tensor_cores,)
    return ALL_HEAD_DIMS if any(takes_wide_head_dims(op, tc) for tc in cores) else HEAD_DIMS


def wide_head_dims_text() -> str:
    """Where WIDE_HEAD_DIMS are generated, in words: '512 for single_decode and
    batch_decode_paged (CUDA or tensor cores) and batch_prefill_paged (tensor cores, fa2)'."""
    both = [op for op, tc in WIDE_HEAD_DIM_FAMILIES if not tc and takes_wide_head_dims(op, True)]
    tensor = [op for op, tc in WIDE_HEAD_DIM_FAMILIES if tc and op not in both]
    cuda = [op for op, tc in WIDE_HEAD_DIM_FAMILIES if not tc and op not in both]
    parts = ([f"{' and '.join(both)} (CUDA or tensor cores)"] if both else []) + \
        ([f"{' and '.join(tensor)} (tensor cores, fa2)"] if tensor else []) + \
        ([f"{' and '.join(cuda)} (CUDA cores)"] if cuda else [])
    return f"{or_list(WIDE_HEAD_DIMS)} for {' and '.join(parts)}"


def all_head_dims_text() -> str:
    """Every generated head dim in words: HEAD_DIMS', then WIDE_HEAD_DIMS' with their ops."""
    return f"{head_dims_text()}; {wide_head_dims_text()}"


@dataclass(frozen=True)
class KernelSpec:
    op: str
    dtype_q: str
    dtype_kv: str
    dtype_o: str
    head_dim_qk: int
    head_dim_vo: int
    backend: str = "fa2"
    use_tensor_cores: bool = False
    causal: bool = False
    sliding_window: bool = False
    soft_cap: bool = False
    return_lse: bool = False
    # A per-request bit mask of which keys each query sees (speculative
    # decoding's token trees): params.custom_mask, work.cuh CustomMask.
    custom_mask: bool = False

    @classmethod
    def make(cls, op: str, dtype, head_dim: int, *, head_dim_vo: int | None = None, dtype_kv=None,
             dtype_o=None, **flags) -> "KernelSpec":
        """Convenience constructor: one dtype and one head_dim unless told otherwise."""
        dq = canonical_dtype(dtype)
        return cls(op=op, dtype_q=dq, dtype_kv=canonical_dtype(dtype_kv or dq),
                   dtype_o=canonical_dtype(dtype_o or dq), head_dim_qk=int(head_dim),
                   head_dim_vo=int(head_dim_vo if head_dim_vo is not None else head_dim), **flags)

    @property
    def name(self) -> str:
        """Readable and unique per configuration, e.g. single_prefill_bf16_d128_fa2_cc_causal."""
        short = {k: v[0] for k, v in DTYPES.items()}
        parts = [self.op, short[self.dtype_q]]
        if self.dtype_kv != self.dtype_q:
            parts.append("kv" + short[self.dtype_kv])
        if self.dtype_o != self.dtype_q:
            parts.append("o" + short[self.dtype_o])
        if self.head_dim_qk == self.head_dim_vo:
            parts.append(f"d{self.head_dim_qk}")
        else:
            parts.append(f"qk{self.head_dim_qk}_vo{self.head_dim_vo}")
        if self.op not in UTILITY_OPS:  # a copy has no backend or cores to name
            parts.append(self.backend)
            parts.append("tc" if self.use_tensor_cores else "cc")
        for flag, label in (("causal", "causal"), ("custom_mask", "mask"), ("sliding_window", "swa"),
                            ("soft_cap", "softcap"), ("return_lse", "lse")):
            if getattr(self, flag):
                parts.append(label)
        return "_".join(parts)

    @property
    def invariant_decode(self) -> bool:
        """Batch-invariant mode's decode: a decode op on its prefill kernel (see FA3_OPS)."""
        return self.op in DECODE_OPS and self.causal

    def replace(self, **changes) -> "KernelSpec":
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> "KernelSpec":
        """Raises ValueError naming the supported set and the nearest working choice."""
        def fail(what: str, supported: str, nearest: KernelSpec) -> None:
            raise ValueError(f"unsupported configuration {self.name if what != 'op' else self.op}: {what}. "
                             f"Supported: {supported}. Nearest working choice: {nearest.name}")

        if self.op not in OPS:
            if self.op in PLANNED_OPS:
                raise ValueError(f"op {self.op!r} is not available yet; available ops: {', '.join(OPS)}. "
                                 f"Nearest working choice: {self.replace(op=PLANNED_OPS[self.op]).name}")
            close = difflib.get_close_matches(self.op, OPS, n=1, cutoff=0.0)
            raise ValueError(f"op: expected one of {', '.join(OPS)}, got {self.op!r}. "
                             f"Nearest working choice: {self.replace(op=close[0]).name}")
        for field in ("dtype_q", "dtype_kv", "dtype_o"):
            if getattr(self, field) not in DTYPES:
                raise ValueError(f"{field}: expected one of {sorted(DTYPES)}, got {getattr(self, field)!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS} (or 'auto' in the ops), got {self.backend!r}")
        if self.custom_mask:
            self._validate_mask(fail)
        if self.op in MLA_OPS:  # its dtypes too: an FP8 cache on both backends
            return self._validate_mla(fail)
        if self.dtype_kv in KV_ONLY_DTYPES or self.dtype_q in KV_ONLY_DTYPES or self.dtype_o in KV_ONLY_DTYPES:
            return self._validate_fp8(fail)
        if self.dtype_kv != self.dtype_q or self.dtype_o != self.dtype_q:
            fail(f"dtype_q={self.dtype_q}, dtype_kv={self.dtype_kv}, dtype_o={self.dtype_o}",
                 "q, kv and o of one dtype", self.replace(dtype_kv=self.dtype_q, dtype_o=self.dtype_q))
        for field in ("head_dim_qk", "head_dim_vo"):
            value = getattr(self, field)
            if value not in HEAD_DIMS:
                self._validate_wide_head_dim(fail, field, value)
        if self.head_dim_qk != self.head_dim_vo:
            self._validate_qk_vo(fail)
        if self.op in UTILITY_OPS:
            flags = [f for f in ("causal", "sliding_window", "soft_cap", "return_lse") if getattr(self, f)]
            if flags or self.use_tensor_cores:
                fail(f"{self.op} with {', '.join(flags + (['use_tensor_cores'] if self.use_tensor_cores else []))}",
                     f"{self.op} without variant flags or tensor cores",
                     self.replace(use_tensor_cores=False, causal=False, sliding_window=False, soft_cap=False,
                                  return_lse=False, backend="fa2"))
        if self.use_tensor_cores and self.dtype_q not in TENSOR_CORE_DTYPES:
            fail(f"use_tensor_cores=True with {self.dtype_q}",
                 f"tensor cores with {TENSOR_CORE_DTYPES}; float32 runs on CUDA cores",
                 self.replace(use_tensor_cores=False))
        if self.use_tensor_cores and self.op not in TENSOR_CORE_OPS:
            fail(f"tensor-core {self.op} is not generated yet",
                 f"tensor cores for {', '.join(TENSOR_CORE_OPS)}; {self.op} on CUDA cores",
                 self.replace(use_tensor_cores=False, backend="fa2"))
        if self.backend == "fa3" and not self.use_tensor_cores:
            fail("backend fa3 without tensor cores", "fa3 is a tensor-core backend; CUDA cores run under "
                 "backend='fa2'", self.replace(backend="fa2"))
        if self.backend == "fa3" and self.op not in FA3_OPS and not self.invariant_decode:
            fail(f"backend fa3 for {self.op}", f"fa3 for {', '.join(FA3_OPS)} (and batch-invariant decode, "
                 f"causal=True); {self.op} on fa2", self.replace(backend="fa2"))
        if self.backend == "fa3" and self.head_dim_qk not in FA3_HEAD_DIMS:
            fail(f"backend fa3 with head_dim {self.head_dim_qk}",
                 f"fa3 for head dims {', '.join(map(str, FA3_HEAD_DIMS))}; every head dim ({head_dims_text()}) on fa2",
                 self.replace(backend="fa2"))
        return self

    def _validate_wide_head_dim(self, fail, field: str, value: int) -> None:
        """A head dim past HEAD_DIMS: one of WIDE_HEAD_DIMS on a family of
        WIDE_HEAD_DIM_FAMILIES, outside batch-invariant decode on CUDA cores."""
        cores = "tensor" if self.use_tensor_cores else "CUDA"
        invariant_cc = self.invariant_decode and not self.use_tensor_cores
        family = takes_wide_head_dims(self.op, self.use_tensor_cores) and not invariant_cc
        if value in WIDE_HEAD_DIMS and family:
            return
        dims = ALL_HEAD_DIMS if family else HEAD_DIMS
        nearest = nearest_head_dim(value, dims)
        where = ""
        if value in WIDE_HEAD_DIMS:
            where = " in batch-invariant decode on CUDA cores" if invariant_cc else \
                f" for {self.op}" + ("" if self.op in UTILITY_OPS else f" on {cores} cores")
        choice = self.replace(head_dim_qk=nearest, head_dim_vo=nearest)
        if value in WIDE_HEAD_DIMS and not self.use_tensor_cores and takes_wide_head_dims(self.op, True) \
                and self.dtype_q in TENSOR_CORE_DTYPES:
            choice = self.replace(use_tensor_cores=True)  # the same head dim, on tensor cores
        fail(f"{field}={value} is not generated{where} (nearest: {or_list(nearest_head_dims(value, dims))})",
             f"head_dim {all_head_dims_text()}", choice)

    def _validate_mask(self, fail) -> None:
        """A custom mask: MASK_OPS, without causal (the mask says it), on fa2
        tensor cores (and CUDA cores once MASK_ON_CUDA_CORES)."""
        plain = self.replace(custom_mask=False)
        if self.op not in MASK_OPS:
            fail(f"custom_mask on {self.op}", f"custom masks on {', '.join(MASK_OPS)}", plain)
        if self.causal:
            fail("custom_mask with causal=True", "a custom mask with causal=False (the mask holds the causal part, "
                 "as FlashInfer's)", self.replace(causal=False))
        if self.use_tensor_cores and self.backend == "fa3":
            fail("custom_mask on fa3", "custom masks on fa2 tensor cores (the fa3 backend has none yet)",
                 self.replace(backend="fa2"))
        if not self.use_tensor_cores and not MASK_ON_CUDA_CORES:
            fail("custom_mask on CUDA cores", "custom masks on fa2 tensor cores (fp16, bf16)",
                 self.replace(use_tensor_cores=True, backend="fa2"))

    def _validate_fp8(self, fail) -> "KernelSpec":
        """An FP8 KV cache: q and o fp16 or bf16 (one dtype), on the families of FP8_KV_FAMILIES."""
        families = ", ".join(op if op in UTILITY_OPS else f"{op} ({'tensor' if tc else 'CUDA'} cores)"
                             for op, tc in FP8_KV_FAMILIES)
        supported = f"FP8 KV caches (float8_e4m3fn, float8_e5m2) with fp16 or bf16 q and o for {families}"
        dq = self.dtype_q if self.dtype_q in TENSOR_CORE_DTYPES else "bfloat16"
        kv = self.dtype_kv if self.dtype_kv in KV_ONLY_DTYPES else "float8_e4m3fn"
        nearest = self.replace(dtype_q=dq, dtype_kv=kv, dtype_o=dq)
        if self.dtype_q in KV_ONLY_DTYPES or self.dtype_o in KV_ONLY_DTYPES:
            fail(f"FP8 queries or outputs (dtype_q={self.dtype_q}, dtype_o={self.dtype_o}) are not supported",
                 supported, nearest)
        if self.dtype_q not in TENSOR_CORE_DTYPES or self.dtype_o != self.dtype_q:
            fail(f"an FP8 KV cache with dtype_q={self.dtype_q}, dtype_o={self.dtype_o}", supported, nearest)
        plain = self.replace(dtype_kv=self.dtype_q).validate()  # everything but the KV dtype
        if (self.op, self.use_tensor_cores) not in FP8_KV_FAMILIES or self.invariant_decode:
            what = "batch-invariant decode (causal=True)" if self.invariant_decode else \
                f"{'tensor-core' if self.use_tensor_cores else 'CUDA-core'} {self.op}"
            near_op = self.op if self.op in DECODE_OPS else \
                "single_decode" if self.op == "single_prefill" else "batch_decode_paged"
            nearest = plain.replace(op=near_op, dtype_kv=kv,
                                    use_tensor_cores=False, backend="fa2", causal=False)
            fail(f"an FP8 KV cache for {what} is not yet generated", supported, nearest)
        if self.backend == "fa3" and self.op not in FA3_FP8_OPS:
            fail(f"an FP8 KV cache for {self.op} on backend fa3 is not yet generated",
                 f"{supported} (on fa3: {', '.join(FA3_FP8_OPS)})", self.replace(backend="fa2"))
        if self.backend == "fa3" and self.op not in MLA_OPS and self.head_dim_qk not in FA3_FP8_HEAD_DIMS:
            fail(f"an FP8 KV cache at head_dim {self.head_dim_qk} on backend fa3 is not yet generated",
                 f"{supported} (on fa3: head dims {', '.join(map(str, FA3_FP8_HEAD_DIMS))})",
                 self.replace(backend="fa2"))
        if self.head_dim_qk != self.head_dim_vo:
            fail(f"an FP8 KV cache with head_dim_qk={self.head_dim_qk} != head_dim_vo={self.head_dim_vo} is not yet "
                 f"generated", f"{supported}, with equal head dims; {qk_vo_text()}", plain)
        return self

    def _validate_qk_vo(self, fail) -> None:
        """head_dim_qk != head_dim_vo (both generated head dims): a pair of
        QK_VO_HEAD_DIMS, for QK_VO_OPS, on CUDA cores, fa2 or fa3."""
        qk, vo = self.head_dim_qk, self.head_dim_vo
        supported = qk_vo_text()
        equal = self.replace(head_dim_vo=qk)
        if vo > qk:
            fail(f"head_dim_vo={vo} > head_dim_qk={qk} is not generated", supported, equal)
        if (qk, vo) not in QK_VO_HEAD_DIMS:
            fail(f"head_dim_qk={qk}, head_dim_vo={vo} is not generated", supported, equal)
        if self.op not in QK_VO_OPS:
            # Paged prefill's nearest is the ragged op, which takes the pair; the others keep their op.
            nearest = self.replace(op="batch_prefill_ragged", backend="fa2") if self.op == "batch_prefill_paged" \
                else equal
            fail(f"head_dim_qk={qk} != head_dim_vo={vo} for {self.op}", supported, nearest)

    def _validate_mla(self, fail) -> "KernelSpec":
        """MLA's one geometry on tensor cores; q and o fp16 or bf16 (one dtype),
        the cache q's dtype or FP8 (KV_ONLY_DTYPES) on either backend."""
        qk, vo = MLA_HEAD_DIM_CKV + MLA_HEAD_DIM_KPE, MLA_HEAD_DIM_CKV
        supported = (f"{self.op}: head_dim_qk={qk} (ckv {MLA_HEAD_DIM_CKV} + kpe {MLA_HEAD_DIM_KPE}), "
                     f"head_dim_vo={vo}, fp16 or bf16 q and o on tensor cores with a cache of their dtype or "
                     f"FP8 ({' or '.join(KV_ONLY_DTYPES)}), backend fa2 or fa3, causal and return_lse")
        nearest = self.replace(head_dim_qk=qk, head_dim_vo=vo, use_tensor_cores=True,
                               backend=self.backend if self.backend in BACKENDS else "fa2",
                               sliding_window=False, soft_cap=False,
                               dtype_q=self.dtype_q if self.dtype_q in TENSOR_CORE_DTYPES else "bfloat16")
        nearest = nearest.replace(dtype_kv=nearest.dtype_q if self.dtype_kv not in KV_ONLY_DTYPES else self.dtype_kv,
                                  dtype_o=nearest.dtype_q)
        if self.dtype_q in KV_ONLY_DTYPES or self.dtype_o in KV_ONLY_DTYPES:
            fail(f"FP8 queries or outputs (dtype_q={self.dtype_q}, dtype_o={self.dtype_o}) are not supported",
                 supported, nearest)
        if self.dtype_o != self.dtype_q or self.dtype_kv not in (self.dtype_q, *KV_ONLY_DTYPES):
            fail(f"dtype_q={self.dtype_q}, dtype_kv={self.dtype_kv}, dtype_o={self.dtype_o}", supported, nearest)
        if (self.head_dim_qk, self.head_dim_vo) != (qk, vo):
            fail(f"head_dim_qk={self.head_dim_qk}, head_dim_vo={self.head_dim_vo}", supported, nearest)
        if self.dtype_q not in TENSOR_CORE_DTYPES or not self.use_tensor_cores:
            fail(f"{self.dtype_q} {'on tensor cores' if self.use_tensor_cores else 'on CUDA cores'}", supported,
                 nearest)
        if self.sliding_window or self.soft_cap:
            fail(f"{self.op} with {'a sliding window' if self.sliding_window else 'soft-cap'}", supported, nearest)
        return self


def mla_spec(dtype, *, causal: bool = False, backend: str = "fa2", return_lse: bool = True,
             dtype_kv=None) -> KernelSpec:
    """The mla_paged configuration of a dtype (its head dims are fixed: ckv 512 + kpe 64);
    dtype_kv: an FP8 cache's dtype (None: q's)."""
    return KernelSpec.make("mla_paged", dtype, MLA_HEAD_DIM_CKV + MLA_HEAD_DIM_KPE, head_dim_vo=MLA_HEAD_DIM_CKV,
                           dtype_kv=dtype_kv, backend=backend, use_tensor_cores=True, causal=causal,
                           return_lse=return_lse)
