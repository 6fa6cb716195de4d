"""Exact top-k / top-p masking without sorting the vocabulary.

The law is the one of vLLM's CPU sampler (`apply_top_k_top_p_pytorch`). For one row `x` of `V`
logits, a top-k `k` (`k >= V`: off) and a top-p `p` in (0, 1]:

1. Top-k. `t` is the k-th largest value; every token with `x_v < t` is dropped. Values equal to `t`
   are kept, so more than `k` tokens may survive. Call the survivors `K`.
2. Renormalise over `K`: `q_v = exp(x_v - Z)`, with `Z = log sum_{u in K} exp(x_u)`.
3. Top-p. Take the tokens in descending order of value. A token is kept iff the mass strictly
   before it is below `p`:

       keep(v)  <=>  sum_{u before v} q_u < p

   The largest token is always kept. vLLM states this as "drop where the ascending cumulative sum
   is <= 1 - p", which is the same condition.
4. `p = 1` keeps each token of `K` whose probability is not zero *as vLLM evaluates it*: a softmax
   in the logits' dtype. Tokens about 100 nats or more below the maximum (float32) underflow to 0
   and are dropped. They could never be drawn, but they are -inf in the result, as in
   vLLM.

Every dropped token is set to -inf in place. A kept token keeps its value bit for bit.

Algorithm (no sort of `V`):

* Take the `W = min(window, V)` largest logits of each row in descending order (`torch.topk`).
  Compute one normaliser over the whole row, `m + log sum_v exp(x_v - m)`, with `m` the row's
  maximum: the window's terms in float64, the others summed in float32, so that the float32
  rounding is relative to the mass outside the window. A top-k row's normaliser comes from its
  survivors, which all lie in the window.
* The mass before each window token is an exclusive cumulative sum of `q` over the window, in
  float64. The smallest kept value `c` is the cutoff; every token below `c` is dropped, inside the
  window or not.
* A row goes to a full sort (`sort_fallback`; the plugin passes vLLM's own function) when the
  window cannot decide it:
  - the cutoff (or the top-k value) equals the window's last value, so equal or later tokens may
    lie outside the window (this is also the case when the nucleus runs past the window);
  - top-k is on with `W < k < V`;
  - the row's maximum or its normaliser is not finite (NaN, +inf, or an all -inf row).

Where it can differ from vLLM. The law is the same; these are the only cases where a comparison of
-inf positions can disagree:

* Rounding at the boundary. vLLM evaluates the prefix mass in the logits' dtype (float32 in its
  sampler, which casts to float32 first); this module mostly in float64 (above). The last
  token of the nucleus can differ only when its prefix mass is within about 1e-6 of `p` for
  float32 logits. For bfloat16 logits passed as such it is within the resolution of vLLM's
  bfloat16 cumulative sum (about 2e-3 at `1 - p = 0.5`).
* Equal logits split by the cutoff. Both keep the same number of them, so the kept mass and the
  law over values are the same. vLLM keeps the ones its sort puts first (the CPU sort is not
  stable); this module keeps the lowest token ids.
* `p = 1`, when a token's probability is within rounding of the smallest subnormal: the two
  softmax sums run in different orders.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["DEFAULT_WINDOW", "SortFallback", "apply_top_k_top_p", "sorted_top_k_top_p"]

#: Logits taken per row by `torch.topk`; a nucleus of fewer tokens never needs a sort.
DEFAULT_WINDOW = 1024
#: A probability can underflow to zero only this many nats or more below the row's maximum
#: (exp(-70) / 2**24 is still a normal float32). Only rows with a finite logit this low, and p = 1,
#: pay for the V-wide softmax that finds the zeros.
_UNDERFLOW_NATS = 70.0

#: `(logits rows, k rows or None, p rows) -> those rows masked`; it may write its first argument.
SortFallback = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor], torch.Tensor]


def apply_top_k_top_p(
    logits: torch.Tensor,
    k: torch.Tensor | None,
    p: torch.Tensor,
    *,
    window: int = DEFAULT_WINDOW,
    sort_fallback: SortFallback | None = None,
) -> tuple[torch.Tensor, int]:
    """Mask `logits` ([B, V]) in place with top-k `k` ([B], [1] or None) and top-p `p` ([B] or [1]).

    Returns `(logits, rows)`: the same tensor, and how many rows went to `sort_fallback`
    (`sorted_top_k_top_p` when None). `logits` is written only after every decision is made, so
    an exception leaves it as it was. No Python loop runs over rows. Two reads of a few flags per
    call (one from `k` and `p`, one after the decisions) choose which optional steps run.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got {tuple(logits.shape)}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    batch, vocab = logits.shape
    if batch == 0 or vocab == 0:
        return logits, 0
    fallback_fn = sorted_top_k_top_p if sort_fallback is None else sort_fallback
    x = logits
    width = min(window, vocab)
    neg_inf = float("-inf")

    vals, idx = x.topk(width, dim=1)  # descending (NaN first)
    top = vals[:, 0]
    last = vals[:, width - 1]
    p = torch.broadcast_to(p.reshape(-1), (batch,))  # one value for the batch is accepted, as by vLLM
    p64 = p.to(device=x.device, dtype=torch.float64)
    p_all = p64 >= 1.0

    if k is None:
        top_k_on = torch.zeros(batch, dtype=torch.bool, device=x.device)
        survive = torch.ones_like(vals, dtype=torch.bool)
        k_undecided = top_k_on
    else:
        k = torch.broadcast_to(k.reshape(-1), (batch,))
        k_long = k.to(device=x.device, dtype=torch.long)
        top_k_on = k_long < vocab
        kth = vals.gather(1, (k_long.clamp(1, width) - 1).unsqueeze(1)).squeeze(1)
        t_k = torch.where(top_k_on, kth, torch.full_like(kth, neg_inf))
        survive = vals >= t_k.unsqueeze(1)
        # The top-k set is not all in the window: k beyond it, or values equal to t beyond it.
        k_undecided = top_k_on & ((k_long > width) | ((t_k == last) & (width < vocab)))
    keep_all = p_all & ~top_k_on  # no filter at all, but for underflowing probabilities
    all_top_k, any_keep_all = torch.stack([top_k_on.all(), keep_all.any()]).tolist()

    # The normaliser: over the whole row, or over the top-k survivors (all in the window).
    v64 = vals.to(torch.float64)
    log_z = torch.logsumexp(v64.masked_fill(~survive, neg_inf), dim=1)
    zero_rows = torch.zeros(batch, dtype=torch.bool, device=x.device)
    if not all_top_k:
        work = x if x.dtype in (torch.float32, torch.float64) else x.float()
        shifted = work - top.to(work.dtype).unsqueeze(1)
        if any_keep_all:
            low = (shifted < -_UNDERFLOW_NATS) & (shifted > neg_inf)
            zero_rows = keep_all & low.any(dim=1)
        # The window's terms in float64, the rest in float32: the float32 rounding is relative to the tail.
        tail = shifted.exp_().scatter_(1, idx, 0.0).sum(dim=1).to(torch.float64)
        top64 = v64[:, 0]
        head = torch.exp(v64 - top64.unsqueeze(1)).sum(dim=1)
        log_z = torch.where(top_k_on, log_z, top64 + (head + tail).log())
    # p = 1 with top-k: the survivors are in the window.
    low_in_window = survive & (v64 - v64[:, :1] < -_UNDERFLOW_NATS) & (v64 > neg_inf)
    zero_rows |= p_all & top_k_on & low_in_window.any(dim=1)

    q = torch.exp(v64 - log_z.unsqueeze(1)).masked_fill_(~survive, 0.0)
    before = q.cumsum(dim=1).sub_(q)
    keep = (before < p64.unsqueeze(1)) & survive
    keep[:, 0] = True
    keep = torch.where(p_all.unsqueeze(1), survive, keep)
    kept = keep.sum(dim=1)
    cut = vals.gather(1, (kept - 1).unsqueeze(1)).squeeze(1)

    fallback = (
        k_undecided | ((cut == last) & (width < vocab) & ~keep_all) | ~torch.isfinite(top) | ~torch.isfinite(log_z)
    )
    cut = torch.where(keep_all | fallback, torch.full_like(cut, neg_inf), cut)
    tied = vals == cut.unsqueeze(1)
    above = (vals > cut.unsqueeze(1)).sum(dim=1)
    # The cutoff splits a group of equal values: keep `kept - above` of them, the lowest ids.
    split = (tied.sum(dim=1) > kept - above) & ~fallback & ~keep_all
    zero_rows &= ~fallback
    # Rows whose every kept token lies in the window: written as -inf, then their kept values.
    masked = ~keep_all & ~fallback
    flags = torch.stack([fallback.any(), split.any(), zero_rows.any(), masked.any(), masked.all()]).tolist()
    any_fallback, any_split, any_zero, any_masked, all_masked = flags

    fixed = rows = None
    if any_fallback:
        rows = fallback.nonzero().squeeze(1)
        fixed = fallback_fn(x[rows], None if k is None else k[rows], p[rows])
    keep_w = vals >= cut.unsqueeze(1)  # every window value of the rows not masked here
    if any_split:
        group = tied & split.unsqueeze(1)
        ids = torch.where(group, idx, torch.full_like(idx, vocab)).sort(dim=1).values
        last_id = ids.gather(1, (kept - above - 1).clamp(min=0).unsqueeze(1))
        keep_w &= ~(group & (idx > last_id))
    if any_masked:
        masked_rows = masked.nonzero().squeeze(1)
        source = vals.masked_fill(~keep_w, neg_inf)

    # Writes: every decision above is made.
    if any_masked:
        if all_masked:
            x.fill_(neg_inf)  # several times faster than index_fill_ over every row
        else:
            x.index_fill_(0, masked_rows, neg_inf)
        x.scatter_(1, idx, source)  # unmasked rows get their own values back
    if any_zero:
        under = zero_rows.nonzero().squeeze(1)
        part = x[under]
        x[under] = part.masked_fill_(part.softmax(dim=1) == 0, neg_inf)
    if rows is not None:
        x[rows] = fixed
    return x, 0 if rows is None else int(rows.numel())


