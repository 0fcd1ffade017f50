"""The selector flags `flashjit prewarm` and `flashjit numerics` share (--op,
--dtype, --kv-dtype, --head-dim, --head-dim-vo, --backend, --tensor-cores, --causal, --mask, --window,
--soft-cap, --lse, --preset, and prewarm's --arch): their help, and their values checked in
the flags' own words before torch is imported or a GPU probed.

Every accepted set comes from flashjit.spec, flashjit.arch and
selection.PRESETS, so the help and the checks follow what is generated.
A bad value is a SelectionError: "--head-dim: 100 is not generated; choose 96
or 112 (the nearest; ...)". The command prints it after its own name and exits 2.
"""

from __future__ import annotations

import difflib
import re
import textwrap

from .arch import ARCHES, DEFAULT_ARCHES, normalize_arch
from .errors import ToolchainError
from .selection import PRESETS, SelectionError, choices_text, dtype_names, head_dim_pairs, short_dtype
from .spec import BACKENDS, FA3_HEAD_DIMS, HEAD_DIMS, KV_ONLY_DTYPES, MASK_OPS, MLA_HEAD_DIM_CKV, MLA_HEAD_DIM_KPE, \
    MLA_OPS, OPS, PLANNED_OPS, QK_VO_HEAD_DIMS, QK_VO_OPS, WIDE_HEAD_DIMS, canonical_dtype, head_dims_for, \
    head_dims_text, nearest_head_dims, qk_vo_pairs, wide_head_dims_text

SWITCHES = ("on", "off", "both")
MASK_CHOICES = ("off", "custom", "both")
TENSOR_CORE_CHOICES = ("auto", *SWITCHES)
BACKEND_CHOICES = ("auto", *BACKENDS)
MLA_HEAD_DIM = MLA_HEAD_DIM_CKV + MLA_HEAD_DIM_KPE


def dtype_choices(kv_only: bool = False) -> str:
    """'fp16 (float16, half, f16), bf16 (bfloat16) or fp32 (float32, float, f32)';
    kv_only: the FP8 KV-cache dtypes, 'e4m3 (float8_e4m3fn, fp8_e4m3, fp8_e4m3fn) or ...'."""
    return choices_text(f"{first} ({', '.join(rest)})" for first, *rest in dtype_names(kv_only).values())


def arch_choices() -> str:
    return choices_text(ARCHES) + " (or 8.0, 8.9, 9.0a ...)"


def _switch_metavar(values) -> str:
    return "{" + ",".join(values) + "}"


def _preset_ops_text(preset: dict) -> str:
    """A preset's ops, each part's switches that differ from the defaults after its ops."""
    said = {("causal", "on"): "causal only", ("causal", "off"): "not causal",
            ("tensor_cores", "both"): "CUDA and tensor cores", ("tensor_cores", "on"): "tensor cores",
            ("tensor_cores", "off"): "CUDA cores"}
    texts = []
    for part in preset.get("parts", [dict(ops=preset["ops"])]):
        notes = [said[(switch, part[switch])] for switch in ("causal", "tensor_cores") if switch in part]
        texts.append(", ".join(part["ops"]) + (f" ({', '.join(notes)})" if notes else ""))
    return ", ".join(texts)


def presets_text(width: int = 79) -> str:
    """What each preset builds, from selection.PRESETS (prewarm's help)."""
    lines = []
    for name, preset in sorted(PRESETS.items()):
        ops = preset["ops"]
        mla = [op for op in ops if op in MLA_OPS]
        text = (f"{name}: ops {_preset_ops_text(preset)}; dtypes {', '.join(short_dtype(d) for d in preset['dtypes'])}; "
                f"head dims {', '.join(map(str, preset['head_dims']))}"
                + (f"; {', '.join(mla)} only where a target is sm_90a" if mla else ""))
        lines.append(textwrap.fill(text, width, initial_indent="  ", subsequent_indent="      "))
    lines.append(textwrap.fill("each op with causal and not and with tensor cores where the ops pick them, unless "
                               "its preset says otherwise, for the backends the ops run on the target arches", width,
                               initial_indent="  ", subsequent_indent="  "))
    return "\n".join(lines)


