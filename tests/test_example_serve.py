"""examples/serve.py: its prewarm commands select exactly the kernels it
loads; its SDPA baseline, paging, chunked prefill and check run on the CPU with
a tiny model (the flashjit engine needs a GPU); on a GPU the whole example."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys

import pytest
import torch

import flashjit
from flashjit import cli
from flashjit.spec import KernelSpec
from helpers_cache import REPO, subprocess_env

EXAMPLE = REPO / "examples" / "serve.py"


def load_example(**small):
    spec = importlib.util.spec_from_file_location("serve_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, value in small.items():
        setattr(module, name, value)
    module.PAGES_PER_REQUEST = math.ceil((module.MAX_PROMPT + module.MAX_NEW) / module.PAGE)
    return module


@pytest.fixture
def tiny():
    """A model small enough for the CPU; head_dim 64 has a tolerance profile."""
    return load_example(DEVICE="cpu", LAYERS=2, HEADS=4, KV_HEADS=2, HEAD_DIM=64, HIDDEN=256, FFN=384, VOCAB=97,
                        PAGE=4, MAX_PROMPT=40, MAX_NEW=6, CHUNK=24)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_prewarm_commands_select_what_the_example_loads(arch):
    ex = load_example()
    selected = set()
    for args in ex.PREWARM:
        selected |= set(cli.specs_from_args(cli.build_parser().parse_args(["prewarm", *args, "--arch", arch])))
    prefill_backend = "fa3" if arch == "sm_90a" else "fa2"  # what backend="auto" takes there
    assert selected == {
        KernelSpec.make("batch_prefill_paged", "bfloat16", 128, use_tensor_cores=True, causal=True, return_lse=True,
                        backend=prefill_backend),
        KernelSpec.make("batch_decode_paged", "bfloat16", 128, use_tensor_cores=True, return_lse=True),
        KernelSpec.make("append_paged", "bfloat16", 128)}
    for args in ex.PREWARM:  # the docstring shows the same commands
        assert f"flashjit prewarm {' '.join(args)}\n" in ex.__doc__


def pieces_of(ex, lengths):
    """(request, first position, new tokens) for requests with `lengths` = (cached, new); pages in scrambled order."""
    out, next_page = [], 1
    for cached, new in lengths:
        r = ex.Request(list(range(cached + new)), 1)
        count = math.ceil((cached + new) / ex.PAGE)
        r.pages = [next_page + (i * 7) % count for i in range(count)]
        next_page += count
        out.append((r, cached, new))
    return out, next_page


def test_sdpa_baseline_matches_float64(tiny):
    """Padding, page gathering and the bottom-right causal mask of the baseline:
    chunks with and without a prefix, decode rows, in float32 against float64."""
    pieces, pages = pieces_of(tiny, [(0, 9), (13, 5), (30, 1), (3, 1), (0, 1)])
    step = tiny.Step(pieces)
    cache = torch.randn(pages, 2, tiny.PAGE, tiny.KV_HEADS, tiny.HEAD_DIM)
    q = torch.randn(sum(step.qo), tiny.HEADS, tiny.HEAD_DIM)
    out = tiny.sdpa_attention(q, cache, step)
    bounds = step.qo_indptr.tolist()
    for b, (r, first, n) in enumerate(pieces):
        kv = cache[torch.tensor(r.pages)].transpose(0, 1).flatten(1, 2)[:, :first + n]
        qb = q[bounds[b]:bounds[b + 1]]
        ref, _ = flashjit.attention_reference(qb, kv[0], kv[1], causal=True)
        # The fp32 profile of the same attention (softmax and P.V in fp32, as SDPA's math here).
        tol = flashjit.tolerance(KernelSpec.make("single_prefill", "float32", tiny.HEAD_DIM, causal=True), q=qb,
                                 k=kv[0], v=kv[1], kv_len=first + n, sm_scale=tiny.HEAD_DIM ** -0.5)
        tol.assert_close(out[bounds[b]:bounds[b + 1]], ref, f"request {b}")


def test_padded_step_points_empty_slots_at_the_scratch_page(tiny):
    pieces, _ = pieces_of(tiny, [(10, 1), (3, 1)])
    step = tiny.Step(pieces, pad_to=8)
    assert step.real == 2 and step.qo == [1] * 8 and step.kv == [11, 4] + [1] * 6
    assert step.pages[2:] == [[tiny.SCRATCH]] * 6 and step.last.tolist() == [3, 4] + [1] * 6
    assert step.batch.tolist() == list(range(8)) and step.positions.tolist() == [10, 3] + [0] * 6


def test_serving_loop_chunked_and_whole_prompts_agree(tiny):
    """Chunked prefill through the pages gives the tokens that whole-prompt
    prefill gives (float32, SDPA), every request ends with its new tokens, and
    every page comes back."""
    tiny.DTYPE = torch.float32
    num_pages = 1 + tiny.BUCKETS[-1] * tiny.PAGES_PER_REQUEST
    runs = []
    for chunk in (7, 1000):
        tiny.CHUNK = chunk
        requests = tiny.make_requests(40, 3, prompt=(1, 40), new=(1, 6))
        stats = tiny.serve(tiny.Engine(tiny.Model(num_pages), "torch SDPA"), requests, num_pages)
        assert all(len(r.tokens) == r.prompt_len + r.max_new and r.cached == len(r.tokens) - 1 for r in requests)
        assert stats["prompt"] == sum(r.prompt_len for r in requests)
        assert stats["decoded"] == sum(r.max_new - 1 for r in requests)
        runs.append([r.tokens for r in requests])
    assert runs[0] == runs[1]


def test_check_holds_outputs_to_the_profile_and_catches_a_wrong_one(tiny):
    num_pages = 1 + tiny.BUCKETS[-1] * tiny.PAGES_PER_REQUEST
    model = tiny.Model(num_pages)
    worst = {}
    tiny.serve(tiny.Engine(model, "torch SDPA"), tiny.make_requests(12, 5, prompt=(1, 40), new=(2, 6)), num_pages,
               check=lambda *step: tiny.check(model, worst, *step))
    assert worst.pop("calls") > 0 and worst.pop("buckets")
    assert set(worst) == {(k, w) for k in ("prefill", "decode") for w in ("flashjit", "SDPA")}
    assert all(ratio <= 1.0 for ratio in worst.values()), worst  # SDPA's own bf16 outputs, in flashjit's profile

    engine = tiny.Engine(model, "torch SDPA")
    plain = engine.prefill

    def off_by_a_little(pieces):  # one output element moved by 0.05: past a bf16 bound of ~1e-2 * max|v|
        ids, step, probes = plain(pieces)
        probes[0][1][0, 0, 0] += 0.05 * float(probes[0][1].abs().max())
        return ids, step, probes
    engine.prefill = off_by_a_little
    worst = {}
    tiny.serve(engine, tiny.make_requests(2, 6, prompt=(5, 20), new=(2, 2)), num_pages,
               check=lambda *step: tiny.check(model, worst, *step))
    assert worst["prefill", "flashjit"] > 1.0 and worst["prefill", "SDPA"] > 1.0


@pytest.mark.gpu
def test_example_serves_and_agrees():
    """The whole example: three prewarms (cold: a few configurations' compile),
    then both loops and the check; under a minute with the kernels cached."""
    run = subprocess.run([sys.executable, str(EXAMPLE), "--prewarm"], cwd=REPO, env=subprocess_env(arches=None),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    assert run.stdout.count("tok/s") == 4 and "every output within its bound" in run.stdout, run.stdout
    assert "decode buckets [1, 8, 32]" in run.stdout, run.stdout
