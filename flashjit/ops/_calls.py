"""Prepared calls: what a call repeats once its signature has been checked.

A signature is everything the checks and the params depend on but the
tensors' addresses and, for single requests, the token counts: shapes,
strides, dtypes, devices, options (and for a batch wrapper, its plan). The
first call of a signature runs every check and packs the params struct but its
leading pointers (and counts) once; the ops keep the result, a closure over
those bytes, in a dict keyed by the signature. A repeated call reads the
signature's attributes, looks the closure up and calls it: it allocates the
outputs the caller did not pass, checks the addresses' 16-byte alignment
(addresses change between calls; a misaligned one gets the first call's
error), packs torch's current stream and the addresses in front of the fixed
bytes (loader.LAUNCH_HEAD) and launches. Closures rather than objects: their
constants are cell reads, not attribute lookups, on a path measured in
microseconds.

Each op keeps the call it used last in a slot with a check of its tensor
arguments in C (ops._guards): a loop that repeats one signature pays for that
check, not for reading every attribute in Python and hashing the key; a
signature the check rejects takes the key path, which also refills the slot.

What is not cached, because nothing cheaper tells when it changes: torch's
current device and current stream, read on every call through torch's raw
getters (benchmarks/bench_jit.py measures the two).
"""

from __future__ import annotations

import struct

import torch

from ..loader import LAUNCH_HEAD, AttentionParams, KernelModule
from ..spec import KernelSpec
from . import _checks, _guards, _invariant
from ._plan import CHUNK_ALIGN, MIN_CHUNK_KEYS, ceil_div, single_request_band_items
from ._walk import single_request_walk, walks_positions

# FlashjitAttentionParams starts with thirteen pointers and six per-call counts
# (num_work, qo_len, kv_len, num_splits, kv_chunk, band_items); everything after them is fixed
# per call signature (configuration, heads, strides, scalars): packed once into `tail`.
PER_CALL = struct.Struct("=13Q6i")
# The first five (q, k, v, o, lse) are all that changes between a batch wrapper's
# calls with one plan and signature.
ADDRESSES = struct.Struct("=5Q")
# A single request that is not split: num_splits 1, kv_chunk 0, band_items 0.
_UNSPLIT_COUNTS = struct.pack("=3i", 1, 0, 0)


def block_packer(per_call: str, fixed: bytes, after: str = ""):
    """pack(stream, *per-call fields, fixed, *after fields) -> a prepared call's
    launch block (loader.LAUNCH_HEAD: the stream first, then the params), in one
    struct.pack: the bytes fixed per signature go in as an "s" field, so that a
    call makes one bytes object, not a packed head and its concatenation."""
    return struct.Struct(f"=Q{per_call}{len(fixed)}s{after}").pack


CACHE_LIMIT = 4096
_BANDS_LIMIT = 1024
_SPLIT_KEYS = 2 * MIN_CHUNK_KEYS  # fewer keys are never split

# torch's raw getters answer what current_device() and current_stream(i).cuda_stream
# do, several times cheaper (no lazy-init check, no Stream object).
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda device_index: torch.cuda.current_stream(device_index).cuda_stream)


_EMPTY_SLOT = (None, _guards.never, None)


class Signatures(dict):
    """Prepared calls by signature, bounded, the last one found kept aside in
    `last` (key, call): a loop repeats one signature, and one comparison with it
    costs half of what hashing the key and comparing in the dict does.
    `fast` (and, for a wrapper's run(out=...), `fast_out`): (options, check,
    call), the last call with its C check of the tensors (ops._guards), which
    the ops try before building any key. The ops spell these lookups out (and
    the calls below their launch) rather than call a shared helper: a Python
    call costs about 0.1 us on paths measured against a 10 us target."""

    __slots__ = ("last", "fast", "fast_out")

    def __init__(self):
        super().__init__()
        self.reset()

    def reset(self) -> None:
        """Forgets every prepared call (tests and benchmarks that replace the kernels)."""
        self.clear()
        self.last = (None, None)
        self.fast = self.fast_out = _EMPTY_SLOT