def add_selectors(parser) -> None:
    """The selector flags (specs_from_args reads them; check_selectors checks them)."""
    parser.add_argument("--op", nargs="+", metavar="OP",
                        help=f"the ops (default: the preset's): {', '.join(OPS)}")
    parser.add_argument("--dtype", nargs="+", metavar="DTYPE",
                        help=f"the dtypes of q and o, and of K/V unless --kv-dtype says otherwise (default: the "
                             f"preset's): {dtype_choices()}")
    parser.add_argument("--kv-dtype", nargs="+", metavar="KV_DTYPE",
                        help=f"FP8 KV-cache dtypes, each with every --dtype of fp16 and bf16 (default: K/V of q's "
                             f"dtype): {dtype_choices(kv_only=True)}; FP8 KV caches run CUDA-core decode and "
                             f"append_paged")
    parser.add_argument("--head-dim", nargs="+", metavar="D",
                        help=f"the head dims (default: the preset's): {head_dims_text(HEAD_DIMS)} (fa3: "
                             f"{', '.join(map(str, FA3_HEAD_DIMS))}; the others run fa2); {wide_head_dims_text()}; "
                             f"mla_paged has its own (ckv {MLA_HEAD_DIM_CKV} + kpe {MLA_HEAD_DIM_KPE})")
    parser.add_argument("--head-dim-vo", nargs="+", metavar="DV",
                        help=f"V's and the output's head dims beside --head-dim's (default: each --head-dim): "
                             f"{qk_vo_pairs_text()}; each pairs with the --head-dim values it is generated with")
    parser.add_argument("--backend", nargs="+", default=["auto"], metavar="BACKEND",
                        help=f"{choices_text(BACKEND_CHOICES)}; auto (default): what the ops pick on each target "
                             f"arch (fa3 on sm_90a for the prefill ops and head dims it generates, fa2 elsewhere)")
    parser.add_argument("--tensor-cores", metavar=_switch_metavar(TENSOR_CORE_CHOICES),
                        help="auto: what the ops pick when not told (tensor cores for fp16/bf16 prefill); both: each "
                             "configuration with and without (default: the preset's, else auto)")
    parser.add_argument("--causal", metavar=_switch_metavar(SWITCHES),
                        help="the causal-mask variant (default: the preset's, else both; decode ops have none)")
    parser.add_argument("--mask", default="off", metavar=_switch_metavar(MASK_CHOICES),
                        help=f"custom masks (FlashInfer's custom_mask; configurations named _mask): off (default), "
                             f"custom, or both; on {', '.join(MASK_OPS)}, fp16/bf16 on fa2 tensor cores, without "
                             f"causal (a mask holds the causal part: --causal on is dropped for them unless given)")
    parser.add_argument("--window", default="off", metavar=_switch_metavar(SWITCHES),
                        help="the sliding-window variant (default: off)")
    parser.add_argument("--soft-cap", default="off", metavar=_switch_metavar(SWITCHES),
                        help="the logit soft-cap variant (default: off)")
    parser.add_argument("--lse", default="off", metavar=_switch_metavar(SWITCHES),
                        help="the variant that also returns the log-sum-exp (default: off; the batch wrappers always "
                             "build it)")
    parser.add_argument("--preset", default="default", metavar=_switch_metavar(sorted(PRESETS)),
                        help="the ops, dtypes and head dims that --op, --dtype and --head-dim leave unnamed "
                             "(default: default; each listed below)")


def add_arch(parser) -> None:
    parser.add_argument("--arch", nargs="+", metavar="ARCH",
                        help=f"the GPU arches to compile for: {arch_choices()} (default: "
                             f"$FLASHJIT_CUDA_ARCH_LIST, else this GPU's, else {', '.join(DEFAULT_ARCHES)})")


