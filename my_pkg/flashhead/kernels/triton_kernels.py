"""Triton stage-2 kernels of FlashHead (imported lazily; needs Triton).

One program per (batch row, probe): it loads the probed cluster's member ids from
the cluster map, streams their head rows in ``BLOCK_H`` slices (masked, so the
hidden size need not be a multiple of the block) and reduces the dot products in
fp32, and writes every candidate's logit and id.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import torch_ref

__all__ = ["candidate_logits"]

_BLOCK_H = 128


@triton.jit
def _cluster_dot(
    hidden_ptr,
    weight_ptr,
    members_ptr,
    row,
    cluster,
    stride_hb,
    stride_wv,
    stride_mc,
    H,
    CAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < CAP
    tok = tl.load(members_ptr + cluster * stride_mc + offs_m, mask=m_mask, other=0).to(tl.int64)
    acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in range(0, H, BLOCK_H):
        offs_h = k + tl.arange(0, BLOCK_H)
        h_mask = offs_h < H
        x = tl.load(hidden_ptr + row * stride_hb + offs_h, mask=h_mask, other=0.0).to(tl.float32)
        w = tl.load(
            weight_ptr + tok[:, None] * stride_wv + offs_h[None, :], mask=m_mask[:, None] & h_mask[None, :], other=0.0
        ).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    return tok, acc, m_mask


@triton.jit
def _candidate_logits_kernel(
    hidden_ptr,
    weight_ptr,
    members_ptr,
    probes_ptr,
    ids_ptr,
    logits_ptr,
    stride_hb,
    stride_wv,
    stride_mc,
    stride_pb,
    stride_ob,
    H,
    CAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1).to(tl.int64)
    cluster = tl.load(probes_ptr + row * stride_pb + p).to(tl.int64)
    tok, acc, m_mask = _cluster_dot(
        hidden_ptr, weight_ptr, members_ptr, row, cluster, stride_hb, stride_wv, stride_mc, H, CAP, BLOCK_M, BLOCK_H
    )
    offs = row * stride_ob + p * CAP + tl.arange(0, BLOCK_M)
    tl.store(logits_ptr + offs, acc.to(logits_ptr.dtype.element_ty), mask=m_mask)
    tl.store(ids_ptr + offs, tok, mask=m_mask)


def _prep(hidden: torch.Tensor, weight: torch.Tensor, members: torch.Tensor, probes: torch.Tensor):
    if weight.stride(1) != 1:
        raise ValueError("weight rows must be contiguous")
    hidden = hidden.to(weight.dtype).contiguous()
    members = members.contiguous()
    probes = probes.contiguous()
    cap = members.shape[1]
    return hidden, members, probes, cap, triton.next_power_of_2(cap)


def candidate_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    members: torch.Tensor,
    probes: torch.Tensor,
    *,
    token_cluster: torch.Tensor | None = None,
    extra_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact logits of every candidate: ``(token_ids [B, P*cap] int64, logits [B, P*cap])``
    (``token_cluster`` is not needed: one program per (row, probe) reads each cluster in place).
    ``extra_ids`` ``[B, N]`` are scored by :func:`~.torch_ref.token_logits` and appended."""
    if extra_ids is not None:
        ids, logits = candidate_logits(hidden, weight, members, probes)
        extra = torch_ref.token_logits(hidden, weight, extra_ids)
        return torch.cat([ids, extra_ids.to(ids.dtype)], dim=1), torch.cat([logits, extra.to(logits.dtype)], dim=1)
    hidden, members, probes, cap, block_m = _prep(hidden, weight, members, probes)
    b, p = probes.shape
    ids = torch.empty(b, p * cap, dtype=torch.int64, device=weight.device)
    logits = torch.empty(b, p * cap, dtype=weight.dtype, device=weight.device)
    _candidate_logits_kernel[(b, p)](
        hidden,
        weight,
        members,
        probes,
        ids,
        logits,
        hidden.stride(0),
        weight.stride(0),
        members.stride(0),
        probes.stride(0),
        logits.stride(0),
        hidden.shape[1],
        CAP=cap,
        BLOCK_M=block_m,
        BLOCK_H=_BLOCK_H,
    )
    return ids, logits
