"""Which configurations a selection names: prewarm's and `flashjit numerics`'
selectors (--preset, --op, --dtype, --kv-dtype, --head-dim, --head-dim-vo, --backend,
--tensor-cores, --mask and the variant switches) resolved for the target arches into validated KernelSpecs, and
the few lines prewarm prints about them. A selection that names nothing, or a
combination the spec rejects, is a SelectionError in the flags' words (the
flags themselves are defined and checked one by one in selectors.py)."""

from __future__ import annotations

import itertools

from .arch import choose_backend
from .spec import _DTYPE_ALIASES as DTYPE_ALIASES
from .spec import DECODE_OPS, DTYPES, FP8_KV_FAMILIES, HEAD_DIMS, KV_ONLY_DTYPES, MASK_ON_CUDA_CORES, MASK_OPS, \
    MLA_OPS, OPS, QK_VO_HEAD_DIMS, QK_VO_OPS, TENSOR_CORE_DTYPES, UTILITY_OPS, WIDE_HEAD_DIMS, KernelSpec, \
    canonical_dtype, mla_spec, or_list, takes_wide_head_dims, wide_head_dims_text

# Ops whose wrapper always loads the LSE variant (it writes LSE only when asked).
ALWAYS_LSE = {"batch_prefill_ragged", "batch_prefill_paged", "batch_decode_paged"}
# Ops with no causal variant (one query token sees every key).
NO_CAUSAL = set(DECODE_OPS)

# A preset names the ops, dtypes and head dims that --op, --dtype and --head-dim
# leave unnamed, as one or more parts, each with the variant switches it builds
# where --tensor-cores and --causal are not given (and a part may name its own
# KV dtypes and head dims, where --kv-dtype and --head-dim are not given). A
# named --op replaces the parts: one selection over the preset's dtypes and head
# dims with the switches' own defaults. MLA (DeepSeek-style models) is built
# where a target is sm_90a, the GPUs such models are served on; elsewhere --op
# mla_paged.
#   default: what a served model needs, in bf16, for the three common head dims:
#            causal ragged and paged prefill, paged decode on both core types,
#            the KV append and MLA; and an e4m3 cache at head dim 128: paged
#            decode, causal paged prefill and the append (the README's first
#            command; 30 builds).
#   minimal: every non-MLA op in bf16 at head dim 128.
#   full:    every op, dtype, head dim and causal choice (473 builds for sm_80,
#            sm_89 and sm_90a).
_PRESET_OPS = [op for op in OPS if op not in MLA_OPS]
# The FP8 KV cache engines serve by default (vLLM's and SGLang's "fp8" is e4m3)
# at the head dim most served models have; one head dim, so that the README's
# first command stays within its time (benchmarks/results/2026-12-08-cpu-build-times.md).
_FP8_SERVING = dict(kv_dtypes=["float8_e4m3fn"], head_dims=[128])
SWITCH_DEFAULTS = {"tensor_cores": "auto", "causal": "both"}
PRESETS = {
    "default": dict(ops=["batch_prefill_ragged", "batch_prefill_paged", "batch_decode_paged", "append_paged",
                         "mla_paged"],
                    dtypes=["bfloat16"], head_dims=[64, 128, 256],
                    parts=[dict(ops=["batch_prefill_ragged", "batch_prefill_paged"], causal="on"),
                           dict(ops=["batch_decode_paged"], tensor_cores="both"),
                           dict(ops=["append_paged", "mla_paged"]),
                           dict(ops=["batch_prefill_paged"], causal="on", **_FP8_SERVING),
                           dict(ops=["batch_decode_paged", "append_paged"], tensor_cores="both", **_FP8_SERVING)]),
    "minimal": dict(ops=_PRESET_OPS, dtypes=["bfloat16"], head_dims=[128]),
    "full": dict(ops=list(OPS), dtypes=["float16", "bfloat16", "float32"], head_dims=list(HEAD_DIMS)),
}


def preset_parts(args) -> list[dict]:
    """The (ops, tensor_cores, causal) of each part of the selection: the
    preset's parts, or one part of the named --op; a switch given on the
    command line replaces every part's."""
    preset = PRESETS[args.preset]
    parts = [dict(ops=args.op)] if args.op else preset.get("parts", [dict(ops=preset["ops"])])
    return [dict(ops=part["ops"], kv_dtypes=part.get("kv_dtypes"), head_dims=part.get("head_dims"),
                 **{switch: getattr(args, switch) or part.get(switch, default)
                    for switch, default in SWITCH_DEFAULTS.items()})
            for part in parts]


