"""The toolchain and the hardware: where nvcc is and which version, which GPU
arches to compile for, and which backend `auto` picks on this device.

Raises ToolchainError (flashjit.errors) with the fix for: nvcc not found, nvcc
too old for an arch, an arch name we do not know, a GPU older than SM80; and
SettingError for a FLASHJIT_* variable it cannot use (FLASHJIT_NVCC,
FLASHJIT_CUDA_ARCH_LIST, FLASHJIT_STRICT_BACKEND, FLASHJIT_BATCH_INVARIANT). The
functions that read those variables (env_nvcc, env_arches, strict_backend,
batch_invariant) are the only parsers of them:
the CLI's up-front checks call them too.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import subprocess
import warnings
from pathlib import Path

from .errors import SettingError, ToolchainError

log = logging.getLogger("flashjit")

# Arch name -> (nvcc gencode flag, minimum nvcc (major, minor)).
ARCHES = {
    "sm_80": ("-gencode=arch=compute_80,code=sm_80", (11, 0)),
    "sm_86": ("-gencode=arch=compute_86,code=sm_86", (11, 1)),
    "sm_89": ("-gencode=arch=compute_89,code=sm_89", (11, 8)),
    # "a": wgmma and setmaxnreg exist only in the arch-specific sm_90a target.
    "sm_90a": ("-gencode=arch=compute_90a,code=sm_90a", (12, 0)),
    "sm_100a": ("-gencode=arch=compute_100a,code=sm_100a", (12, 8)),
    "sm_120": ("-gencode=arch=compute_120,code=sm_120", (12, 8)),
}
# What a prewarm with no GPU and no arch named compiles for: A100, L40/4090, H100/H200.
DEFAULT_ARCHES = ("sm_80", "sm_89", "sm_90a")
NVCC_HINT = ("install the CUDA toolkit (12.0 or newer) and put nvcc on PATH, "
             "or set CUDA_HOME to the toolkit directory")


def env_nvcc() -> str | None:
    """FLASHJIT_NVCC, or None where it is unset or empty. A value that is not an
    executable file is a SettingError, never skipped: building (and keying the
    cache) with another nvcc than the one named would be a silent surprise."""
    value = os.environ.get("FLASHJIT_NVCC")
    if not value:
        return None
    if os.path.isfile(value) and os.access(value, os.X_OK):
        return value
    what = "a directory" if os.path.isdir(value) else "not executable" if os.path.exists(value) else "no such file"
    raise SettingError(f"FLASHJIT_NVCC: expected the path of the nvcc executable, got {value!r} ({what}); point it "
                       f"at <CUDA toolkit>/bin/nvcc, or unset it to search CUDA_HOME, CUDA_PATH and PATH")


def find_nvcc() -> str | None:
    """FLASHJIT_NVCC (which must then be usable: env_nvcc), else
    $CUDA_HOME/bin/nvcc, $CUDA_PATH/bin/nvcc, PATH, /usr/local/cuda; None if none."""
    explicit = env_nvcc()
    if explicit is not None:
        return explicit
    for env in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(env)
        if value:
            path = Path(value) / "bin" / "nvcc"
            if path.is_file():
                return str(path)
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


def require_nvcc() -> str:
    nvcc = find_nvcc()
    if nvcc is None:
        raise ToolchainError(f"nvcc not found (looked at $FLASHJIT_NVCC, $CUDA_HOME, $CUDA_PATH, PATH, "
                             f"/usr/local/cuda): {NVCC_HINT}")
    return nvcc


def _version_memo_path() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flashjit-nvcc-versions.json"


@functools.lru_cache(maxsize=8)
def nvcc_version(nvcc: str) -> str:
    """'13.0.88' for the given nvcc. Running nvcc costs ~30 ms, so the answer is
    remembered per (path, size, mtime) on disk as well as in this process."""
    st = os.stat(nvcc)
    ident = f"{os.path.realpath(nvcc)}:{st.st_size}:{st.st_mtime_ns}"
    memo = _version_memo_path()
    try:
        known = json.loads(memo.read_text())
        if ident in known:
            return known[ident]
    except (OSError, ValueError):
        known = {}
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except OSError as exc:
        raise ToolchainError(f"cannot run {nvcc}: {exc}; {NVCC_HINT}") from exc
    match = re.search(r"release [\d.]+, V(\d+\.\d+\.\d+)", out) or re.search(r"release (\d+\.\d+)", out)
    if not match:
        raise ToolchainError(f"cannot read the version of {nvcc} from: {out.strip()[:200]!r}")
    version = match.group(1)
    try:
        known[ident] = version
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, memo)
    except OSError:
        pass  # the memo is an optimisation only
    return version


def normalize_arch(arch: str) -> str:
    """'9.0a', '90a', 'sm_90a', 'sm90' -> 'sm_90a' (9.0 always means sm_90a)."""
    text = arch.strip().lower().removeprefix("sm_").removeprefix("sm").removeprefix("compute_")
    text = text.replace(".", "")
    name = "sm_" + text
    if name == "sm_90":
        name = "sm_90a"
    if name == "sm_100":
        name = "sm_100a"
    if name not in ARCHES:
        raise ToolchainError(f"arch: expected one of {', '.join(ARCHES)} (or 8.0, 8.9, 9.0a ...), got {arch!r}")
    return name


def arch_of_capability(major: int, minor: int, device_name: str = "GPU") -> str:
    if major < 8:
        raise ToolchainError(f"{device_name} is sm_{major}{minor}; flashjit needs SM80 or newer "
                             f"(A100, L40, RTX 30xx/40xx, H100/H200)")
    try:
        return normalize_arch(f"{major}{minor}")
    except ToolchainError as exc:
        raise ToolchainError(f"{device_name} is sm_{major}{minor}, which flashjit cannot target yet; "
                             f"set FLASHJIT_CUDA_ARCH_LIST to one of {', '.join(ARCHES)} that it runs") from exc


def env_arches() -> tuple[str, ...] | None:
    """FLASHJIT_CUDA_ARCH_LIST as sorted arch names ('8.0 9.0a' -> sm_80, sm_90a),
    or None where it is unset or empty. An arch it does not know, or a value that
    names none, is a SettingError naming the variable, the value and the fix."""
    value = os.environ.get("FLASHJIT_CUDA_ARCH_LIST")
    if not value:
        return None
    names = [a for a in re.split(r"[\s,;]+", value) if a]
    fix = (f"set it to arches separated by spaces, commas or semicolons (e.g. '8.0 9.0a'), or unset it to compile "
           f"for this GPU (else {' '.join(DEFAULT_ARCHES)})")
    if not names:
        raise SettingError(f"FLASHJIT_CUDA_ARCH_LIST: expected at least one arch, got {value!r}; {fix}")
    arches = set()
    for name in names:
        try:
            arches.add(normalize_arch(name))
        except ToolchainError:
            raise SettingError(f"FLASHJIT_CUDA_ARCH_LIST: expected arches among {', '.join(ARCHES)} (or 8.0, "
                               f"8.9, 9.0a ...), got {value!r}, where {name!r} is none of them; {fix}") from None
    return tuple(sorted(arches))


def device_arch() -> str | None:
    """The current CUDA device's arch, or None without a GPU (initialises CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return None
    idx = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(idx)
    return arch_of_capability(major, minor, torch.cuda.get_device_name(idx))


