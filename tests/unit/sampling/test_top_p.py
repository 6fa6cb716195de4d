"""The sort-free top-k/top-p mask against vLLM's `apply_top_k_top_p_pytorch`, row by row.

vLLM may be imported here (the module under test may not: see the last test). A disagreement
between the two masks is accepted only where it is allowed, and is otherwise a failure:

* rounding: the token's exact prefix mass (float64) lies within `TOL[dtype]` of p, where vLLM's
  float32 (or bfloat16) arithmetic can round the other way;
* order among equal values: the token is tied with others, and some order of the tie puts its
  prefix mass on either side of p. The number kept must still agree.

Rows with p = 1 must agree exactly.
"""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
import torch

from my_pkg.sampling.top_p import DEFAULT_WINDOW, apply_top_k_top_p, sorted_top_k_top_p

NEG_INF = float("-inf")
PS = (0.01, 0.5, 0.9, 0.999, 1.0)
#: Largest prefix-mass error of vLLM's own evaluation, by logits dtype.
TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2}


def vllm_mask(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor) -> torch.Tensor:
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    return apply_top_k_top_p_pytorch(logits.clone(), k, p, allow_cpu_sync=True)


def fast_mask(logits, k, p, window=DEFAULT_WINDOW, sort_fallback=None):
    """Ours on a copy, with vLLM's function for the rows the window cannot decide."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    def vllm_sort(rows, k_rows, p_rows):
        return apply_top_k_top_p_pytorch(rows, k_rows, p_rows, allow_cpu_sync=True)

    copy = logits.clone()
    out, sorted_rows = apply_top_k_top_p(copy, k, p, window=window, sort_fallback=sort_fallback or vllm_sort)
    assert out is copy  # in place, as vLLM's
    return out, sorted_rows


def masked_top_k(row: torch.Tensor, k: int | None) -> torch.Tensor:
    """One row after top-k: values below the k-th largest are -inf."""
    if k is None or k >= row.numel():
        return row
    return row.masked_fill(row < row.topk(k).values[-1], NEG_INF)


def prefix_mass_bounds(logits: torch.Tensor, k: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, the least and the greatest exact mass before it in descending order (over every
    order of equal values), after top-k, in float64."""
    x = logits.double()
    lo, hi = torch.empty_like(x), torch.empty_like(x)
    for r in range(x.shape[0]):
        row = masked_top_k(x[r], None if k is None else int(k[r]))
        q = torch.softmax(row, 0)
        _, inverse = torch.unique(row, sorted=True, return_inverse=True)
        group = torch.zeros(int(inverse.max()) + 1, dtype=torch.float64).index_add_(0, inverse, q)
        greater = group.flip(0).cumsum(0).flip(0) - group
        lo[r] = greater[inverse]
        hi[r] = lo[r] + group[inverse] - q
    return lo, hi


def assert_same_mask(logits, k, p, ours, theirs):
    """`ours` drops what `theirs` drops, but for the disagreements the module docstring allows."""
    tol = TOL[logits.dtype]
    dropped_o, dropped_t = ours == NEG_INF, theirs == NEG_INF
    # Kept values are the input's, bit for bit.
    finite = ~dropped_o
    assert torch.equal(ours[finite], logits[finite])
    lo, hi = prefix_mass_bounds(logits, k)
    p64 = p.double().unsqueeze(1)
    for r in range(logits.shape[0]):
        differ = dropped_o[r] != dropped_t[r]
        if float(p[r]) >= 1.0:
            assert not differ.any(), f"row {r} (p = 1): {int(differ.sum())} tokens differ"
            continue
        could_keep = lo[r] < p64[r] + tol
        could_drop = hi[r] >= p64[r] - tol
        bad = differ & ~(could_keep & could_drop)
        assert not bad.any(), f"row {r}: tokens {bad.nonzero().flatten()[:8].tolist()} differ outside the boundary"
        # Whatever the order of equal values, the prefix masses are the same sorted list.
        q = torch.softmax(masked_top_k(logits[r].double(), None if k is None else int(k[r])), 0)
        ordered = q.sort(descending=True).values
        prefixes = ordered.cumsum(0) - ordered
        if not ((prefixes - p64[r]).abs() <= tol).any():
            assert int(dropped_o[r].sum()) == int(dropped_t[r].sum()), f"row {r}: kept counts differ"