def remember(cache: Signatures, key, value):
    """Stores a prepared call (not None: one a test double did not make); a
    cache that outgrows its bound starts over."""
    if key is not None and value is not None:
        if len(cache) >= CACHE_LIMIT:
            cache.reset()
        cache[key] = value
        cache.last = (key, value)
    return value


def fill_slot(launches: Signatures, return_lse, out, launch) -> None:
    """Makes a wrapper's prepared run() (given no lse) the one its run() tries
    first: `fast` for runs without out, `fast_out` for runs into one.
    launch.slot: its (check, call) (see slot_of)."""
    slot = (return_lse, *launch.slot)
    if out is None:
        launches.fast = slot
    else:
        launches.fast_out = slot


def keep_run(launches: Signatures, key, launch, tensors: tuple, return_lse, out, fast: bool,
             pair: bool = False) -> None:
    """Keeps a wrapper's new prepared run() under its key (remember) with its
    check (slot_of), and, with `fast` (a run given no lse), in its fast slot;
    nothing where a test double made no prepared run."""
    if launch is None or key is None:
        return
    slot_of(launch, tensors, pair)
    remember(launches, key, launch)
    if fast:
        fill_slot(launches, return_lse, out, launch)


def slot_of(launch, tensors: tuple, pair: bool = False) -> None:
    """Gives a wrapper's new prepared run() the check of its tensor arguments
    (as run() passes them, out last where given) and the (check, call) its
    fast slot holds. pair: the paged cache came as a (K, V) pair in tensors[1:3];
    the slot's check and call then take it as it comes, one argument."""
    check = _guards.metadata_check(tensors)
    if not pair:
        launch.slot = (check, launch)
        return

    def pair_check(q, cache, *out):
        return type(cache) in (tuple, list) and len(cache) == 2 and check(q, cache[0], cache[1], *out)

    def pair_call(q, cache, _, out, lse):
        return launch(q, cache[0], cache[1], out, lse)

    launch.slot = (pair_check, pair_call)


def tensor_signature(t) -> tuple:
    """What a prepared call depends on of a tensor whose every dimension is fixed by the signature."""
    return t.shape, t.stride(), t.dtype, t.device


def dense(t: torch.Tensor) -> bool:
    """Whether t's strides are the contiguous ones for its trailing dims, whatever
    its leading (token) count: torch.empty_like then gives a contiguous tensor of
    t's shape for every t of the signature."""
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if stride != expected:
            return False
        expected *= size
    return t.dim() < 2 or t.stride(0) == expected


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


def misaligned(module: KernelModule, q, k, v, out) -> None:
    """A prepared call found an address off 16 bytes: the first call's checks name
    the tensor (a tensor without elements is read by nobody: no error then)."""
    check_placement(q, k, v, module.spec)
    if module.spec.use_tensor_cores:  # tensor-core kernels write O in 16-byte vectors too
        _checks.check_vector_aligned("out", out)


def run_on(module: KernelModule, params: bytes, device_index: int) -> None:
    """Launches on torch's current stream of the tensors' device."""
    launcher, block = module.launcher, LAUNCH_HEAD.pack(_raw_stream(device_index)) + params
    code = launcher(block) if device_index == _current_device() else launch_elsewhere(launcher, block, device_index)
    if code:
        raise module.launch_error(code)


def launch_elsewhere(launcher, block: bytes, device_index: int) -> int:
    """The launch when the current device is not the tensors' (kernels run on the
    current one); block: its stream is the tensors' device's current stream."""
    with torch.cuda.device(device_index):
        return launcher(block)


_SM_COUNTS: dict = {}


def resident_ctas(module: KernelModule, device: torch.device) -> int:
    """CTAs of the module's kernel that run at once on the device: one full wave."""
    if device.index not in _SM_COUNTS:
        _SM_COUNTS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    with torch.cuda.device(device):  # the occupancy query asks the current device
        return _SM_COUNTS[device.index] * module.ctas_per_sm(device.index)


