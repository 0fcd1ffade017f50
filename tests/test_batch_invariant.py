"""Batch-invariant mode without a GPU: FLASHJIT_BATCH_INVARIANT and the
batch_invariant arguments, the kernel every op then selects (decode on its
prefill kernel, one backend, tensor cores by dtype), and the split-KV plan,
which must not depend on the rest of the batch, the GPU or the workspace.
The bit-for-bit comparisons are tests/test_gpu_batch_invariant.py."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

import flashjit
from flashjit import arch, cli, jit
from flashjit.errors import SettingError
from flashjit.ops import _batch, _calls, _invariant, _launch
from flashjit.ops._invariant import CHUNK_KEYS as C
from helpers_cache import needs_nvcc, no_compile, set_cache_env  # noqa: F401 (no_compile: a fixture)
from test_backend_choice import sass
from test_bad_input_wrappers import _i32, _workspace


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv(_invariant.ENV_VAR, raising=False)
    monkeypatch.delenv("FLASHJIT_STRICT_BACKEND", raising=False)
    monkeypatch.setattr(arch, "device_arch", lambda: None)  # the arch list decides, as on a GPU-less host


@pytest.mark.parametrize("value,on", [("1", True), ("true", True), ("YES", True), ("0", False), ("", False),
                                      ("False", False), ("no", False)])
def test_switch_values(monkeypatch, value, on):
    monkeypatch.setenv(_invariant.ENV_VAR, value)
    assert _invariant.env_setting() is on
    assert _invariant.resolve(None) is on
    assert _invariant.resolve(not on) is (not on)  # an argument wins over the process setting


@pytest.mark.parametrize("value", ["2", "on ", "invariant", "1.0"])
def test_switch_rejects_other_values(monkeypatch, capsys, value):
    """A SettingError naming the variable, what it takes and what came, from
    the ops and from `flashjit info` alike (one line on stderr, exit 2)."""
    monkeypatch.setenv(_invariant.ENV_VAR, value)
    with pytest.raises(SettingError) as info:
        _invariant.env_setting()
    message = str(info.value)
    assert message.startswith(f"{_invariant.ENV_VAR}: expected 0 or 1") and repr(value) in message
    assert isinstance(info.value, ValueError) and "\n" not in message
    with pytest.raises(SettingError):
        flashjit.single_decode_with_kv_cache(*[torch.zeros(2, 64, dtype=torch.float16)] * 3)
    assert cli.main(["info"]) == 2
    assert f"flashjit info: {message}\n" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["yes", 1, 0.0])
def test_argument_takes_a_bool(value):
    with pytest.raises(ValueError, match=r"^batch_invariant: expected True, False or None .*got"):
        _invariant.resolve(value)


OPS = ["single_prefill", "single_decode", "batch_prefill_ragged", "batch_prefill_paged", "batch_decode_paged"]
PREFILL_OF = {"single_decode": "single_prefill", "batch_decode_paged": "batch_prefill_paged"}


def _invariant_spec(op, dtype, head_dim=128, use_tensor_cores=None):
    return _launch.select_spec(op, dtype, head_dim, backend="auto", use_tensor_cores=use_tensor_cores, causal=True,
                               window=False, soft_cap=False, return_lse=True, batch_invariant=True)


@pytest.mark.parametrize("arches,backend", [("9.0a", "fa3"), ("8.0", "fa2"), ("8.0 9.0a", "fa2")])
@pytest.mark.parametrize("use_tensor_cores", [None, False, True])
@pytest.mark.parametrize("op", OPS)
def test_one_backend_and_cores_per_dtype(monkeypatch, op, use_tensor_cores, arches, backend):
    """fp16/bf16 on tensor cores whatever use_tensor_cores says, fp32 on CUDA
    cores, and `auto` picks the backend prefill gets for decode too (fa3 on sm_90a)."""
    monkeypatch.setenv("FLASHJIT_CUDA_ARCH_LIST", arches)
    for dtype in (torch.float16, torch.bfloat16):
        spec = _invariant_spec(op, dtype, use_tensor_cores=use_tensor_cores)
        assert (spec.op, spec.use_tensor_cores, spec.backend, spec.causal) == (op, True, backend, True)
        assert spec.invariant_decode == (op in PREFILL_OF)
    fp32 = _invariant_spec(op, torch.float32, 64)
    assert (fp32.op, fp32.use_tensor_cores, fp32.causal) == (op, False, True)
    normal = _launch.select_spec(op, torch.bfloat16, 128, backend="auto", use_tensor_cores=use_tensor_cores,
                                 causal=False, window=False, soft_cap=False, return_lse=True)
    assert not normal.causal and (normal.backend == "fa2" or op not in PREFILL_OF)  # the mode off changes nothing


@pytest.mark.parametrize("arches", [None, ("sm_80",), ("sm_89",), ("sm_90a",)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_op_steps_through_the_keys_alike(monkeypatch, dtype, head_dim, arches):
    """The kernel each op selects takes the same softmax steps (keys per
    rescale, from key 0) with rows split over warps: decode runs a prefill
    tiling (fa3: one consumer warpgroup), never a split-keys one."""
    from flashjit import kernels

    monkeypatch.setenv("FLASHJIT_CUDA_ARCH_LIST", "9.0a" if arches == ("sm_90a",) else "8.0")
    steps = {}
    for op in OPS:
        spec = _invariant_spec(op, getattr(torch, dtype), head_dim)
        _, tiling = kernels.tiling_for(spec, arches)
        assert not getattr(tiling, "split_keys", False)
        assert tiling.rescales(spec)[1] == 0  # no merge of warp or lane states
        steps[op] = tiling.rescales(spec)[0]
        if spec.backend == "fa3" and op in PREFILL_OF:
            assert tiling.consumers == 1 and tiling.keys_per_tile == kernels.fa3.FA3_TILINGS[head_dim].keys_per_tile
    if dtype == "bfloat16" and head_dim == 256 and arches == ("sm_90a",):
        # fa2 alone: its ragged d256 tiling on sm_90a-only builds steps 64 keys, paged 32 (docs/numerics.md)
        assert _invariant_spec("batch_prefill_ragged", torch.bfloat16, 256).backend == "fa3"
    assert len(set(steps.values())) == 1, steps


@pytest.fixture
def planned(no_compile, monkeypatch):
    """plan() on the host with a stand-in kernel module; returns the list of
    (spec, work plan) of every plan() (nothing is compiled or launched)."""
    monkeypatch.setattr(jit, "get_module", lambda spec: SimpleNamespace(spec=spec, rows_per_cta=128, split_align=128))
    monkeypatch.setattr(_batch, "resident_ctas", lambda module, device: 132)
    monkeypatch.setenv("FLASHJIT_CUDA_ARCH_LIST", "9.0a")
    plans = []
    real = _batch.BatchAttention._plan_batch

    def record(self, spec, *args, **kwargs):
        real(self, spec, *args, **kwargs)
        plans.append((spec, self._plan.work))
    monkeypatch.setattr(_batch.BatchAttention, "_plan_batch", record)
    return plans


def _plan(kind, kv_len, **plan_kw):
    """One request of kv_len keys (one query for decode, all of them for prefill), 8 qo / 2 kv heads, bf16."""
    pages = -(-kv_len // 16)
    table = (_i32(0, pages), torch.arange(pages, dtype=torch.int32), _i32((kv_len - 1) % 16 + 1))
    if kind == "ragged":
        w = flashjit.BatchPrefillWithRaggedKVCacheWrapper(_workspace())
        w._device = torch.device("cpu")
        w.plan([0, kv_len], [0, kv_len], 8, 2, 128, causal=True, q_data_type=torch.bfloat16, **plan_kw)
    elif kind == "paged":
        w = flashjit.BatchPrefillWithPagedKVCacheWrapper(_workspace())
        w._device = torch.device("cpu")
        w.plan(_i32(0, kv_len), *table, 8, 2, 128, 16, causal=True, q_data_type=torch.bfloat16, **plan_kw)
    else:
        w = flashjit.BatchDecodeWithPagedKVCacheWrapper(_workspace(), use_tensor_cores=False)
        w._device = torch.device("cpu")
        w.plan(*table, 8, 2, 128, 16, q_data_type=torch.bfloat16, **plan_kw)
    return w


@pytest.mark.parametrize("kind", ["ragged", "paged", "decode"])
def test_mode_reaches_every_wrapper_plan(planned, monkeypatch, kind):
    """plan(batch_invariant=True), or FLASHJIT_BATCH_INVARIANT=1 with no
    argument, plans the prefill kernel with fixed chunks; False wins over the
    setting. The mode's own partial state stands in for a workspace too small."""
    _plan(kind, 3 * C + 1, batch_invariant=True)
    monkeypatch.setenv(_invariant.ENV_VAR, "1")
    _plan(kind, 3 * C + 1)
    _plan(kind, 3 * C + 1, batch_invariant=False)
    (spec_on, work_on), (spec_env, work_env), (spec_off, work_off) = planned
    assert spec_on == spec_env and spec_on.backend == "fa3" and spec_on.use_tensor_cores and spec_on.causal
    assert spec_on.invariant_decode == (kind == "decode")
    assert work_on == work_env and work_on.kv_chunk == C
    assert spec_off.backend == ("fa2" if kind == "decode" else "fa3") and not spec_off.invariant_decode
    assert work_off.kv_chunk != C  # normal mode sizes its chunks for 132 CTAs