def _one_of(flag: str, value, allowed) -> None:
    if value not in allowed:
        raise SelectionError(f"{flag}: {value} is not a choice; choose {choices_text(allowed)}")


def _check_op(op: str) -> None:
    if op in OPS:
        return
    if op in PLANNED_OPS:
        raise SelectionError(f"--op: {op} is not generated yet; choose {PLANNED_OPS[op]} in its place, or "
                             f"{choices_text(OPS)}")
    close = difflib.get_close_matches(op, OPS, n=1, cutoff=0.6)
    raise SelectionError(f"--op: {op} is not an op flashjit generates; choose {choices_text(OPS)}"
                         + (f" (did you mean {close[0]}?)" if close else ""))


def check_head_dims(values, ops) -> list[int]:
    """The --head-dim values for `ops` as ints; one not generated names the
    nearest that are (prewarm, numerics, and bench's prefill rows). A head dim
    of spec.WIDE_HEAD_DIMS passes where some of the ops take it (on some cores);
    specs_from_args leaves out the combinations that do not. Past HEAD_DIMS'
    end, where those are among the nearest, the message says where they are generated."""
    mla_only = all(op in MLA_OPS for op in ops)
    wide = [d for d in WIDE_HEAD_DIMS if d not in HEAD_DIMS and any(d in head_dims_for(op) for op in ops)]
    dims = sorted({*HEAD_DIMS, *wide})
    allowed = dims + ([MLA_HEAD_DIM] if mla_only else [])
    generated = head_dims_text(HEAD_DIMS)
    head_dims = []
    for text in values:
        value = int(text) if re.fullmatch(r"\s*\d+\s*", str(text)) else None
        if value is None:
            raise SelectionError(f"--head-dim: {text} is not a number; choose {generated}")
        if value == MLA_HEAD_DIM and not mla_only:
            raise SelectionError(f"--head-dim: {value} is mla_paged's (ckv {MLA_HEAD_DIM_CKV} + kpe "
                                 f"{MLA_HEAD_DIM_KPE}), which it takes alone; the other ops take {generated}")
        if value not in allowed:
            ops_text = f" for {choices_text(ops).replace(' or ', ' and ')}" if value in WIDE_HEAD_DIMS else ""
            past = value > max(HEAD_DIMS) and any(d not in HEAD_DIMS for d in WIDE_HEAD_DIMS)
            raise SelectionError(f"--head-dim: {value} is not generated{ops_text}; choose "
                                 f"{choices_text(nearest_head_dims(value, dims))} (the nearest; generated: "
                                 f"{generated}{f'; {wide_head_dims_text()}' if past else ''})")
        head_dims.append(value)
    return head_dims


def qk_vo_pairs_text() -> str:
    """'192/128 (head_dim_qk/head_dim_vo) for single_prefill and batch_prefill_ragged on CUDA cores and fa2'."""
    return f"{qk_vo_pairs()} (--head-dim/--head-dim-vo) for {' and '.join(QK_VO_OPS)} on CUDA cores and fa2"