def single_request_split(kv_len: int, ctas: int, split_ctas: int, invariant_chunk: int = 0,
                         fold: bool = False) -> tuple[int, int]:
    """(num_splits, kv_chunk) of a single-request launch of `ctas` CTAs: enough
    splits to reach split_ctas CTAs, each of at least MIN_CHUNK_KEYS keys, (1, 0)
    when the grid is large enough; with invariant_chunk (batch-invariant mode),
    chunks of that many keys, unless the kernel folds them itself (fold) and
    the grid is large enough."""
    if invariant_chunk:
        policy = _invariant.fold_policy
        if fold and (ctas >= split_ctas if policy == "auto" else policy == "always"):
            return 1, 0
        return _invariant.single_split(kv_len, invariant_chunk)
    if not 0 < ctas < split_ctas or kv_len < _SPLIT_KEYS:
        return 1, 0
    splits = min(ceil_div(split_ctas, ctas), kv_len // MIN_CHUNK_KEYS)
    chunk = ceil_div(ceil_div(kv_len, splits), CHUNK_ALIGN) * CHUNK_ALIGN
    return ceil_div(kv_len, chunk), chunk


def single_request_call(module: KernelModule, params: AttentionParams, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, kv_layout: str, group: int, q_tokens: bool, return_lse: bool,
                        invariant_chunk: int = 0):
    """The prepared call of a single_prefill / single_decode signature:
    call(q, k, v) -> out, or (out, lse) with return_lse, for tensors of this
    signature (the tensors' device is the one given here); call.check(q, k, v):
    whether the tensors are of this signature, token counts aside (ops._guards).
    q_tokens: q is [tokens, heads, dim] (else [heads, dim], decode). The call
    reads the token counts and checks that v has k's. The keys are split across
    CTAs (flash-decoding) when the grid would not fill one wave of the GPU (as
    ops._plan does for batches), or, with invariant_chunk (batch-invariant
    mode), into chunks of that many keys whatever the grid; the output is
    contiguous, as wide as v (head_dim_vo), as are the partial states."""
    launcher, launch_error = module.launcher, module.launch_error
    # invariant_chunk: negative where no CTA spans two chunks (the plain kernel
    # runs), positive for a launch whose CTAs fold their chunks (attention_params.cuh).
    params.invariant_chunk = -invariant_chunk
    tail = bytes(params)[PER_CALL.size:]
    params.invariant_chunk = invariant_chunk
    fold_tail = bytes(params)[PER_CALL.size:]
    device = q.device
    token_dim = 0 if kv_layout == "NHD" else 1
    device_index, split_ctas = device.index, resident_ctas(module, device)
    heads, dim, dim_vo, rows_per_cta = q.shape[-2], q.shape[-1], v.shape[-1], module.rows_per_cta
    num_kv_heads, causal = heads // group, module.spec.causal
    dense_out, align_qo = dense(q) and dim_vo == dim, -1 if module.spec.use_tensor_cores else 0
    out_shape = (heads, dim_vo)  # a token's output (single prefill: qo_len of them)
    pack = block_packer("13Q6i", tail)
    # An unsplit call's head: its five addresses, eight null pointers (pad bytes
    # pack as zeros), num_work, qo_len, kv_len; the rest of its counts are fixed.
    unsplit_tail = _UNSPLIT_COUNTS + tail
    pack_unsplit = block_packer("5Q64x3i", unsplit_tail)
    # Token counts by numel(): the signature fixes every other dimension, and a
    # numel() costs less than indexing shape (which builds a torch.Size).
    q_row, kv_row, v_row = heads * dim, num_kv_heads * dim, num_kv_heads * dim_vo
    empty, empty_like, f32 = torch.empty, torch.empty_like, torch.float32
    band_memo: dict = {}
    one_token_work = -(-group // rows_per_cta)  # decode's num_work
    # Fewer keys in one row tile: never split, no bands.
    split_keys = invariant_chunk + 1 if invariant_chunk else _SPLIT_KEYS
    fold = bool(invariant_chunk) and _invariant.folds(module.spec)
    walks = not invariant_chunk and walks_positions(module.spec)
    walk_tails: dict = {}  # walk address -> the params tail that carries it

    def split_and_bands(num_work: int, qo_len: int, kv_len: int, device) -> tuple:
        """(partial buffer or None, partial_o, partial_lse, num_splits, kv_chunk, band_items, params tail)."""
        ctas = num_work * num_kv_heads
        partial, partial_o, partial_lse, splits, chunk, bands, tail_of = None, 0, 0, 1, 0, 0, tail
        splits, chunk = single_request_split(kv_len, ctas, split_ctas, invariant_chunk, fold)
        if fold and splits == 1 and kv_len > invariant_chunk:  # the CTAs fold their chunks: their scratch
            partial = empty(_invariant.scratch_floats(min(ctas, split_ctas), rows_per_cta, dim_vo), dtype=f32,
                            device=device)
            partial_o, tail_of = partial.data_ptr(), fold_tail
        elif splits > 1:
            # Freed when the call returns: the caching allocator hands the block out
            # again only to work queued after this kernel on the same stream.
            rows = qo_len * heads
            partial = empty(rows * splits * (dim_vo + 1), dtype=f32, device=device)
            partial_o = partial.data_ptr()
            partial_lse = partial_o + 4 * rows * splits * dim_vo
        if num_work > 1:  # one row tile (every decode) launches in the same order whatever the bands
            bands = band_memo.get((qo_len, kv_len))
            if bands is None:
                if len(band_memo) >= _BANDS_LIMIT:
                    band_memo.clear()
                bands = band_memo[(qo_len, kv_len)] = single_request_band_items(
                    qo_len, kv_len, group=group, rows_per_cta=rows_per_cta, num_kv_heads=num_kv_heads,
                    resident_ctas=split_ctas, causal=causal)
            if walks and splits == 1:  # a persistent grid of one CTA per SM (the wave: fa3_launch.cuh)
                walk = single_request_walk(qo_len, kv_len, group=group, rows_per_cta=rows_per_cta,
                                           key_tile=module.split_align, num_kv_heads=num_kv_heads, band_items=bands,
                                           ctas=min(ctas, split_ctas), causal=causal, device=device)
                if walk:
                    tail_of = walk_tails.get(walk)
                    if tail_of is None:
                        params.cta_walk = walk
                        tail_of = walk_tails[walk] = bytes(params)[PER_CALL.size:]
                        params.cta_walk = None
        return partial, partial_o, partial_lse, splits, chunk, bands, tail_of

    def call(q, k, v):
        kv_len = k.numel() // kv_row
        if v.numel() != kv_len * v_row:
            raise ValueError(f"v: expected {k.shape[token_dim]} tokens (as k) in layout {kv_layout}, got shape "
                             f"{tuple(v.shape)}")
        qo_len = q.numel() // q_row if q_tokens else 1
        out = empty_like(q) if dense_out else empty((qo_len, *out_shape) if q_tokens else out_shape, dtype=q.dtype,
                                                    device=device)
        lse = None
        if return_lse:
            lse = empty(qo_len, heads, dtype=f32, device=device) if q_tokens else empty(heads, dtype=f32,
                                                                                        device=device)
        qp, kp, vp, op = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
        if (kp | vp | (qp | op) & align_qo) & 15:
            misaligned(module, q, k, v, out)
        lp = 0 if lse is None else lse.data_ptr()
        num_work = -(-qo_len * group // rows_per_cta) if q_tokens else one_token_work
        if num_work > 1 or kv_len >= split_keys:
            partial, *counts = split_and_bands(num_work, qo_len, kv_len, device)
            partial_o, partial_lse, splits, chunk, bands, tail_of = counts
            block = pack(_raw_stream(device_index), qp, kp, vp, op, lp, 0, 0, 0, 0, 0, 0, partial_o, partial_lse,
                         num_work, qo_len, kv_len, splits, chunk, bands, tail_of)
        else:
            block = pack_unsplit(_raw_stream(device_index), qp, kp, vp, op, lp, num_work, qo_len, kv_len,
                                 unsplit_tail)
        code = launcher(block) if device_index == _current_device() else launch_elsewhere(launcher, block,
                                                                                          device_index)
        if code:
            raise launch_error(code)
        return (out, lse) if return_lse else out

    call.module = module
    call.check = _guards.metadata_check((q, k, v), (0 if q_tokens else None, token_dim, token_dim))
    return call


def batch_call(module: KernelModule, params: bytes, device_index: int, v_offset: int, q: torch.Tensor,
               heads: int, dim: int, return_lse: bool):
    """The prepared run() of a batch wrapper for one plan and one argument signature:
    call(q, k, v, out, lse) -> out, or (out, lse) with return_lse; out / lse None
    are allocated (out [rows, heads, dim], dim: head_dim_vo). params: the whole
    struct, its first five pointers unread; v_offset: bytes from v's address to
    V's first element (one 5-D paged cache is both k and v)."""
    launcher, launch_error, suffix = module.launcher, module.launch_error, params[ADDRESSES.size:]
    dense_out, align_qo, device = dense(q) and q.shape[-1] == dim, -1 if module.spec.use_tensor_cores else 0, q.device
    pack, empty, empty_like, f32 = block_packer("5Q", suffix), torch.empty, torch.empty_like, torch.float32

    def call(q, k, v, out, lse):
        if out is None:
            out = empty_like(q) if dense_out else empty(q.shape[0], heads, dim, dtype=q.dtype, device=device)
        if not return_lse:
            lse = None
        elif lse is None:
            lse = empty(q.shape[0], heads, dtype=f32, device=device)
        qp, kp, op = q.data_ptr(), k.data_ptr(), out.data_ptr()
        vp = (kp if v is k else v.data_ptr()) + v_offset
        if (kp | vp | (qp | op) & align_qo) & 15:
            misaligned(module, q, k, v, out)
        block = pack(_raw_stream(device_index), qp, kp, vp, op, 0 if lse is None else lse.data_ptr(), suffix)
        code = launcher(block) if device_index == _current_device() else launch_elsewhere(launcher, block,
                                                                                          device_index)
        if code:
            raise launch_error(code)
        return (out, lse) if return_lse else out

    call.module = module
    return call


_Q_PE_BYTES = 8  # q_pe, the params struct's last field


def mla_call(module: KernelModule, params: bytes, device_index: int, q_nope: torch.Tensor, heads: int,
             return_lse: bool, check):
    """The prepared run() of an MLA wrapper for one plan and argument signature:
    call(q_nope, q_pe, ckv, kpe, out, lse) -> out, or (out, lse) with return_lse;
    out / lse None are allocated (out like q_nope). params: the whole struct, its
    first five pointers and its last (q_pe: the struct's last field) unread;
    check(q_nope, q_pe, ckv, kpe, out): the first call's placement checks, which
    name a tensor whose address is off 16 bytes."""
    launcher, launch_error, middle = module.launcher, module.launch_error, params[ADDRESSES.size:-_Q_PE_BYTES]
    dense_out, dim, device = dense(q_nope), q_nope.shape[-1], q_nope.device
    pack, empty, empty_like, f32 = block_packer("5Q", middle, "Q"), torch.empty, torch.empty_like, torch.float32

    def call(q_nope, q_pe, ckv, kpe, out, lse):
        if out is None:
            out = empty_like(q_nope) if dense_out else \
                empty(q_nope.shape[0], heads, dim, dtype=q_nope.dtype, device=device)
        if not return_lse:
            lse = None
        elif lse is None:
            lse = empty(q_nope.shape[0], heads, dtype=f32, device=device)
        qp, pp, kp, vp, op = q_nope.data_ptr(), q_pe.data_ptr(), ckv.data_ptr(), kpe.data_ptr(), out.data_ptr()
        if (qp | pp | kp | vp | op) & 15:
            check(q_nope, q_pe, ckv, kpe, out)
        block = pack(_raw_stream(device_index), qp, kp, vp, op, 0 if lse is None else lse.data_ptr(), middle, pp)
        code = launcher(block) if device_index == _current_device() else launch_elsewhere(launcher, block,
                                                                                          device_index)
        if code:
            raise launch_error(code)
        return (out, lse) if return_lse else out

    call.module = module
    return call