def test_mode_reaches_the_single_request_ops(monkeypatch):
    seen = []

    def record(op, dtype, use_tensor_cores, backend, targets=None, strict=None, kv_dtype=None, head_dim=None,
               head_dim_vo=None, custom_mask=False):
        seen.append((op, use_tensor_cores))
        raise ValueError("stop here")  # no launch: this test has no GPU
    monkeypatch.setattr(arch, "choose_backend", record)
    q = torch.randn(4, 2, 64, dtype=torch.float16)
    for mode in ({"batch_invariant": True}, {}):
        with pytest.raises(ValueError, match="stop here"):
            flashjit.single_decode_with_kv_cache(q[0], q, q, **mode)
        with pytest.raises(ValueError, match="stop here"):
            flashjit.single_prefill_with_kv_cache(q, q, q, use_tensor_cores=False, **mode)
        monkeypatch.setenv(_invariant.ENV_VAR, "1")  # the second round: the process setting
    assert seen == [("single_prefill", True)] * 4
    monkeypatch.setenv(_invariant.ENV_VAR, "0")
    with pytest.raises(ValueError, match="stop here"):
        flashjit.single_decode_with_kv_cache(q[0], q, q)
    assert seen[-1] == ("single_decode", False)


def test_traced_calls_take_the_mode_from_the_process():
    from flashjit.ops.prefill import _check_traced_mode

    _check_traced_mode(None)
    _check_traced_mode(False)  # the process setting is off too
    with pytest.raises(NotImplementedError, match=r"^batch_invariant=True: .*FLASHJIT_BATCH_INVARIANT"):
        _check_traced_mode(True)


