"""Exact attention in float64: the reference every tolerance profile is measured
against. Same semantics as the kernels: bottom-right causal alignment, sliding
window, soft-cap, custom masks, GQA; a query that sees no key outputs 0 with
LSE -inf; LSE is base 2."""

from __future__ import annotations

import math

import torch


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                        sm_scale: float | None = None, window_left: int = -1, logits_soft_cap: float | None = None,
                        kv_layout: str = "NHD", k_scale=None, v_scale=None,
                        sinks: torch.Tensor | None = None,
                        mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [qo_len, H, D], k [kv_len, Hkv, D], v [kv_len, Hkv, Dv] (NHD; Dv: head_dim_vo, D's or
    narrower) -> (o [qo_len, H, Dv] float64, lse [qo_len, H] float64); sm_scale defaults to 1/sqrt(D).
    k_scale / v_scale (an FP8 cache's; floats or one-element tensors): the keys and
    values are k * k_scale and v * v_scale, dequantised in float64 (exact for FP8
    codes times an fp32 scale), so the cache's quantisation is not in the error.
    sinks ([H], natural units): one more logit per row, after the scale and the
    soft-cap, whose probability joins the denominator (and the LSE) but not the output.
    mask ([qo_len, kv_len] bool, True: the query sees the key): a custom mask,
    applied with the causal and window masks."""
    if kv_layout == "HND":
        k, v = k.transpose(0, 1), v.transpose(0, 1)
    qo_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    qd = q.double()
    kd = (k.double() * _scale(k_scale)).repeat_interleave(group, dim=1)
    vd = (v.double() * _scale(v_scale)).repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", qd, kd) * sm_scale
    if logits_soft_cap:
        logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
    i = torch.arange(qo_len, device=q.device)[:, None]
    j = torch.arange(kv_len, device=q.device)[None, :]
    visible = torch.ones(qo_len, kv_len, dtype=torch.bool, device=q.device)
    if causal:
        visible &= j <= i + (kv_len - qo_len)
    if window_left is not None and window_left >= 0:
        visible &= j >= i + (kv_len - qo_len) - window_left
    if mask is not None:
        visible &= mask.to(device=q.device, dtype=torch.bool).reshape(qo_len, kv_len)
    logits = logits.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(logits, dim=-1)                      # [H, qo_len], natural log
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.double().to(q.device)[:, None])
    weights = torch.exp(logits - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("hqk,khd->qhd", weights, vd)
    return out, (lse / math.log(2.0)).transpose(0, 1)


def _scale(scale) -> float:
    """A scale as the kernels take it, a float32, as a float64 multiplier (1 when
    absent); a tensor is read (a host sync)."""
    if scale is None:
        return 1.0
    if not isinstance(scale, torch.Tensor):
        scale = torch.tensor(float(scale))
    return float(scale.float().double().item())


def ragged_reference(q, k, v, qo_indptr, kv_indptr, masks=None, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_reference per request of a packed NHD batch; masks: one
    [qo_len, kv_len] bool mask per request (request_masks splits a flat one), or None."""
    outs, lses = [], []
    for b in range(len(qo_indptr) - 1):
        qs, qe, ks, ke = int(qo_indptr[b]), int(qo_indptr[b + 1]), int(kv_indptr[b]), int(kv_indptr[b + 1])
        mask = {"mask": masks[b]} if masks is not None else {}
        o, lse = attention_reference(q[qs:qe], k[ks:ke], v[ks:ke], **kwargs, **mask)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def request_masks(mask: torch.Tensor, qo_lens, kv_lens) -> list[torch.Tensor]:
    """A batch's flat custom mask (each request's [qo_len, kv_len] pairs row-major,
    request after request, as the prefill wrappers' plan() takes it) as one bool
    [qo_len, kv_len] tensor per request."""
    flat, out, start = mask.reshape(-1).to(torch.bool), [], 0
    for qo_len, kv_len in zip(qo_lens, kv_lens):
        out.append(flat[start:start + qo_len * kv_len].view(qo_len, kv_len))
        start += qo_len * kv_len
    if start != flat.numel():
        raise ValueError(f"mask: expected {start} elements (sum of qo_len * kv_len), got {flat.numel()}")
    return out


def mla_reference(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, kv_len_arr, *,
                  causal: bool = False, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA over a paged cache in float64, request by request: keys [ckv | kpe] and
    values ckv gathered from the request's pages in order, one KV head shared by
    every query head. q_nope [tokens, H, 512], q_pe [tokens, H, 64], caches
    [pages, page_size, dim] -> (o [tokens, H, 512] float64, lse [tokens, H] base 2)."""
    outs, lses = [], []
    for b in range(len(qo_indptr) - 1):
        qs, qe = int(qo_indptr[b]), int(qo_indptr[b + 1])
        pages = kv_indices[int(kv_indptr[b]):int(kv_indptr[b + 1])].long()
        n = int(kv_len_arr[b])
        ckv = ckv_cache[pages].reshape(-1, ckv_cache.shape[-1])[:n]
        kpe = kpe_cache[pages].reshape(-1, kpe_cache.shape[-1])[:n]
        q = torch.cat([q_nope[qs:qe], q_pe[qs:qe]], dim=-1)
        k = torch.cat([ckv, kpe], dim=-1)[:, None]
        o, lse = attention_reference(q, k, ckv[:, None], causal=causal, sm_scale=sm_scale)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)