class SelectionError(ValueError):
    """Selector values, alone or together, that flashjit does not generate; the
    message names the flag, the value and the choices (selectors.py checks each
    flag's values; specs_from_args says why a combination names nothing)."""


choices_text = or_list  # 'a, b or c'


def dtype_names(kv_only: bool = False) -> dict[str, list[str]]:
    """Each q/o dtype's names (kv_only: each FP8 KV-cache dtype's), the short one first:
    {'float16': ['fp16', 'float16', 'half', 'f16'], ...}."""
    names = {}
    for canonical in (KV_ONLY_DTYPES if kv_only else [d for d in DTYPES if d not in KV_ONLY_DTYPES]):
        aliases = [alias for alias, target in DTYPE_ALIASES.items() if target == canonical]
        names[canonical] = aliases[:1] + [canonical] + aliases[1:]
    return names


def short_dtype(dtype: str) -> str:
    return dtype_names(dtype in KV_ONLY_DTYPES)[dtype][0]


def _switch(value: str) -> list:
    """on / off / both; auto (--tensor-cores only) is None: what the ops' auto choice takes;
    --mask's custom is on."""
    return {"on": [True], "custom": [True], "off": [False], "both": [False, True], "auto": [None]}[value]


def _backends(op: str, dtype: str, tc: bool, backend: str, arches, kv_dtype: str | None = None,
              head_dim: int | None = None, head_dim_vo: int | None = None, mask: bool = False) -> list[str]:
    """The backends the ops would run for `backend` on each of the target arches
    (an explicit fa3 where it cannot run: fa2, with the ops' warning; under
    FLASHJIT_STRICT_BACKEND a SelectionError naming --backend)."""
    if not tc or op in UTILITY_OPS:
        return ["fa2"]
    try:
        return list(dict.fromkeys(choose_backend(op, dtype, tc, backend, targets=(a,), kv_dtype=kv_dtype,
                                                 head_dim=head_dim, head_dim_vo=head_dim_vo,
                                                 custom_mask=mask)[0] for a in arches))
    except ValueError as exc:  # "backend='fa3' cannot run here: <why>; use ..."
        why = str(exc).split("cannot run here: ", 1)[-1].split("; use ", 1)[0]
        raise SelectionError(f"--backend {backend}: {why}; choose --backend fa2 or auto, or unset "
                             f"FLASHJIT_STRICT_BACKEND to build fa2 in its place") from None


def flag_words(spec: KernelSpec) -> str:
    """The prewarm flags that name one configuration, for messages."""
    def switch(flag: bool) -> str:
        return "on" if flag else "off"

    kv = f" --kv-dtype {short_dtype(spec.dtype_kv)}" if spec.dtype_kv in KV_ONLY_DTYPES else ""
    vo = f" --head-dim-vo {spec.head_dim_vo}" if spec.head_dim_vo != spec.head_dim_qk and spec.op not in MLA_OPS else ""
    return (f"--op {spec.op} --dtype {short_dtype(spec.dtype_q)}{kv} --head-dim {spec.head_dim_qk}{vo} --backend "
            f"{spec.backend} --tensor-cores {switch(spec.use_tensor_cores)} --causal {switch(spec.causal)}"
            f"{' --mask custom' if spec.custom_mask else ''} --window {switch(spec.sliding_window)} --soft-cap "
            f"{switch(spec.soft_cap)} --lse {switch(spec.return_lse)}")


def _validated(spec: KernelSpec) -> KernelSpec:
    try:
        return spec.validate()
    except ValueError as exc:
        reason = str(exc).split(": ", 1)[-1].split(". Nearest working choice", 1)[0]
        raise SelectionError(f"{flag_words(spec)}: not generated ({reason})") from None