def test_single_request_split_ignores_the_grid():
    """The single-request ops cut the keys in the mode's chunks whatever the
    wave of CTAs (a split_ctas of 0 would never split in normal mode)."""
    for split_ctas in (0, 1, 10000):
        assert _calls.single_request_split(C, 2, split_ctas, C) == (1, 0)
        assert _calls.single_request_split(C + 1, 2, split_ctas, C) == (2, C)
        assert _calls.single_request_split(3 * C, 80, split_ctas, C) == (3, C)
    assert _calls.single_request_split(3 * C, 2, 0, 0) == (1, 0)  # normal mode: a split_ctas of 0 never splits
    assert _invariant.single_split(0, C) == (1, 0)


def test_single_request_fold_where_the_grid_fills_a_wave(monkeypatch):
    """A kernel that folds chunks itself runs a request unsplit once its grid
    fills a wave (normal mode's rule); fold_policy forces either way."""
    assert _calls.single_request_split(3 * C, 200, 132, C, fold=True) == (1, 0)
    assert _calls.single_request_split(3 * C, 131, 132, C, fold=True) == (3, C)
    assert _calls.single_request_split(3 * C, 200, 132, C, fold=False) == (3, C)
    monkeypatch.setattr(_invariant, "fold_policy", "always")
    assert _calls.single_request_split(3 * C, 2, 132, C, fold=True) == (1, 0)
    monkeypatch.setattr(_invariant, "fold_policy", "never")
    assert _calls.single_request_split(3 * C, 200, 132, C, fold=True) == (3, C)


