"""A small Llama-style decoder (random weights, GQA) serving requests of different lengths
from flashjit's paged KV cache: chunked prefill (BatchPrefillWithPagedKVCacheWrapper over pages
that append_paged_kv_cache fills), then decode steps, each the replay of a CUDA graph of the
whole forward pass of a bucket of 1, 8 or 32 requests around BatchDecodeWithPagedKVCacheWrapper.
The same loop with PyTorch SDPA as the attention (eager: its shapes change every step) runs
beside it. Then a checked run holds flashjit's attention outputs to their tolerance profiles
against float64, and SDPA's to the sum of two profiles against flashjit's. A serving host
builds its kernels beforehand and never compiles while serving:

    flashjit prewarm --op batch_prefill_paged --dtype bf16 --head-dim 128 --causal on
    flashjit prewarm --op batch_decode_paged --dtype bf16 --head-dim 128 --tensor-cores on
    flashjit prewarm --op append_paged --dtype bf16 --head-dim 128
    FLASHJIT_DISABLE_JIT=1 python examples/serve.py

`python examples/serve.py --prewarm` runs the three, then serves (it sets
FLASHJIT_DISABLE_JIT=1 unless set). Under a minute on one GPU.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import subprocess
import sys
import time
from collections import deque
from itertools import accumulate

import torch
import torch.nn.functional as F

import flashjit  # cheap: no torch import, no CUDA, no compile; each name loads on first use

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 4, 2048, 16, 4, 128, 5632, 32000
DTYPE, PAGE, CHUNK, BUCKETS, MAX_PROMPT, MAX_NEW = torch.bfloat16, 16, 1024, (1, 8, 32), 2000, 128
PAGES_PER_REQUEST = math.ceil((MAX_PROMPT + MAX_NEW) / PAGE)
SCRATCH = 0  # the page a bucket's empty slots read and write
DEVICE = "cuda"
PREWARM = [["--op", "batch_prefill_paged", "--dtype", "bf16", "--head-dim", "128", "--causal", "on"],
           ["--op", "batch_decode_paged", "--dtype", "bf16", "--head-dim", "128", "--tensor-cores", "on"],
           ["--op", "append_paged", "--dtype", "bf16", "--head-dim", "128"]]


class Request:
    def __init__(self, prompt: list[int], max_new: int):
        self.tokens, self.prompt_len, self.max_new = list(prompt), len(prompt), max_new
        self.cached, self.pages = 0, []  # tokens whose K/V are in the cache; page ids

    def done(self) -> bool:
        return len(self.tokens) - self.prompt_len >= self.max_new


class Step:
    """One batch: (request, first position, new tokens) per piece, padded up to
    `pad_to` with one-token requests on the scratch page. Host tensors for
    plan(), which reads them there; device tensors for the model and append."""

    def __init__(self, pieces, pad_to: int = 0):
        device = DEVICE
        self.real = len(pieces)
        pieces = list(pieces) + [(None, 0, 1)] * (pad_to - len(pieces))
        self.qo, self.kv = [n for _, _, n in pieces], [first + n for _, first, n in pieces]
        self.pages = [r.pages[:math.ceil(kv / PAGE)] if r else [SCRATCH] for (r, _, _), kv in zip(pieces, self.kv)]
        i32 = dict(dtype=torch.int32)
        self.qo_indptr = torch.tensor([0, *accumulate(self.qo)], **i32)
        self.indptr = torch.tensor([0, *accumulate(len(p) for p in self.pages)], **i32)
        self.last = torch.tensor([(kv - 1) % PAGE + 1 for kv in self.kv], **i32)
        self.indices = torch.tensor([p for ps in self.pages for p in ps], **i32, device=device)
        self.d_indptr, self.d_last = self.indptr.to(device), self.last.to(device)
        self.tokens = torch.tensor([t for r, first, n in pieces for t in (r.tokens[first:first + n] if r else [0])],
                                   device=device)
        self.positions = torch.tensor([p for _, first, n in pieces for p in range(first, first + n)], **i32,
                                      device=device)
        self.batch = torch.tensor([b for b, n in enumerate(self.qo) for _ in range(n)], **i32, device=device)
        self.last_rows = self.qo_indptr[1:].to(device).long() - 1


def rms_norm(x):
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class Model:
    def __init__(self, num_pages: int):
        device = DEVICE
        g = torch.Generator(device=device).manual_seed(0)

        def w(fan_in, fan_out):
            return (torch.randn(fan_in, fan_out, generator=g, device=device) / math.sqrt(fan_in)).to(DTYPE)
        self.embed = torch.randn(VOCAB, HIDDEN, generator=g, device=device).to(DTYPE)
        self.layers = [dict(qkv=w(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM), o=w(HEADS * HEAD_DIM, HIDDEN),
                            up=w(HIDDEN, 2 * FFN), down=w(FFN, HIDDEN)) for _ in range(LAYERS)]
        self.head = w(HIDDEN, VOCAB)
        angle = torch.arange(MAX_PROMPT + MAX_NEW, device=device)[:, None] / 10000 ** (
            torch.arange(0, HEAD_DIM, 2, device=device) / HEAD_DIM)
        self.cos, self.sin = angle.cos(), angle.sin()
        self.cache = torch.zeros(LAYERS, num_pages, 2, PAGE, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
        self.probes = [None] * LAYERS  # each layer's last (q, attention output), for the check

    def rope(self, x, positions):
        cos, sin = self.cos[positions.long()][:, None], self.sin[positions.long()][:, None]
        a, b = x.float().chunk(2, -1)
        return torch.cat([a * cos - b * sin, a * sin + b * cos], -1).to(DTYPE)

    def forward(self, step: Step, attend, rows=None):
        """Greedy next tokens of `rows` (default: all) of step; attend(q, layer's cache) is the attention."""
        x = self.embed[step.tokens]
        for i, layer in enumerate(self.layers):
            q, k, v = (rms_norm(x) @ layer["qkv"]).split([HEADS * HEAD_DIM] + [KV_HEADS * HEAD_DIM] * 2, -1)
            q = self.rope(q.view(-1, HEADS, HEAD_DIM), step.positions)
            k = self.rope(k.view(-1, KV_HEADS, HEAD_DIM), step.positions)
            flashjit.append_paged_kv_cache(k, v.view(-1, KV_HEADS, HEAD_DIM), step.batch, step.positions,
                                           self.cache[i], step.indices, step.d_indptr, step.d_last)
            o = attend(q, self.cache[i])
            self.probes[i] = (q, o)
            x = x + o.reshape(-1, HEADS * HEAD_DIM) @ layer["o"]
            gate, up = (rms_norm(x) @ layer["up"]).chunk(2, -1)
            x = x + (F.silu(gate) * up) @ layer["down"]
        return (rms_norm(x if rows is None else x[rows]) @ self.head).argmax(-1)


def sdpa_attention(q, cache, step: Step):
    """The PyTorch baseline: the requests padded to one batch, K/V gathered
    from their pages, a bottom-right causal mask (a chunk sees its prefix)."""
    n, lq, pages = step.real, max(step.qo[:step.real]), max(len(p) for p in step.pages[:step.real])
    table = torch.tensor([p + [SCRATCH] * (pages - len(p)) for p in step.pages[:n]], device=q.device)
    kv = cache[table].transpose(1, 2).flatten(2, 3).transpose(2, 3)  # [n, 2, kv heads, pages * PAGE, head_dim]
    k, v = (kv[:, j].repeat_interleave(HEADS // KV_HEADS, 1) for j in (0, 1))
    reqs = torch.tensor([b for b in range(n) for _ in range(step.qo[b])], device=q.device)
    rows = torch.tensor([i for b in range(n) for i in range(step.qo[b])], device=q.device)
    qo, kv_len = (torch.tensor(x[:n], device=q.device)[:, None, None] for x in (step.qo, step.kv))
    i, j = torch.arange(lq, device=q.device)[:, None], torch.arange(pages * PAGE, device=q.device)
    mask = (j <= torch.minimum(i, qo - 1) + kv_len - qo)[:, None]  # padded query rows: as their last real one
    padded = q.new_zeros(n, lq, HEADS, HEAD_DIM)
    padded[reqs, rows] = q[:len(rows)]
    return F.scaled_dot_product_attention(padded.transpose(1, 2), k, v, attn_mask=mask).transpose(1, 2)[reqs, rows]


class DecodeGraph:
    """One bucket: static inputs, a decode wrapper planned in place before each
    replay, and the whole forward pass captured once as a CUDA graph."""

    def __init__(self, model: Model, bucket: int, workspace):
        self.bucket = bucket
        self.wrapper = flashjit.BatchDecodeWithPagedKVCacheWrapper(
            workspace, use_cuda_graph=True, use_tensor_cores=True,
            paged_kv_indices_buffer=torch.empty(bucket * PAGES_PER_REQUEST, dtype=torch.int32, device=DEVICE))
        self.static = Step([], pad_to=bucket)
        self.static.indices = torch.zeros(bucket * PAGES_PER_REQUEST, dtype=torch.int32, device=DEVICE)
        self.load(Step([], pad_to=bucket))  # the first plan() fixes the batch size for the graph
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # outside the capture: loads the kernels, fills the wrappers' caches
            model.forward(self.static, self.wrapper.run)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.next = model.forward(self.static, self.wrapper.run)
        self.probes = list(model.probes)  # tensors of the graph's memory: each replay rewrites them

    def load(self, step: Step) -> None:
        for name in ("tokens", "positions", "d_indptr", "d_last"):
            getattr(self.static, name).copy_(getattr(step, name))
        self.static.indices[:step.indices.numel()].copy_(step.indices)
        self.wrapper.plan(step.indptr, step.indices, step.last, HEADS, KV_HEADS, HEAD_DIM, PAGE, q_data_type=DTYPE)


class Engine:
    """Steps of the model with flashjit (decode: a CUDA graph per bucket) or SDPA (eager) as the attention."""

    def __init__(self, model: Model, name: str):
        self.model, self.name = model, name
        if name == "flashjit":
            def workspace():
                return torch.empty(128 << 20, dtype=torch.uint8, device=DEVICE)
            self.wrapper = flashjit.BatchPrefillWithPagedKVCacheWrapper(workspace())
            self.graphs = {b: DecodeGraph(model, b, workspace()) for b in BUCKETS}

    def prefill(self, pieces):
        step = Step(pieces)
        if self.name == "flashjit":
            self.wrapper.plan(step.qo_indptr, step.indptr, step.indices, step.last, HEADS, KV_HEADS, HEAD_DIM, PAGE,
                              causal=True, q_data_type=DTYPE)
        attend = self.wrapper.run if self.name == "flashjit" else lambda q, cache: sdpa_attention(q, cache, step)
        return self.model.forward(step, attend, step.last_rows).tolist(), step, self.model.probes

    def decode(self, pieces):
        if self.name != "flashjit":
            return self.prefill(pieces)  # one query token per request: a chunk of one
        graph = self.graphs[min(b for b in BUCKETS if b >= len(pieces))]
        step = Step(pieces, pad_to=graph.bucket)
        graph.load(step)
        graph.graph.replay()
        return graph.next[:len(pieces)].tolist(), step, graph.probes


def serve(engine, requests, num_pages: int, check=None) -> dict:
    """Runs `requests` to completion, up to 32 at a time: each iteration one
    prefill chunk of up to CHUNK prompt tokens, then one decode step for every
    request past its prompt. Greedy sampling; pages come back as requests end."""
    free, waiting, running = deque(range(1, num_pages)), deque(requests), []
    stats = dict(prompt=0, decoded=0, steps=0, prefill_s=0.0, decode_s=0.0)
    while waiting or running:
        while waiting and len(running) < BUCKETS[-1]:
            r = waiting.popleft()
            r.pages = [free.popleft() for _ in range(math.ceil((r.prompt_len + r.max_new) / PAGE))]
            running.append(r)
        budget, pieces = CHUNK, []
        for r in running:
            if r.cached < r.prompt_len and budget:
                pieces.append((r, r.cached, min(budget, r.prompt_len - r.cached)))
                budget -= pieces[-1][2]
        if pieces:
            start = time.perf_counter()
            ids, step, probes = engine.prefill(pieces)  # ids: a host list, so the step has finished
            for (r, first, n), token in zip(pieces, ids):
                r.cached = first + n
                if r.cached == r.prompt_len:
                    r.tokens.append(token)
            stats["prefill_s"] += time.perf_counter() - start
            stats["prompt"] += sum(n for _, _, n in pieces)
            if check:
                check("prefill", step, probes)
        decoding = [r for r in running if r.cached >= r.prompt_len and not r.done()]
        if decoding:
            start = time.perf_counter()
            ids, step, probes = engine.decode([(r, r.cached, 1) for r in decoding])
            for r, token in zip(decoding, ids):
                r.cached += 1
                r.tokens.append(token)
            stats["decode_s"] += time.perf_counter() - start
            stats["decoded"], stats["steps"] = stats["decoded"] + len(decoding), stats["steps"] + 1
            if check:
                check("decode", step, probes)
        for r in [r for r in running if r.done()]:
            running.remove(r)
            free.extend(r.pages)
    return stats


def check(model: Model, worst: dict, kind: str, step: Step, probes) -> None:
    """Each layer's attention output of a step: flashjit's within its tolerance
    profile of float64; SDPA's, on the same q and pages, within the sum of two
    such profiles of flashjit's (SDPA has none of its own; its kernels round
    like a tensor-core kernel of the same dtype, or compute in fp32)."""
    spec = flashjit.KernelSpec.make(f"batch_{kind}_paged", DTYPE, HEAD_DIM, use_tensor_cores=True,
                                    causal=kind == "prefill", return_lse=True)
    bounds, real = step.qo_indptr.tolist(), step.real
    for layer, (q, o) in enumerate(probes):
        q, o, cache = q[:bounds[real]], o[:bounds[real]], model.cache[layer]
        pages = [cache[step.indices[int(step.indptr[b]):int(step.indptr[b + 1])].long()] for b in range(real)]
        ks, vs = ([p[:, j].flatten(0, 1)[:step.kv[b]] for b, p in enumerate(pages)] for j in (0, 1))
        ref = torch.cat([flashjit.attention_reference(q[bounds[b]:bounds[b + 1]], ks[b], vs[b], causal=True)[0]
                         for b in range(real)])
        tol = flashjit.tolerance(spec, q=q, k=torch.cat(ks), v=torch.cat(vs), kv_len=max(step.kv[:real]))
        diff = (sdpa_attention(q, cache, step).double() - o.double()).abs() / (tol + tol).bound(ref)
        for who, ratio in (("flashjit", tol.ratio(o, ref)), ("SDPA", float(diff.nan_to_num(math.inf).max()))):
            worst[kind, who] = max(worst.get((kind, who), 0.0), ratio)
    worst["calls"] = worst.get("calls", 0) + len(probes)
    worst.setdefault("buckets", set()).update([len(step.qo)] if kind == "decode" else [])


def make_requests(count: int, seed: int, prompt=(16, MAX_PROMPT), new=(16, MAX_NEW)) -> list[Request]:
    rng = random.Random(seed)
    return [Request([rng.randrange(VOCAB) for _ in range(rng.randint(*prompt))], rng.randint(*new))
            for _ in range(count)]


def prewarm() -> int:
    env = {k: v for k, v in os.environ.items() if k != "FLASHJIT_DISABLE_JIT"}  # prewarm is where compiling happens
    for args in PREWARM:
        print(f"$ flashjit prewarm {' '.join(args)}", flush=True)
        if subprocess.run([sys.executable, "-m", "flashjit", "prewarm", *args], env=env).returncode:
            print(f"serve.py: flashjit prewarm {' '.join(args)} failed (its output is above)", file=sys.stderr)
            return 1
    return 0


def run(args) -> int:
    num_pages = 1 + BUCKETS[-1] * PAGES_PER_REQUEST
    model = Model(num_pages)
    print(f"{args.requests} requests, prompts of 16-{MAX_PROMPT} tokens, 16-{MAX_NEW} new tokens each; {LAYERS} "
          f"layers, {HEADS}/{KV_HEADS} heads of {HEAD_DIM}, bf16, pages of {PAGE}, prefill chunks of {CHUNK} tokens")
    engines, times = [Engine(model, "flashjit"), Engine(model, "torch SDPA")], {}
    for engine in engines:
        serve(engine, make_requests(4, args.seed + 1, prompt=(16, 300), new=(2, 9)), num_pages)  # warm-up
        s = serve(engine, make_requests(args.requests, args.seed), num_pages)
        times[engine.name] = (s["prefill_s"], s["decode_s"])
        print(f"{engine.name:<10}  prefill {s['prompt'] / s['prefill_s']:>8.0f} tok/s ({s['prompt']} tokens)  "
              f"decode {s['decoded'] / s['decode_s']:>6.0f} tok/s ({s['decoded']} tokens in {s['steps']} steps)  "
              f"{s['prefill_s'] + s['decode_s']:.2f} s", flush=True)
    (fp, fd), (sp, sd) = times["flashjit"], times["torch SDPA"]
    print(f"flashjit against SDPA: prefill {sp / fp:.2f}x, decode {sd / fd:.2f}x as fast (decode: CUDA graphs of "
          f"buckets {', '.join(map(str, BUCKETS))} against eager SDPA)")
    # A prompt longer than a chunk; a dozen requests decoding at once fill bucket 32, then 8, then 1.
    lens = [(1500, 14), (600, 12), (17, 9), (300, 16), (64, 11), (450, 10), (33, 13), (250, 8), (520, 15), (100, 12),
            (700, 30), (5, 9)]
    worst = {}
    serve(engines[0], [Request(list(range(p)), m) for p, m in lens], num_pages,
          check=lambda *step: check(model, worst, *step))
    calls, buckets = worst.pop("calls"), sorted(worst.pop("buckets"))
    bad = [f"{who} {kind}" for (kind, who), ratio in worst.items() if not ratio <= 1.0]
    print(f"check: {calls} attention outputs (decode buckets {buckets}); worst err/bound (flashjit against "
          "float64, SDPA against flashjit): " + ", ".join(f"{w} {k} {r:.3f}" for (k, w), r in sorted(worst.items()))
          + (f"\nFAIL: past the bound: {', '.join(bad)}" if bad else "; every output within its bound"))
    return 1 if bad else 0


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prewarm", action="store_true", help="run the three flashjit prewarm commands first")
    parser.add_argument("--requests", type=positive_int, default=64, help="requests in the timed stream (default 64)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the request stream: lengths and tokens (default 0)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("serve.py: needs a CUDA GPU (SM80 or newer)", file=sys.stderr)
        return 2
    if args.prewarm and prewarm():
        return 1
    os.environ.setdefault("FLASHJIT_DISABLE_JIT", "1")  # a kernel missing from the cache is an error, not a compile
    try:
        return run(args)
    except flashjit.JitDisabledError as exc:
        print(f"serve.py: {exc}\nserve.py: run `python examples/serve.py --prewarm`, or the prewarm commands in "
              "its docstring", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