def _left_out(op: str, dtype: str, tc: bool, causal: bool, window: bool, cap: bool, lse: bool,
              kv_dtype: str | None = None, dims: tuple[int, int] | None = None, mask: bool = False) -> str | None:
    """Why a combination of the selectors' values names no configuration (None: it names one).
    dims: (head_dim_qk, head_dim_vo) (None: equal); mask: --mask custom's."""
    if mask:
        if op not in MASK_OPS:
            return f"--mask custom: {op} takes no custom mask ({', '.join(MASK_OPS)} do)"
        if causal:
            return "--mask custom with --causal on: a custom mask holds the causal part; choose --causal off"
        if not tc and not MASK_ON_CUDA_CORES:
            return (f"--mask custom runs on the fa2 tensor cores with fp16 or bf16 (not {short_dtype(dtype)} on CUDA "
                    f"cores); choose --tensor-cores on or auto")
    if dims is not None and dims[0] in WIDE_HEAD_DIMS and op not in MLA_OPS and not takes_wide_head_dims(op, tc):
        wide = f"--head-dim {dims[0]}: {op}"
        if op in UTILITY_OPS or not takes_wide_head_dims(op, not tc):
            return f"{wide} is not generated at {dims[0]} ({wide_head_dims_text()})"
        if tc:
            return f"{wide} runs it on CUDA cores only; choose --tensor-cores off, auto or both"
        if dtype not in TENSOR_CORE_DTYPES:
            return f"{wide} runs it on tensor cores only, with fp16 or bf16 (not {short_dtype(dtype)})"
        return f"{wide} runs it on tensor cores only; choose --tensor-cores on, auto or both"
    if dims is not None and dims[0] != dims[1] and op not in MLA_OPS:
        if op not in QK_VO_OPS:
            return (f"--head-dim-vo {dims[1]}: {op} takes V as wide as Q and K (--head-dim {dims[0]}); "
                    f"{' and '.join(QK_VO_OPS)} take {dims[0]}/{dims[1]}")
        if kv_dtype is not None:
            return f"--head-dim-vo {dims[1]}: an FP8 KV cache (--kv-dtype) takes V as wide as Q and K"
    if kv_dtype is not None:
        if dtype not in TENSOR_CORE_DTYPES:
            return f"an FP8 KV cache (--kv-dtype) takes --dtype fp16 or bf16 (not {short_dtype(dtype)})"
        if (op, bool(tc)) not in FP8_KV_FAMILIES:
            families = ", ".join(f"{name} ({'tensor' if on else 'CUDA'} cores)" if name not in UTILITY_OPS else name
                                 for name, on in FP8_KV_FAMILIES)
            return (f"--kv-dtype {short_dtype(kv_dtype)}: {op} on {'tensor' if tc else 'CUDA'} cores is not yet "
                    f"generated for an FP8 KV cache; FP8 KV caches run {families}")
    if op in MLA_OPS:
        if dtype not in TENSOR_CORE_DTYPES:
            return f"{op} runs {' and '.join(map(short_dtype, TENSOR_CORE_DTYPES))} only (not {short_dtype(dtype)})"
        if window or cap:
            return f"{op} has no --window or --soft-cap variant (leave them off)"
        return None
    if op in UTILITY_OPS:
        if tc or causal or window or cap or lse:
            return f"{op} has no --tensor-cores, --causal, --window, --soft-cap or --lse variant (leave them off)"
        return None
    if tc and dtype == "float32":
        return "fp32 has no tensor-core kernel (--tensor-cores on); choose --tensor-cores off, auto or both"
    if causal and op in NO_CAUSAL:
        return f"{op} has no causal variant (--causal on); choose --causal off or both"
    return None


def head_dim_pairs(head_dims, head_dims_vo) -> list[tuple[int, int]]:
    """(head_dim_qk, head_dim_vo) of a selection: each --head-dim with each
    --head-dim-vo value generated beside it (its own, or a QK_VO_HEAD_DIMS
    pair's); without --head-dim-vo, each --head-dim with itself."""
    if not head_dims_vo:
        return [(qk, qk) for qk in head_dims]
    return [(qk, vo) for qk in head_dims for vo in head_dims_vo if vo == qk or (qk, vo) in QK_VO_HEAD_DIMS]