def check_head_dims_vo(values, head_dims) -> list[int]:
    """The --head-dim-vo values as ints, each generated beside some --head-dim
    (head_dims: the --head-dim values, which it needs), and every --head-dim
    with some --head-dim-vo value."""
    if not head_dims:
        raise SelectionError("--head-dim-vo: give --head-dim too (the Q/K head dims it pairs with); generated pairs: "
                             f"{qk_vo_pairs_text()}")
    dims_vo = []
    for text in values:
        value = int(text) if re.fullmatch(r"\s*\d+\s*", str(text)) else None
        if value is None:
            raise SelectionError(f"--head-dim-vo: {text} is not a number; choose {qk_vo_pairs_text()}, or leave "
                                 f"--head-dim-vo out for V as wide as Q and K")
        if not any(vo == value for _, vo in head_dim_pairs(head_dims, [value])):
            partners = [vo for qk, vo in QK_VO_HEAD_DIMS if qk in head_dims]
            raise SelectionError(f"--head-dim-vo: {value} with --head-dim {' '.join(map(str, head_dims))} is not "
                                 f"generated; choose {choices_text(sorted(set(head_dims) | set(partners)))} (pairs: "
                                 f"{qk_vo_pairs_text()}; a --head-dim value itself is V as wide as Q and K)")
        dims_vo.append(value)
    for qk in head_dims:
        if not head_dim_pairs([qk], dims_vo):
            raise SelectionError(f"--head-dim {qk}: no --head-dim-vo value is generated beside it; add {qk} to "
                                 f"--head-dim-vo (V as wide as Q and K) or drop it (pairs: {qk_vo_pairs_text()})")
    return dims_vo


def _check_arches(values) -> list[str]:
    arches = []
    for text in values:
        try:
            arches.append(normalize_arch(text))
        except ToolchainError:
            digits = re.sub(r"\D", "", text)
            old = " (flashjit needs SM80 or newer)" if digits and 10 <= int(digits[:2]) < 80 else ""
            raise SelectionError(f"--arch: {text} is not supported{old}; choose {arch_choices()}") from None
    return arches


def _canonical_or_none(text) -> str | None:
    try:
        return canonical_dtype(text)
    except ValueError:
        return None


def check_selectors(args) -> None:
    """Checks every selector of `args` in the flags' words (a SelectionError)
    and writes back their canonical form: dtypes as float16 / bfloat16 /
    float32 (--kv-dtype: float8_e4m3fn / float8_e5m2), head dims as ints, arches as sm_XX. Imports no torch."""
    _one_of("--preset", args.preset, sorted(PRESETS))
    for op in args.op or ():
        _check_op(op)
    dtypes = []
    for text in args.dtype or ():
        dtype = _canonical_or_none(text)
        if dtype in KV_ONLY_DTYPES:
            raise SelectionError(f"--dtype: {text} is an FP8 format, which flashjit reads in KV caches only; give it "
                                 f"as --kv-dtype {text} beside --dtype fp16 or bf16")
        if dtype is None:
            raise SelectionError(f"--dtype: {text} is not supported; choose {dtype_choices()}")
        dtypes.append(dtype)
    args.dtype = dtypes or None
    kv_dtypes = []
    for text in getattr(args, "kv_dtype", None) or ():
        dtype = _canonical_or_none(text)
        if dtype not in KV_ONLY_DTYPES:
            fnuz = " (another platform's FP8 format)" if str(text).endswith("fnuz") else ""
            raise SelectionError(f"--kv-dtype: {text} is not an FP8 KV-cache dtype{fnuz}; choose "
                                 f"{dtype_choices(kv_only=True)} (leave --kv-dtype out for K/V of q's dtype)")
        kv_dtypes.append(dtype)
    if hasattr(args, "kv_dtype"):
        args.kv_dtype = kv_dtypes or None
    ops = args.op or PRESETS[args.preset]["ops"]
    args.head_dim = check_head_dims(args.head_dim, ops) if args.head_dim else None
    if getattr(args, "head_dim_vo", None):
        args.head_dim_vo = check_head_dims_vo(args.head_dim_vo, args.head_dim)
    for backend in args.backend:
        _one_of("--backend", backend, BACKEND_CHOICES)
    if args.tensor_cores is not None:
        _one_of("--tensor-cores", args.tensor_cores, TENSOR_CORE_CHOICES)
    for flag in ("causal", "window", "soft_cap", "lse"):
        if getattr(args, flag) is not None:
            _one_of("--" + flag.replace("_", "-"), getattr(args, flag), SWITCHES)
    if getattr(args, "mask", None) is not None:
        _one_of("--mask", args.mask, MASK_CHOICES)
    if getattr(args, "arch", None):
        args.arch = _check_arches(args.arch)