def test_fold_plan_where_splitting_gains_nothing(monkeypatch):
    """Prefill of long prompts fills the GPU unsplit: one item per query tile,
    whose CTA folds its chunks (no partial state, no merge pass). A few long
    decode rows would leave SMs idle: split into chunks as without fold."""
    kw = dict(group=4, rows_per_cta=128, num_kv_heads=8, resident_ctas=132, chunk=C, causal=True)
    prefill = _invariant.plan([2 * C] * 4, [2 * C] * 4, fold=True, **kw)
    assert prefill.folds and prefill.merge_indptr is None and prefill.partial_rows == 0 and prefill.kv_chunk == C
    assert sorted(item[:3] for item in prefill.items) == [(r, t, -1) for r in range(4) for t in range(2 * C // 32)]
    decode = _invariant.plan([1] * 4, [10 * C] * 4, fold=True, **kw)
    assert not decode.folds and decode.merge_indptr is not None and decode.kv_chunk == C
    assert decode == _invariant.plan([1] * 4, [10 * C] * 4, **kw)  # the split plan
    short = _invariant.plan([C] * 4, [C] * 4, fold=True, **kw)
    assert not short.folds and short.kv_chunk == 0  # nothing spans two chunks
    monkeypatch.setattr(_invariant, "fold_policy", "always")
    assert _invariant.plan([1] * 4, [10 * C] * 4, fold=True, **kw).folds
    monkeypatch.setattr(_invariant, "fold_policy", "never")
    assert _invariant.plan([2 * C] * 4, [2 * C] * 4, fold=True, **kw) == _invariant.plan([2 * C] * 4, [2 * C] * 4,
                                                                                         **kw)


def test_fold_scratch_fits_the_persistent_grid(planned):
    """A folding plan's scratch (one slot per resident CTA) lies at the partial
    state's address, in the workspace or the wrapper's own buffer."""
    w = _plan("ragged", 3 * C + 1, batch_invariant=True)
    assert w._plan.work.folds and _invariant.folds(w._plan.module.spec)
    need = 4 * _invariant.scratch_floats(132, 128, 128)
    base = w._plan.partials[0]
    if w._own_partials is not None and base == w._own_partials.data_ptr():
        assert w._own_partials.numel() * 4 >= need
    else:
        assert base == w._workspace.data_ptr() and w._workspace.numel() * w._workspace.element_size() >= need


def test_chunk_size():
    assert _invariant.chunk_keys(None, True, 128) == C
    assert _invariant.chunk_keys(100, True, 64) == 128  # a fixed split, rounded up to the kernel's tile
    assert _invariant.chunk_keys(None, False, 64) == 0  # disable_split_kv


def _request_items(plan, request):
    return sorted(item[1:] for item in plan.items if item[0] == request)


def _merge_counts(plan, qo_lens, request):
    if plan.merge_indptr is None:
        return [0] * qo_lens[request]
    start = sum(qo_lens[:request])
    return [plan.merge_indptr[t + 1] - plan.merge_indptr[t] for t in range(start, start + qo_lens[request])]


@pytest.mark.parametrize("group,rows", [(4, 128), (1, 64), (6, 64), (32, 64)])
@pytest.mark.parametrize("causal", [True, False])
def test_split_policy_does_not_depend_on_the_batch(group, rows, causal):
    """A request's items and its tokens' partial rows are the same alone and
    among others of random lengths, whatever the GPU's wave of CTAs."""
    rng = random.Random(group * rows)
    targets = [(C + 900, C + 900), (1, 3 * C + 5), (300, 300), (17, 2 * C), (1, C), (0, 5), (5, 0)]
    for qo, kv in targets:
        alone = _invariant.plan([qo], [kv], group=group, rows_per_cta=rows, num_kv_heads=2, resident_ctas=264,
                                chunk=C, causal=causal)
        for n_others in (1, 7, 64):
            qo_lens, kv_lens = [], []
            for _ in range(n_others):
                k = rng.randint(1, 3 * C)
                qo_lens.append(rng.choice([1, k, rng.randint(1, k)]))
                kv_lens.append(k)
            at = rng.randint(0, n_others)
            qo_lens.insert(at, qo)
            kv_lens.insert(at, kv)
            batch = _invariant.plan(qo_lens, kv_lens, group=group, rows_per_cta=rows, num_kv_heads=2,
                                    resident_ctas=rng.choice([66, 132, 1056]), chunk=C, causal=causal)
            assert _request_items(batch, at) == _request_items(alone, 0)
            assert _merge_counts(batch, qo_lens, at) == _merge_counts(alone, [qo], 0)
            assert batch.kv_chunk in (0, C)


@pytest.mark.parametrize("group,rows", [(4, 128), (6, 64), (6, 128), (3, 16)])
def test_every_token_merges_the_chunks_it_sees(group, rows):
    """Each tile runs once unsplit or once per chunk; a token's partial rows
    cover every chunk it sees; tiles that share a token (group 6 over 64 rows)
    take one count, so that every item covering a token writes a row it owns."""
    qo_lens, kv_lens = [C + 900, 1, 3, 2 * C + 1], [C + 900, 3 * C + 5, 3 * C, 2 * C + 1]
    plan = _invariant.plan(qo_lens, kv_lens, group=group, rows_per_cta=rows, num_kv_heads=2, resident_ctas=132,
                           chunk=C, causal=True)
    for r, (qo, kv) in enumerate(zip(qo_lens, kv_lens)):
        counts = _merge_counts(plan, qo_lens, r)
        by_tile = {}
        for tile, split, chunk in _request_items(plan, r):
            by_tile.setdefault(tile, []).append(split)
        assert sorted(by_tile) == list(range(-(-qo * group // rows)))
        for q in range(qo):
            sees = -(-min(kv, q + kv - qo + 1) // C)
            splits = sorted({s for row in range(q * group, (q + 1) * group) for s in by_tile[row // rows]})
            if counts[q] == 0:
                assert sees == 1 and splits == [-1]
            else:
                assert counts[q] >= sees and splits == list(range(counts[q]))


def test_chunks_never_grow_to_fit(planned):
    with pytest.raises(ValueError, match=r"^batch_invariant: the batch needs \d+ CTAs per KV head .* chunks of"):
        _invariant.plan([1] * 4, [10 * C] * 4, group=4, rows_per_cta=128, num_kv_heads=2, resident_ctas=132,
                        chunk=C, causal=True, max_items=20)
    w = _plan("decode", 40 * C, batch_invariant=True)  # 40 partial rows of 8 heads: past a 64 KB workspace
    assert w._plan.work.kv_chunk == C and w._own_partials is not None
    assert w._plan.partials[0] == w._own_partials.data_ptr()


def test_prewarm_selects_the_modes_kernels():
    """flashjit prewarm --batch-invariant: the kernels the selected ops load in
    the mode, per target arch (decode: its causal spec, on fa3 for sm_90a)."""
    args = cli.build_parser().parse_args(["prewarm", "--preset", "minimal", "--batch-invariant"])
    specs = cli.specs_from_args(args, ("sm_80", "sm_90a"))
    decode = {(s.op, s.backend) for s in specs if s.op in PREFILL_OF}
    assert decode == {(op, b) for op in PREFILL_OF for b in ("fa2", "fa3")}
    assert all(s.invariant_decode and s.use_tensor_cores for s in specs if s.op in PREFILL_OF)
    assert all(s.use_tensor_cores for s in specs if s.op != "append_paged")
    plain = cli.specs_from_args(cli.build_parser().parse_args(["prewarm", "--preset", "minimal"]), ("sm_90a",))
    assert not any(s.invariant_decode for s in plain)


@pytest.mark.parametrize("op", list(PREFILL_OF))
def test_prewarm_command_of_an_invariant_decode_builds_it(op):
    """The command a FLASHJIT_DISABLE_JIT miss names selects exactly that kernel."""
    import shlex

    spec = flashjit.KernelSpec.make(op, "bfloat16", 128, backend="fa3", use_tensor_cores=True, causal=True,
                                    return_lse=True)
    argv = shlex.split(jit.prewarm_command(spec, ("sm_90a",)))[1:]
    args = cli.build_parser().parse_args(argv)
    assert cli.specs_from_args(args, ("sm_90a",)) == [spec]


@pytest.mark.nvcc
@needs_nvcc
def test_fold_merge_loads_ahead_for_few_rows_and_keeps_its_registers_for_many(monkeypatch, tmp_path):
    """The fold pass over few rows (several warps a row: a long context) issues a
    block's output loads before its prefix maximum's shuffles (ptxas had sunk plain
    loads behind them, leaving the call's tail a chain of round trips); over many
    rows (a warp a row) it loads at their use and keeps an SM's eight CTAs (loads
    first took 96-128 registers and cost the split prefill merge up to 20 points:
    benchmarks/results/2026-11-25-h200-batch-invariant-merge-tail.md)."""
    import re

    set_cache_env(monkeypatch, tmp_path / "cache")
    spec = flashjit.KernelSpec.make("batch_decode_paged", "bfloat16", 128, use_tensor_cores=True, return_lse=True)
    result, = jit.build_many([spec], arches=("sm_90a",))
    assert result.entry is not None
    fold = {int(re.search(r"ELi(\d+)EEEv", u["kernel"]).group(1)): u for u in result.entry.manifest["resources"]
            if "merge_fold_states_kernel" in u["kernel"]}
    assert sorted(fold) == [1, 4]
    assert all(u["spill_stores"] == 0 and u["spill_loads"] == 0 for u in fold.values()), fold
    assert fold[1]["registers"] <= 64, fold[1]  # 8 CTAs of 128 threads an SM
    text = sass(result.entry.artifact)
    few = text[text.index("merge_fold_states_kernelI13__nv_bfloat16Li128ELi4E"):]
    few = few[:few.index("Function :")] if "Function :" in few else few
    ops = [m.group(1) for m in re.finditer(r"\s(LDG|SHFL)\.", few)]
    first_shuffle = ops.index("SHFL")
    assert ops[:first_shuffle].count("LDG") >= 32, ops[:first_shuffle + 1]
