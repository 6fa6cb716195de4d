"""Pure-torch FlashHead kernels (CPU path and reference implementation).

Stage 2 on CPU uses ``torch.sparse.sampled_addmm``: the candidate token ids form the
column pattern of a CSR matrix ``[B, V']`` and the op evaluates ``hidden[b] . weight[v]``
only at those positions, reading each candidate row once without materialising a
gathered copy (a fresh ``index_select`` copy of thousands of rows is several times slower
on CPU).  The sparse op has no bfloat16/float16 CPU kernel: for those dtypes each row's
candidates are gathered in blocks of at most ``CpuPlan.gather_block_bytes`` and scored with
one ``mm`` per block.  The half-precision ``mm`` accumulates in float32 and rounds once
(about twice as fast as ``bmm``/``mv`` on the same rows), and a block that small is reused
by the allocator from step to step, where one gathered copy of every row of a batch
(hundreds of MB) is a fresh mapping that is page-faulted in again on every step.
A batch of several such rows is scored over the union of its ids (:func:`_logits_union`): each head row some
row needs is gathered once and multiplied by all the batch's hidden rows in one ``mm``; where this CPU's
``mm`` gives each column the values of its product alone (probed once, :func:`_mm_columns_exact`; bfloat16
does here, float16 from some widths does not), the logits are those of the row-by-row path bit for bit.
A batch of several rows with ``token_cluster`` is scored cluster by cluster instead
(:func:`_logits_grouped`): the CSR pattern is transposed to ``[V', B]``, so each head row that
some row of the batch probes is read once for all of them, not once per row.  The sparse kernel
computes each value as the same vectorized dot product either way, so the logits are bit for bit
those of the row-by-row pattern; only the memory traffic changes (the head's union of candidates
instead of ``B`` times each row's).
Under tensor parallelism a head covers one vocabulary shard, which holds from none to all of each
cluster's members, padded to the largest: a small batch then scores only the real members
(:func:`_candidates_sparse`), and the grouped pattern gives an empty cluster's slots token 0's logit.
The sparse kernel shares whole CSR rows among the threads; a batch with fewer rows than threads (one row at
low concurrency) has each row's ids cut into consecutive pieces, so every thread scores a share of them
(:func:`_row_parts`), again with the same values bit for bit.
On other devices rows are gathered with ``index_select`` and reduced with ``bmm``.
Where the CPU path switches between these ways is a :class:`CpuPlan`, an argument of :func:`candidate_logits` and
:func:`token_logits` (:data:`DEFAULT_PLAN` unless a head is given another); every plan gives the same logits, only
the speed changes.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ..layout import linear

__all__ = ["CpuPlan", "DEFAULT_PLAN", "stage1_scores", "candidate_ids", "candidate_logits", "token_logits"]


@dataclass(frozen=True)
class CpuPlan:
    """Where the CPU path switches between its ways of scoring the same ids (the logits do not change)."""

    #: Largest gathered block without the sparse op (bytes of candidate rows per ``mm``): one block per row at
    #: 128,256 x 2,048 in bf16, and below glibc's largest mmap threshold (32 MiB), so freed blocks stay in the
    #: heap for the next one.
    gather_block_bytes: int = 16 << 20
    #: Fewest ids in a piece of a row when a small batch's rows are cut for the threads (:func:`_row_parts`).
    min_ids_per_part: int = 256
    #: Share of a small batch's candidate slots that are padding from which only the real members are scored
    #: (:func:`_candidates_sparse`): a vocabulary shard's clusters under tensor parallelism.
    skip_padding_share: float = 1 / 8
    #: Smallest batch of a dtype without the sparse op scored over the union of its rows' ids
    #: (:func:`_logits_union`): at 2 rows greedy steps measured about 1 ms slower over the union, sampled ones
    #: 0.05-0.5 ms faster (bf16 at 128,256 x 2,048, ``python -m bench.experiments.union_rows``); from 3 both faster.
    union_min_rows: int = 3
    #: Smallest batch scored cluster by cluster: below it the rows share few candidates, and the grouped pattern
    #: costs a few passes over the head's rows to build (about 2 ms at 128,256 rows, one thread).
    grouped_min_rows: int = 8


#: The plan a head uses unless it is given another.
DEFAULT_PLAN = CpuPlan()

_SPARSE_OK: dict[torch.dtype, bool] = {}
# Hidden columns the probe of ``mm`` (:func:`_mm_columns_exact`) compares, and its answers per (dtype, width).
_UNION_PROBE_COLUMNS = 8
_COLUMNS_EXACT: dict[tuple[torch.dtype, int], bool] = {}


def stage1_scores(hidden: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """``[B, C]`` centroid scores ``hidden @ centroids.T`` (in the centroids' dtype)."""
    return linear(hidden.to(centroids.dtype), centroids)


def candidate_ids(members: torch.Tensor, probes: torch.Tensor) -> torch.Tensor:
    """``[B, P*cap]`` token ids of the probed clusters."""
    return members[probes].reshape(probes.shape[0], -1)


def _sparse_supported(dtype: torch.dtype) -> bool:
    ok = _SPARSE_OK.get(dtype)
    if ok is None:
        try:
            w = torch.randn(8, 4).to(dtype)
            h = torch.randn(1, 4).to(dtype)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                a = torch.sparse_csr_tensor(
                    torch.tensor([0, 2]),
                    torch.tensor([5, 1]),
                    torch.zeros(2, dtype=dtype),
                    size=(1, 8),
                    check_invariants=False,
                )
                out = torch.sparse.sampled_addmm(a, h, w.t(), beta=0.0).values()
            ref = w[[5, 1]].float() @ h[0].float()
            ok = bool(torch.allclose(out.float(), ref, rtol=2e-2, atol=2e-2))
        except Exception:  # noqa: BLE001 - any failure means: do not use the sparse kernel
            ok = False
        _SPARSE_OK[dtype] = ok
    return ok


def _row_parts(rows: int, ids_per_row: int, plan: CpuPlan) -> int:
    """Pieces each row's ids are cut into so that the sparse kernel, which shares out whole CSR rows among
    the threads, has a row for every thread: a batch of one row would otherwise run on one thread."""
    threads = torch.get_num_threads()
    if rows >= threads:
        return 1
    return max(1, min(threads // rows, ids_per_row // plan.min_ids_per_part))


def _logits_sparse(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, plan: CpuPlan) -> torch.Tensor:
    b, n = ids.shape
    lengths = torch.full((b,), n, dtype=torch.int64, device=ids.device)
    return _sparse_values(hidden, weight, ids.reshape(-1), lengths, n, plan).view(b, n)


def _sparse_values(
    hidden: torch.Tensor, weight: torch.Tensor, cols: torch.Tensor, lengths: torch.Tensor, longest: int, plan: CpuPlan
) -> torch.Tensor:
    """``[sum(lengths)]`` logits of row ``b``'s ``lengths[b]`` ids, which follow each other in ``cols`` row
    after row (``longest``: the largest length)."""
    b = lengths.numel()
    parts = _row_parts(b, longest, plan)
    crow = torch.zeros(b + 1, dtype=torch.int64, device=cols.device)
    torch.cumsum(lengths, 0, out=crow[1:])
    if parts > 1:  # row r's ids in `parts` consecutive CSR rows, each with a copy of hidden[r]: the same dot products
        starts = crow[:-1].view(b, 1) + torch.arange(parts, device=cols.device) * lengths.view(b, 1) // parts
        crow = torch.cat([starts.reshape(-1), crow[-1:]])
        hidden = hidden.repeat_interleave(parts, dim=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pattern = torch.sparse_csr_tensor(
            crow,
            cols,
            torch.zeros(cols.numel(), dtype=weight.dtype, device=cols.device),
            size=(b * parts, weight.shape[0]),
            check_invariants=False,
        )
        out = torch.sparse.sampled_addmm(pattern, hidden, weight.t(), beta=0.0, alpha=1.0)
    return out.values()


def _candidates_sparse(
    hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, cap: int, plan: CpuPlan
) -> torch.Tensor:
    """:func:`_logits_sparse` of the candidates ``ids`` (``[B, P*cap]``, ``cap`` slots per probed cluster),
    scoring a cluster's padding slots only when they are few.

    ``build_members`` pads a cluster to ``cap`` by repeating its first member, so a slot after the first
    that holds the slot-0 token is padding, and its logit is slot 0's.  A vocabulary shard's clusters hold
    from none to all of their members (about half of ``cap`` on average at tensor parallel 2): when more
    than ``plan.skip_padding_share`` of the slots are padding, only the others are scored and the padding
    copies slot 0's value, so the logits are the same, bit for bit, at the cost of the real members alone."""
    b = ids.shape[0]
    slots = ids.view(b, -1, cap)
    kept = slots != slots[..., :1]
    kept[..., 0] = True
    lengths = kept.view(b, -1).sum(1)
    if ids.numel() - int(lengths.sum()) <= plan.skip_padding_share * ids.numel():
        return _logits_sparse(hidden, weight, ids, plan)
    values = _sparse_values(hidden, weight, slots[kept], lengths, int(lengths.max()), plan)
    out = torch.empty(slots.shape, dtype=weight.dtype, device=ids.device).masked_scatter_(kept, values)
    return torch.where(kept, out, out[..., :1]).view(b, -1)


def _logits_gather(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    b, n = ids.shape
    rows = weight.index_select(0, ids.reshape(-1)).view(b, n, -1)
    return torch.bmm(rows, hidden.unsqueeze(2)).squeeze(2)


def _logits_blocked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    plan: CpuPlan = DEFAULT_PLAN,
    block_rows: int | None = None,
) -> torch.Tensor:
    """``[B, N]`` logits ``weight[ids[b, j]] . hidden[b]`` in the weight's dtype, for CPU dtypes
    without ``sampled_addmm``: per row, blocks of at most ``block_rows`` candidate rows
    (default: ``plan.gather_block_bytes`` worth) are gathered and scored by one ``mm``."""
    b, n = ids.shape
    if block_rows is None:
        block_rows = plan.gather_block_bytes // max(1, weight.shape[1] * weight.element_size())
    block_rows = max(1, block_rows)
    out = torch.empty((b, n), dtype=weight.dtype, device=weight.device)
    for row in range(b):
        column = hidden[row : row + 1].t()
        for start in range(0, n, block_rows):
            stop = min(n, start + block_rows)
            # One expression, so each gathered block is freed before the next one is allocated
            # (two live blocks make the allocator give memory back and fault it in again).
            torch.mm(weight.index_select(0, ids[row, start:stop]), column, out=out[row, start:stop].unsqueeze(1))
    return out


def _logits_union(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    plan: CpuPlan = DEFAULT_PLAN,
    block_rows: int | None = None,
) -> torch.Tensor:
    """:func:`_logits_blocked` of a batch, each head row that some row needs gathered once: the union of the
    batch's ids, in ascending order and blocks of at most ``block_rows`` rows (the same byte budget), is
    multiplied by every hidden row in one ``mm``, and each ``(row, id)`` reads its value.  Fewer rows gathered
    when rows share ids (a batch's candidates and best-estimated tokens do), and one product by ``B`` columns
    instead of ``B`` products by one.  The same values bit for bit where :func:`_mm_columns_exact` holds."""
    b = ids.shape[0]
    if block_rows is None:
        block_rows = plan.gather_block_bytes // max(1, weight.shape[1] * weight.element_size())
    block_rows = max(1, block_rows)
    needed = torch.zeros(weight.shape[0], dtype=torch.bool, device=weight.device)
    needed[ids.reshape(-1)] = True
    union = needed.nonzero().squeeze(1)
    position = torch.cumsum(needed, 0).sub_(1)
    products = torch.empty((union.numel(), b), dtype=weight.dtype, device=weight.device)
    columns = hidden.t()
    for start in range(0, union.numel(), block_rows):
        stop = min(union.numel(), start + block_rows)
        torch.mm(weight.index_select(0, union[start:stop]), columns, out=products[start:stop])
    return products.t().gather(1, position[ids])


def _mm_columns_exact(dtype: torch.dtype, hidden_size: int) -> bool:
    """Whether this CPU's ``mm`` of gathered rows by several hidden columns gives each column, bit for bit, the
    product by that column alone (the row-by-row path's), probed once per dtype and hidden size: only then is
    a batch scored over its union (:func:`_logits_union`)."""
    key = (dtype, hidden_size)
    exact = _COLUMNS_EXACT.get(key)
    if exact is None:
        generator = torch.Generator().manual_seed(0)
        rows = torch.randn(67, hidden_size, generator=generator).to(dtype)
        hidden = torch.randn(_UNION_PROBE_COLUMNS, hidden_size, generator=generator).to(dtype)
        together = torch.mm(rows, hidden.t())
        exact = all(
            torch.equal(together[:part, j : j + 1], torch.mm(rows[:part], hidden[j : j + 1].t()))
            for j in range(_UNION_PROBE_COLUMNS)
            for part in (rows.shape[0], 13)
        )
        _COLUMNS_EXACT[key] = exact
    return exact


def _logits_gathered(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, plan: CpuPlan) -> torch.Tensor:
    """``[B, N]`` logits on the CPU path without the sparse op: over the batch's union of ids when it has
    several rows and the values stay those of the row-by-row path, else row by row."""
    if ids.shape[0] >= plan.union_min_rows and _mm_columns_exact(weight.dtype, weight.shape[1]):
        return _logits_union(hidden, weight, ids, plan)
    return _logits_blocked(hidden, weight, ids, plan)


def _logits_grouped(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    members: torch.Tensor,
    probes: torch.Tensor,
    token_cluster: torch.Tensor,
    plan: CpuPlan,
) -> torch.Tensor:
    """``[B, P*cap]`` logits as :func:`_logits_sparse` gives them, computed cluster by cluster.

    The pattern is ``[V', B]``: head row ``v`` holds the batch rows that probe ``v``'s cluster, so
    ``sampled_addmm(pattern, weight, hidden.T)`` reads each probed head row once.  Built without a sort
    over the candidates: the ``(row, probe)`` pairs are ordered by cluster (``B * P`` entries), and
    each head row takes its cluster's list of rows.  A padded slot repeats a member of its own cluster;
    an empty cluster (a vocabulary shard holds none of its members) holds token 0, of another cluster,
    whose logit is scored apart for the rows that probe one.
    """
    b, p = probes.shape
    cap = members.shape[1]
    device = hidden.device
    num_clusters = members.shape[0]
    flat = probes.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by cluster; batch rows ascending within one
    counts = torch.bincount(flat, minlength=num_clusters + 1)  # slot C: head rows in no cluster
    starts = counts.cumsum(0) - counts
    rank = torch.empty_like(flat)
    rank[order] = torch.arange(flat.numel(), device=device) - starts[flat[order]]
    per_row = counts[token_cluster]  # [V'] batch rows that score each head row
    crow = torch.zeros(per_row.numel() + 1, dtype=torch.int64, device=device)
    torch.cumsum(per_row, 0, out=crow[1:])
    nnz = int(crow[-1])
    row_of = torch.repeat_interleave(torch.arange(per_row.numel(), device=device), per_row, output_size=nnz)
    within = torch.arange(nnz, device=device) - crow[row_of]
    cols = (order // p)[starts[token_cluster[row_of]] + within]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pattern = torch.sparse_csr_tensor(
            crow,
            cols,
            torch.zeros(nnz, dtype=weight.dtype, device=device),
            size=(weight.shape[0], b),
            check_invariants=False,
        )
        values = torch.sparse.sampled_addmm(pattern, weight, hidden.t(), beta=0.0, alpha=1.0).values()
    slots = members[probes]
    index = crow[slots] + rank.view(b, p, 1)  # [B, P, cap]: each candidate's place in ``values``
    empty = token_cluster[slots[..., 0]] != probes  # [B, P]: the probe is an empty cluster
    if not bool(empty.any()):
        return values[index.reshape(b, p * cap)]
    # Their slots take the logit of the row they repeat (token 0's, the same for every empty cluster), from the
    # same kernel as the row-by-row path (bit for bit), put after ``values`` (the index of an empty cluster's
    # slots is meaningless).
    filler = slots[..., 0][empty][:1].view(1, 1).expand(b, 1)
    zero = _logits_sparse(hidden, weight, filler, plan)
    index = torch.where(empty.unsqueeze(-1), nnz + torch.arange(b, device=device).view(b, 1, 1), index)
    return torch.cat([values, zero.view(b)])[index.reshape(b, p * cap)]


def candidate_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    members: torch.Tensor,
    probes: torch.Tensor,
    *,
    token_cluster: torch.Tensor | None = None,
    extra_ids: torch.Tensor | None = None,
    plan: CpuPlan = DEFAULT_PLAN,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact logits of every candidate: ``(token_ids [B, P*cap], logits [B, P*cap])``.

    ``token_cluster`` (``[V']``, each head row's cluster, ``C`` for none) lets a CPU batch be scored
    cluster by cluster (:func:`_logits_grouped`), with the same values bit for bit.  ``extra_ids``
    (``[B, N]``, any token ids) are scored with the candidates and appended after them (``[B, P*cap + N]``):
    in one pass over the head, so a head row that is one row's candidate and another's extra is read once."""
    hidden = hidden.to(weight.dtype)
    ids = candidate_ids(members, probes)
    if extra_ids is not None:
        ids = torch.cat([ids, extra_ids.to(ids.dtype)], dim=1)
        return ids, token_logits(hidden, weight, ids, plan=plan)
    if hidden.device.type != "cpu":
        return ids, _logits_gather(hidden, weight, ids)
    # The CSR pattern allows at most ``V'`` entries per row (only hit when padding duplicates
    # push ``P*cap`` above the head's row count); gather in blocks then.
    if ids.shape[1] <= weight.shape[0] and _sparse_supported(weight.dtype):
        if token_cluster is not None and ids.shape[0] >= plan.grouped_min_rows:
            return ids, _logits_grouped(hidden.contiguous(), weight, members, probes, token_cluster, plan)
        return ids, _candidates_sparse(hidden.contiguous(), weight, ids, members.shape[1], plan)
    return ids, _logits_gathered(hidden, weight, ids, plan)


def _tokens_grouped(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """:func:`_logits_sparse` of any token ids, with the pattern transposed to ``[V', B]`` (each head row read
    once for the batch; the same values bit for bit).  The ``(row, token)`` pairs are sorted by token."""
    b, n = ids.shape
    device = hidden.device
    # int32 keys when they fit: the sort is the pattern's largest cost, and about twice as fast on them.
    key_dtype = torch.int32 if weight.shape[0] * b < 2**31 else torch.int64
    keys = ids.to(key_dtype) * b + torch.arange(b, dtype=key_dtype, device=device).view(b, 1)
    keys, order = torch.sort(keys.reshape(-1))
    rows = keys // b
    crow = torch.zeros(weight.shape[0] + 1, dtype=torch.int64, device=device)
    torch.cumsum(torch.bincount(rows, minlength=weight.shape[0]), 0, out=crow[1:])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pattern = torch.sparse_csr_tensor(
            crow,
            (keys - rows * b).long(),
            torch.zeros(keys.numel(), dtype=weight.dtype, device=device),
            size=(weight.shape[0], b),
            check_invariants=False,
        )
        values = torch.sparse.sampled_addmm(pattern, weight, hidden.t(), beta=0.0, alpha=1.0).values()
    out = torch.empty(b * n, dtype=weight.dtype, device=device)
    out[order] = values
    return out.view(b, n)


def token_logits(
    hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, *, plan: CpuPlan = DEFAULT_PLAN
) -> torch.Tensor:
    """``[B, N]`` exact logits ``weight[ids[b, j]] . hidden[b]`` of any token ids (not a cluster's)."""
    hidden = hidden.to(weight.dtype)
    if hidden.device.type != "cpu":
        return _logits_gather(hidden, weight, ids)
    if ids.shape[1] <= weight.shape[0] and _sparse_supported(weight.dtype):
        if ids.shape[0] >= plan.grouped_min_rows:
            return _tokens_grouped(hidden.contiguous(), weight, ids)
        return _logits_sparse(hidden.contiguous(), weight, ids, plan)
    return _logits_gathered(hidden, weight, ids, plan)