def sorted_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor) -> torch.Tensor:
    """The same law by a full sort of each row: the reference, and the default fallback.

    Equal values split by the cutoff: the lowest token ids are kept (a stable sort). Rows holding
    NaN are not meaningful here. Writes `logits` in place and returns it.
    """
    batch, vocab = logits.shape
    neg_inf = float("-inf")
    vals, idx = logits.sort(dim=1, descending=True, stable=True)
    if k is None:
        survive = torch.ones_like(vals, dtype=torch.bool)
    else:
        k_long = torch.broadcast_to(k.reshape(-1), (batch,)).to(device=logits.device, dtype=torch.long).clamp(1, vocab)
        survive = vals >= vals.gather(1, (k_long - 1).unsqueeze(1))
    q = torch.softmax(vals.to(torch.float64).masked_fill(~survive, neg_inf), dim=1)
    before = q.cumsum(dim=1).sub_(q)
    p64 = torch.broadcast_to(p.reshape(-1), (batch,)).to(device=logits.device, dtype=torch.float64)
    keep = (before < p64.unsqueeze(1)) & survive
    keep[:, 0] = True
    nonzero = torch.softmax(vals.masked_fill(~survive, neg_inf), dim=1) != 0
    keep = torch.where((p64 >= 1.0).unsqueeze(1), survive & nonzero, keep)
    return logits.scatter_(1, idx, vals.masked_fill(~keep, neg_inf))