def check_nvcc_supports(version: str, arches) -> None:
    have = tuple(int(x) for x in version.split(".")[:2])
    for arch in arches:
        need = ARCHES[arch][1]
        if have < need:
            raise ToolchainError(f"nvcc {version} cannot compile for {arch} (needs CUDA {need[0]}.{need[1]} "
                                 f"or newer): upgrade the CUDA toolkit, or set FLASHJIT_CUDA_ARCH_LIST "
                                 f"to arches it supports")


def gencode_flags(arches) -> list[str]:
    return [ARCHES[a][0] for a in arches]


def backend_targets() -> tuple[str, ...]:
    """The arches the chosen backend must run on: this GPU's where one is
    visible (it decides), else FLASHJIT_CUDA_ARCH_LIST, else the default set."""
    dev = device_arch()
    if dev is not None:
        return (dev,)
    return env_arches() or DEFAULT_ARCHES


# The words a FLASHJIT_* on/off setting takes (any case, nothing around them).
SWITCH_ON = ("1", "true", "yes")
SWITCH_OFF = ("", "0", "false", "no")


def env_switch(name: str, expected: str, fix: str) -> bool:
    """An on/off FLASHJIT_* setting: True for SWITCH_ON, False for SWITCH_OFF
    (unset included); anything else a SettingError "{name}: expected {expected},
    got ...; {fix}" rather than a guess in either direction."""
    raw = os.environ.get(name, "")
    if raw.lower() in SWITCH_OFF:
        return False
    if raw.lower() in SWITCH_ON:
        return True
    raise SettingError(f"{name}: expected {expected}, got {raw!r}; {fix}")