def make_logits(kind: str, batch: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "peaked":  # a trained LM's shape: a few large values over a Gaussian floor, T = 0.7
        x = torch.randn(batch, vocab, generator=g) * 2.0
        boosted = torch.randint(0, vocab, (batch, min(vocab, 20)), generator=g)
        x.scatter_add_(1, boosted, torch.rand(boosted.shape, generator=g) * 12.0)
        x /= 0.7
    elif kind == "flat":  # nuclei of most of the vocabulary: past any small window
        x = torch.randn(batch, vocab, generator=g) * 0.5
    elif kind == "ties":  # few distinct values: every boundary falls inside a group of equal values
        x = torch.randint(0, 12, (batch, vocab), generator=g).float() / 4.0
    else:
        raise ValueError(kind)
    return x.to(dtype)


def make_k(mode: str | None, batch: int, vocab: int) -> torch.Tensor | None:
    if mode is None:
        return None
    cycle = {"1": [1], "5": [5], "V": [vocab], "mixed": [1, 5, vocab, 3, vocab]}[mode]
    return torch.tensor([min(cycle[i % len(cycle)], vocab) for i in range(batch)], dtype=torch.int32)


CASES = [
    (kind, vocab, k_mode, dtype, window)
    for kind, vocab, k_mode, dtype in itertools.product(
        ("peaked", "flat", "ties"),
        (1, 7, 1000, 1025, 4097, 32769),
        (None, "1", "5", "V", "mixed"),
        (torch.float32, torch.bfloat16),
    )
    for window in ((DEFAULT_WINDOW, 16) if vocab in (1025, 4097) else (DEFAULT_WINDOW,))
]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "vocab", "k_mode", "dtype", "window"), CASES)
def test_mask_matches_vllm(kind, vocab, k_mode, dtype, window):
    # One row per p, twice: mixed batches with p = 1 rows, as vLLM sends them.
    p = torch.tensor(PS * 2, dtype=torch.float32)
    batch = p.numel()
    logits = make_logits(kind, batch, vocab, dtype, seed=vocab * 7 + len(CASES))
    k = make_k(k_mode, batch, vocab)
    ours, _ = fast_mask(logits, k, p, window=window)
    assert_same_mask(logits, k, p, ours, vllm_mask(logits, k, p))


def test_peaked_rows_never_need_the_sort_and_flat_rows_do():
    p = torch.full((8,), 0.9)
    peaked = make_logits("peaked", 8, 32769, torch.float32, seed=1)
    _, sorted_rows = fast_mask(peaked, None, p)
    assert sorted_rows == 0
    flat = make_logits("flat", 8, 32769, torch.float32, seed=2)
    ours, sorted_rows = fast_mask(flat, None, p)
    assert sorted_rows == 8
    assert torch.equal(ours, vllm_mask(flat, None, p))  # those rows are vLLM's own result


def test_only_the_rows_the_window_cannot_decide_are_sorted():
    vocab = 4097
    logits = make_logits("peaked", 6, vocab, torch.float32, seed=3)
    logits[2] = make_logits("flat", 1, vocab, torch.float32, seed=4)[0]  # nucleus past the window
    logits[4, 0] = float("nan")
    k = torch.tensor([vocab, vocab, vocab, 2000, vocab, 5], dtype=torch.int32)  # row 3: W < k < V
    p = torch.tensor([0.9, 1.0, 0.9, 0.9, 0.9, 0.5])
    seen = []

    def spy(rows, k_rows, p_rows):
        seen.append((rows.clone(), k_rows.clone(), p_rows.clone()))
        return sorted_top_k_top_p(rows, k_rows, p_rows)

    ours, sorted_rows = fast_mask(logits, k, p, sort_fallback=spy)
    assert sorted_rows == 3 and len(seen) == 1
    rows, k_rows, p_rows = seen[0]
    assert torch.equal(rows.nan_to_num(0.0), logits[[2, 3, 4]].nan_to_num(0.0))  # before any write
    assert k_rows.tolist() == [vocab, 2000, vocab] and p_rows.tolist() == pytest.approx([0.9, 0.9, 0.9])
    clean = [0, 1, 5]
    assert_same_mask(logits[clean], k[clean], p[clean], ours[clean], vllm_mask(logits[clean], k[clean], p[clean]))


@pytest.mark.parametrize("k", [None, 5])
def test_p_one_drops_the_tokens_whose_probability_underflows_as_vllm_does(k):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 5000, generator=g) * 40.0  # a range of hundreds of nats
    logits[1] = torch.randn(5000, generator=g)  # a narrow row in the same batch
    p = torch.tensor([1.0, 1.0, 0.9, 1.0])
    k_rows = None if k is None else torch.full((4,), k, dtype=torch.int32)
    if k is not None:  # five survivors of top-k, spread over 200 nats
        logits[3] = -300.0
        logits[3, :5] = torch.tensor([0.0, -50.0, -120.0, -150.0, -200.0])
    theirs = vllm_mask(logits, k_rows, p)
    ours, _ = fast_mask(logits, k_rows, p)
    assert torch.equal(ours, theirs)
    if k is None:
        assert (theirs[0] == NEG_INF).sum() > 1000  # the case is exercised: vLLM drops underflowing tokens
        assert not (theirs[1] == NEG_INF).any()
    else:
        assert int((theirs[3] > NEG_INF).sum()) < 5  # some of the survivors underflow