def specs_from_args(args, arches=None) -> list[KernelSpec]:
    """The selection for target `arches` (default: --arch, else this GPU's, else
    the default set): with tensor cores, each backend the ops pick on some
    target (auto on sm_80 + sm_90a: fa2, and fa3 for sm_90a). The commands
    check each flag's values first (selectors.check_selectors); a selection
    that names no configuration is a SelectionError saying why."""
    from . import jit

    arches = arches or jit.resolve_arches(args.arch)
    preset = PRESETS[args.preset]
    dtypes = [canonical_dtype(d) for d in (args.dtype or preset["dtypes"])]
    # None: K/V of q's dtype; else the FP8 KV-cache dtypes of --kv-dtype (or of a preset's part).
    given_kv_dtypes = [canonical_dtype(d) for d in getattr(args, "kv_dtype", None) or ()]
    given_head_dims = [int(h) for h in args.head_dim] if args.head_dim else None
    dims_vo = [int(h) for h in getattr(args, "head_dim_vo", None) or ()]
    specs, reasons = [], []
    combos = itertools.chain.from_iterable(itertools.product(
        part["ops"], dtypes, given_kv_dtypes or part["kv_dtypes"] or [None],
        head_dim_pairs(given_head_dims or part["head_dims"] or preset["head_dims"], dims_vo), args.backend,
        _switch(part["tensor_cores"]), _switch(part["causal"]), _switch(getattr(args, "mask", None) or "off"),
        _switch(args.window), _switch(args.soft_cap), _switch(args.lse))
        for part in preset_parts(args))
    for op, dtype, kv_dtype, (head_dim, head_dim_vo), backend, tc, causal, mask, window, cap, lse in combos:
        if tc is None:
            tc = op in MLA_OPS or (False if op in UTILITY_OPS else choose_backend(op, dtype, None, "fa2")[1])
        if mask and causal and getattr(args, "causal", None) is None:  # the preset's causal: a mask holds its own
            causal = False
        reason = _left_out(op, dtype, tc, causal, window, cap, lse, kv_dtype, (head_dim, head_dim_vo), mask)
        if reason is not None:
            reasons.append(reason)
            continue
        if op in MLA_OPS:
            # One geometry (ckv 512 + kpe 64) on tensor cores, fp16/bf16, with or
            # without causal: head_dim, cores, window, soft-cap and LSE do not apply.
            if args.op or "sm_90a" in arches:
                specs += [_validated(mla_spec(dtype, causal=causal, backend=chosen, dtype_kv=kv_dtype))
                          for chosen in _backends(op, dtype, True, backend, arches, kv_dtype)]
            continue
        for chosen in _backends(op, dtype, tc, backend, arches, kv_dtype, head_dim, head_dim_vo, mask):
            specs.append(_validated(KernelSpec.make(
                op, dtype, head_dim, head_dim_vo=head_dim_vo, dtype_kv=kv_dtype, backend=chosen, use_tensor_cores=tc,
                causal=causal, sliding_window=window, soft_cap=cap, return_lse=lse or op in ALWAYS_LSE,
                custom_mask=mask)))
    if not specs and reasons:
        raise SelectionError("the selection is empty: " + "; ".join(dict.fromkeys(reasons)))
    if getattr(args, "batch_invariant", False):
        from .ops import _invariant  # imports torch: only for this flag

        # Batch-invariant decode runs the prefill kernel: at WIDE_HEAD_DIMS, tensor cores' alone.
        kept = [s for s in specs if not (s.op in DECODE_OPS and s.head_dim_qk in WIDE_HEAD_DIMS
                                         and s.dtype_q not in TENSOR_CORE_DTYPES)]
        if not kept:
            raise SelectionError(f"the selection is empty: --batch-invariant decode at head dim "
                                 f"{or_list(WIDE_HEAD_DIMS)} runs on tensor cores (fp16, bf16) only")
        specs = _invariant.prewarm_specs(kept, arches)
    return list(dict.fromkeys(specs))


def _dims(spec: KernelSpec) -> str:
    """A configuration's head dims in the summary: 128, or 192/128 (head_dim_qk/head_dim_vo)."""
    return str(spec.head_dim_qk) if spec.head_dim_qk == spec.head_dim_vo else f"{spec.head_dim_qk}/{spec.head_dim_vo}"


def summary_lines(specs: list[KernelSpec], arches, arches_from: str) -> list[str]:
    """The selection in a few short lines: every axis's values, in selection order."""
    def axis(values) -> str:
        return ", ".join(str(v) for v in dict.fromkeys(values))

    cores = [s.use_tensor_cores for s in specs]
    return [f"flashjit prewarm: {len(specs)} configuration(s) for {', '.join(arches)} ({arches_from})",
            f"  ops        {axis(s.op for s in specs)}",
            f"  dtypes     {axis(s.dtype_q for s in specs)}",
            *([f"  kv dtypes  {axis(s.dtype_kv for s in specs)}"] if any(s.dtype_kv in KV_ONLY_DTYPES for s in specs)
              else []),
            f"  head_dims  {axis(_dims(s) for s in specs if s.op not in MLA_OPS) or '-'}"
            + (" (mla_paged: ckv 512 + kpe 64)" if any(s.op in MLA_OPS for s in specs) else ""),
            f"  cores      {cores.count(True)} on tensor cores, {cores.count(False)} on CUDA cores"]