def strict_backend() -> bool:
    """FLASHJIT_STRICT_BACKEND=1: an explicit backend the target cannot run is an
    error, not a fallback. A value it does not know is a SettingError."""
    return env_switch("FLASHJIT_STRICT_BACKEND", "0 or 1 (or true/false, yes/no)",
                      "set it to 1 (an explicit backend the target cannot run is an error) or 0 (it falls back to "
                      "fa2), or unset it")


def batch_invariant() -> bool:
    """FLASHJIT_BATCH_INVARIANT=1: every op of the process in batch-invariant mode
    (flashjit/ops/_invariant.py). A value it does not know is a SettingError."""
    return env_switch("FLASHJIT_BATCH_INVARIANT", "0 or 1 (or true/false, yes/no)",
                      "set it to 1 (every op batch-invariant) or 0, or unset it")


_warned_fallbacks: set = set()


def choose_backend(op: str, dtype: str, use_tensor_cores: bool | None, backend: str,
                   targets: tuple[str, ...] | None = None, strict: bool | None = None,
                   kv_dtype: str | None = None, head_dim: int | None = None,
                   head_dim_vo: int | None = None, custom_mask: bool = False) -> tuple[str, bool, str]:
    """Resolves backend='auto' / use_tensor_cores=None for arches `targets`
    (None: backend_targets()): returns (backend, use_tensor_cores, reason).
    Tensor cores for fp16/bf16 prefill; CUDA cores for fp32 and for decode,
    whose single query row per head gains nothing from a 16-row MMA until heads
    are packed into it. Among tensor-core backends, fa3 (wgmma, TMA) where every
    target is sm_90a and it generates the op, else fa2 (mma.sync, SM80+).

    An explicit backend='fa3' that the targets or the op cannot take runs fa2
    with a one-time warning naming the reason; with `strict` (default:
    FLASHJIT_STRICT_BACKEND) it raises ValueError instead. kv_dtype: an FP8
    KV cache's dtype (None: q's), which fa3 reads for FA3_FP8_OPS and
    FA3_FP8_HEAD_DIMS only. head_dim: Q's and K's (None: not known yet), which
    fa3 generates for FA3_HEAD_DIMS only (MLA has its own geometry) and auto
    picks it for at FA3_AUTO_HEAD_DIMS; head_dim_vo: V's and O's
    (None: head_dim's), which fa3 generates equal to head_dim or as a pair of
    QK_VO_HEAD_DIMS.
    custom_mask: the call has one, which fa3 does not read (spec.MASK_OPS);
    CUDA cores are the ops' error (ops._masks.check_cores), not a choice here."""
    from .kernels import fa3
    from .spec import DECODE_OPS, FA3_AUTO_HEAD_DIMS, FA3_FP8_HEAD_DIMS, FA3_FP8_OPS, FA3_HEAD_DIMS, FA3_OPS, \
        KV_ONLY_DTYPES, MLA_OPS, QK_VO_HEAD_DIMS, TENSOR_CORE_DTYPES, TENSOR_CORE_OPS

    if backend not in ("auto", "fa2", "fa3"):
        raise ValueError(f"backend: expected 'auto', 'fa2' or 'fa3', got {backend!r}")
    if use_tensor_cores is None:
        if dtype not in TENSOR_CORE_DTYPES:
            use_tensor_cores, reason = False, f"{dtype} runs on CUDA cores only"
        elif op not in TENSOR_CORE_OPS or op in DECODE_OPS:
            use_tensor_cores, reason = False, f"{op} runs on CUDA cores (fp32 softmax and P.V) unless " \
                                              f"use_tensor_cores=True"
        else:
            use_tensor_cores, reason = True, f"{dtype} {op} runs on tensor cores"
    else:
        reason = f"use_tensor_cores={use_tensor_cores} was requested"
    if backend == "fa2" or not use_tensor_cores:
        if backend != "auto":
            reason += f"; backend={backend} was requested"
        return "fa2", use_tensor_cores, reason
    on_this_gpu = targets is None and device_arch() is not None
    targets = backend_targets() if targets is None else tuple(targets)
    why_not = None
    if not all(t in fa3.ARCHES for t in targets):
        why_not = (f"fa3 needs wgmma (sm_90a: H100/H200) and the target is {', '.join(targets)}"
                   + (f" ({device_name()})" if on_this_gpu else ""))
    elif op not in FA3_OPS:
        why_not = f"fa3 does not generate {op} (it does {', '.join(FA3_OPS)})"
    elif custom_mask:
        why_not = "fa3 has no custom masks"
    elif head_dim_vo not in (None, head_dim) and head_dim is not None and op not in MLA_OPS and \
            (head_dim, head_dim_vo) not in QK_VO_HEAD_DIMS:
        why_not = f"fa3 does not generate head_dim_qk={head_dim} with head_dim_vo={head_dim_vo}"
    elif head_dim is not None and op not in MLA_OPS and head_dim not in FA3_HEAD_DIMS:
        why_not = f"fa3 does not generate head_dim {head_dim} (it does {', '.join(map(str, FA3_HEAD_DIMS))})"
    elif kv_dtype in KV_ONLY_DTYPES and op not in FA3_FP8_OPS:
        why_not = f"fa3 reads an FP8 KV cache for {', '.join(FA3_FP8_OPS)} only"
    elif kv_dtype in KV_ONLY_DTYPES and head_dim is not None and op not in MLA_OPS and \
            head_dim not in FA3_FP8_HEAD_DIMS:
        why_not = f"fa3 reads an FP8 KV cache at head dims {', '.join(map(str, FA3_FP8_HEAD_DIMS))} only"
    if backend == "auto":
        if why_not is None and head_dim is not None and op not in MLA_OPS and head_dim not in FA3_AUTO_HEAD_DIMS:
            # fa3 runs there when asked for; auto waits for a same-run table with it ahead (spec.FA3_AUTO_HEAD_DIMS).
            why_not = f"fa3 at head_dim {head_dim} is not yet measured ahead of fa2 (backend='fa3' runs it)"
        if why_not is None:
            return "fa3", True, reason + "; fa3 (sm_90a: wgmma, TMA, warp specialization)"
        return "fa2", True, reason + f"; fa2 (mma.sync), as {why_not}"
    if why_not is None:
        return "fa3", True, reason + "; backend=fa3 was requested"
    if strict_backend() if strict is None else strict:
        raise ValueError(f"backend='fa3' cannot run here: {why_not}; use backend='fa2' or 'auto', or unset "
                         f"strict / FLASHJIT_STRICT_BACKEND to fall back to fa2")
    if (op, targets, why_not) not in _warned_fallbacks:
        _warned_fallbacks.add((op, targets, why_not))
        warnings.warn(f"flashjit: backend='fa3' requested for {op}, but {why_not}: running fa2 "
                      f"(strict=True or FLASHJIT_STRICT_BACKEND=1 makes this an error)", stacklevel=3)
    return "fa2", True, reason + f"; fa2, as backend=fa3 was requested but {why_not}"


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(torch.cuda.current_device())