def test_rows_with_infinite_or_nan_logits_are_vllms():
    g = torch.Generator().manual_seed(6)
    vocab = 3000
    logits = torch.randn(6, vocab, generator=g) * 2
    grammar = torch.rand(6, vocab, generator=g) < 0.99
    logits[0][grammar[0]] = NEG_INF  # a structured-output row: 1 % of tokens allowed
    logits[1] = NEG_INF  # nothing allowed
    logits[2, 7] = float("inf")
    logits[3, 11] = float("nan")
    logits[4, :5] = torch.randn(5, generator=g)  # five allowed tokens
    logits[4, 5:] = NEG_INF
    p = torch.full((6,), 0.8)
    k = torch.tensor([vocab, 50, vocab, vocab, 3, vocab], dtype=torch.int32)
    ours, _ = fast_mask(logits, k, p)
    theirs = vllm_mask(logits, k, p)
    assert torch.equal(ours.isnan(), theirs.isnan())
    assert torch.equal(ours.nan_to_num(0.0), theirs.nan_to_num(0.0))
    assert (ours[0] > NEG_INF).sum() >= 1 and (ours[4] > NEG_INF).sum() >= 1


def test_a_boundary_inside_equal_values_keeps_vllms_count_and_the_lowest_ids():
    logits = torch.full((3, 128256), NEG_INF)
    logits[:, :1000] = 1.0
    logits[:, 1000:2000] = 0.0
    p = torch.full((3,), 0.5)
    ours, sorted_rows = fast_mask(logits, None, p, window=4096)
    theirs = vllm_mask(logits, None, p)
    assert sorted_rows == 0
    kept = (ours[0] > NEG_INF).nonzero().flatten()
    assert kept.numel() == int((theirs[0] > NEG_INF).sum())
    assert kept.tolist() == list(range(kept.numel()))  # the lowest ids of the tie
    assert torch.equal(ours, sorted_top_k_top_p(logits.clone(), None, p))


def test_ties_match_the_sorted_reference_exactly():
    """The lowest-ids rule, row by row, where the window decides the rows."""
    logits = make_logits("ties", 10, 4097, torch.float32, seed=7)
    p = torch.tensor((0.013, 0.37, 0.61, 0.93, 1.0) * 2)  # no exact fraction of a tie's size
    k = make_k("mixed", 10, 4097)
    ours, _ = fast_mask(logits, k, p, window=4097)
    assert torch.equal(ours, sorted_top_k_top_p(logits.clone(), k, p))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sorted_reference_matches_vllm(dtype):
    logits = make_logits("peaked", 10, 4097, dtype, seed=8)
    p = torch.tensor(PS * 2)
    k = make_k("mixed", 10, 4097)
    assert_same_mask(logits, k, p, sorted_top_k_top_p(logits.clone(), k, p), vllm_mask(logits, k, p))


def test_a_failure_leaves_the_logits_as_they_were():
    logits = make_logits("flat", 4, 4097, torch.float32, seed=9)
    before = logits.clone()

    def broken(rows, k_rows, p_rows):
        raise RuntimeError("sort unavailable")

    with pytest.raises(RuntimeError, match="sort unavailable"):
        apply_top_k_top_p(logits, None, torch.full((4,), 0.9), sort_fallback=broken)
    assert torch.equal(logits, before)


def test_empty_batch_and_bad_shapes():
    empty = torch.empty(0, 10)
    assert apply_top_k_top_p(empty, None, torch.empty(0)) == (empty, 0)
    with pytest.raises(ValueError, match="batch, vocab"):
        apply_top_k_top_p(torch.zeros(10), None, torch.ones(1))


def test_the_module_never_imports_vllm():
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import torch\n"
        "from my_pkg.sampling import apply_top_k_top_p\n"
        "x = torch.randn(2, 5000) * 3\n"
        "out, sorted_rows = apply_top_k_top_p(x, torch.tensor([5, 5000]), torch.tensor([0.9, 0.5]))\n"
        "assert out is x and (x[0] > float('-inf')).sum() <= 5\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_one_p_and_one_k_for_the_whole_batch_as_vllm_accepts():
    logits = make_logits("peaked", 6, 4097, torch.float32, seed=10)
    p, k = torch.tensor([0.9]), torch.tensor([40], dtype=torch.int32)
    ours, sorted_rows = fast_mask(logits, k, p, sort_fallback=lambda *args: pytest.fail("no row needs a sort"))
    assert sorted_rows == 0
    assert_same_mask(logits, k.expand(6), p.expand(6), ours, vllm_mask(logits, k, p))
