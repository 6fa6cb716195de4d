"""A batch is scored cluster by cluster on CPU, with the logits of the row-by-row path bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from my_pkg.flashhead import FlashHead
from my_pkg.flashhead.kernels import torch_ref
from tests.support.heads import random_head

VOCAB, HIDDEN, PAD = 333, 37, 5  # 21 clusters, the last ones one member short (padded), 5 padding rows


def _head(dtype: torch.dtype = torch.float32, n_probes: int = 4, **kw) -> FlashHead:
    return random_head(VOCAB, HIDDEN, pad=PAD, n_probes=n_probes, dtype=dtype, assignment_seed=1, **kw)[0]


def _hidden(rows: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _planned(head: FlashHead, plan: torch_ref.CpuPlan, fn):
    """``fn()`` with ``head`` on ``plan``, then back on its own."""
    own = head.cpu_plan
    head.cpu_plan = plan
    try:
        return fn()
    finally:
        head.cpu_plan = own


#: The grouped path switched off: every batch scored row by row.
ROW_BY_ROW = torch_ref.CpuPlan(grouped_min_rows=1 << 30)
#: No union: every batch of a dtype without the sparse op scored row by row.
ROWS_ALONE = torch_ref.CpuPlan(union_min_rows=1 << 30)


@pytest.mark.parametrize("rows", [2, 3, 8, 64])
@pytest.mark.parametrize("n_probes", [1, 4, 21])
def test_grouped_candidate_logits_equal_the_row_by_row_ones_bit_for_bit(monkeypatch, rows, n_probes):
    head = _head(n_probes=n_probes)
    hidden = _hidden(rows, seed=rows)
    probes = head.select_probes(hidden)
    grouped_ids, grouped = head.candidate_logits(hidden, probes)
    ids, per_row = _planned(head, ROW_BY_ROW, lambda: head.candidate_logits(hidden, probes))
    assert torch.equal(grouped_ids, ids)
    assert torch.equal(grouped, per_row)  # bit for bit, not within a tolerance
    reference = torch.stack([head.weight[ids[r]].double() @ hidden[r].double() for r in range(rows)])
    torch.testing.assert_close(grouped.double(), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sampled", ["greedy", "sampled", "mixed"])
def test_step_logits_of_a_batch_equal_the_row_by_row_path_bit_for_bit(monkeypatch, sampled):
    head = _head()
    hidden = _hidden(16, seed=3)
    mask = {"greedy": np.zeros(16, bool), "sampled": np.ones(16, bool), "mixed": np.arange(16) % 3 == 0}[sampled]
    pinned = torch.tensor([0, 7, VOCAB - 1])
    got = head.step_logits(hidden, sampled=mask, pinned=pinned)
    want = _planned(head, ROW_BY_ROW, lambda: head.step_logits(hidden, sampled=mask, pinned=pinned))
    assert torch.equal(got, want)
    # Each row as it would be served alone: the same candidates, the same exact logits on them.
    for row in range(16):
        alone = head.step_logits(hidden[row : row + 1], sampled=mask[row : row + 1], pinned=pinned)[0]
        finite = torch.isfinite(alone)
        assert torch.equal(finite, torch.isfinite(got[row]))
        torch.testing.assert_close(got[row][finite], alone[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cluster_rows", [True, False])
def test_grouped_path_breaks_when_the_index_map_is_wrong(monkeypatch, cluster_rows):
    # The comparison above can fail: a wrong cluster map gives other values.
    head = _head(cluster_rows=cluster_rows)
    hidden = _hidden(8)
    probes = head.select_probes(hidden)
    _, good = head.candidate_logits(hidden, probes)
    if cluster_rows:
        head.cluster_rows.token_cluster = torch.roll(head.cluster_rows.token_cluster, 1)
    else:
        head.candidate_rows.token_cluster = torch.roll(head.candidate_rows.token_cluster, 1)
    _, bad = head.candidate_logits(hidden, probes)
    assert not torch.equal(good, bad)


@pytest.mark.parametrize("cluster_rows", [True, False])
@pytest.mark.parametrize("rows", [8, 16])
def test_a_head_with_empty_clusters_scores_a_batch_cluster_by_cluster_with_the_same_logits(
    monkeypatch, rows, cluster_rows
):
    """A vocabulary shard holds none of some clusters' members (their slots hold token 0, of another cluster):
    the rows that probe one get token 0's logit there, as row by row."""
    weight = torch.randn(40, 8, generator=torch.Generator().manual_seed(3))
    assignments = torch.arange(32) % 3  # clusters 3 and 4 have no member
    head = FlashHead(
        weight, torch.randn(5, 8), assignments, n_probes=2, allow_empty_clusters=True, cluster_rows=cluster_rows
    )
    hidden = torch.randn(rows, 8, generator=torch.Generator().manual_seed(rows))
    probes = torch.stack([torch.randperm(5, generator=torch.Generator().manual_seed(r))[:2] for r in range(rows)])
    assert bool((probes >= 3).any()) and bool((probes == 0).any())  # empty clusters probed, and token 0's own
    calls = []
    grouped = torch_ref._logits_grouped
    monkeypatch.setattr(torch_ref, "_logits_grouped", lambda *a: calls.append(1) or grouped(*a))
    ids, logits = head.candidate_logits(hidden, probes)
    assert calls == [1]  # scored cluster by cluster
    _, per_row = _planned(head, ROW_BY_ROW, lambda: head.candidate_logits(hidden, probes))
    assert calls == [1]  # the plan given to the head scored row by row
    assert torch.equal(logits, per_row)
    torch.testing.assert_close(logits, torch.stack([weight[ids[r]] @ hidden[r] for r in range(rows)]))


@pytest.mark.parametrize("rows", [2, 3, 6])
def test_dtypes_without_the_sparse_kernel_score_a_batch_over_the_union_of_its_ids(monkeypatch, rows):
    head = _head(torch.bfloat16, cpu_plan=torch_ref.CpuPlan(union_min_rows=3))
    hidden = _hidden(rows).bfloat16()
    probes = head.select_probes(hidden)
    gathered = []
    real_union = torch_ref._logits_union
    monkeypatch.setattr(torch_ref, "_mm_columns_exact", lambda dtype, hidden_size: True)
    monkeypatch.setattr(torch_ref, "_logits_union", lambda *a: gathered.append(a[2].shape) or real_union(*a))
    ids, logits = head.candidate_logits(hidden, probes)
    union = [ids.shape] if rows >= 3 else []
    assert gathered == union  # one union for the batch, from 3 rows
    want = torch.stack([(head.weight[ids[r]].float() @ hidden[r].float()) for r in range(rows)])
    torch.testing.assert_close(logits.float(), want, rtol=1.6e-2, atol=1e-2)
    monkeypatch.setattr(torch_ref, "_mm_columns_exact", lambda dtype, hidden_size: False)
    head.candidate_logits(hidden, probes)
    assert gathered == union  # a CPU whose product by several columns differs: row by row


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("block_rows", [1, 7, 10_000])
def test_the_union_gives_each_row_its_own_ids_logits(dtype, block_rows):
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(300, 48, generator=g).to(dtype)
    hidden = torch.randn(5, 48, generator=g).to(dtype)
    ids = torch.randint(0, 300, (5, 90), generator=g)
    ids[1] = ids[0]  # two rows with the same ids
    ids[2, :30] = ids[2, 30]  # repeated ids within a row (cluster padding)
    ids[4, :] = 299  # one id only, the head's last row
    out = torch_ref._logits_union(hidden, weight, ids, block_rows=block_rows)
    assert out.shape == (5, 90) and out.dtype == dtype
    exact = torch.einsum("bnh,bh->bn", weight[ids].double(), hidden.double())
    torch.testing.assert_close(out.double(), exact, rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=1e-2)
    if torch_ref._mm_columns_exact(dtype, 48):  # what the serving path asks before taking the union
        assert torch.equal(out, torch_ref._logits_blocked(hidden, weight, ids, block_rows=block_rows))


@pytest.mark.parametrize("sampled", ["greedy", "sampled", "mixed"])
def test_a_bfloat16_batch_over_its_union_equals_each_row_alone_bit_for_bit(monkeypatch, sampled):
    head = _head(torch.bfloat16)
    hidden = _hidden(12, seed=7).bfloat16()
    mask = {"greedy": np.zeros(12, bool), "sampled": np.ones(12, bool), "mixed": np.arange(12) % 3 == 0}[sampled]
    if not torch_ref._mm_columns_exact(torch.bfloat16, HIDDEN):
        # This CPU's product by several columns rounds differently: the batch is scored row by row.
        assert torch.equal(
            head.step_logits(hidden, sampled=mask),
            _planned(head, ROWS_ALONE, lambda: head.step_logits(hidden, sampled=mask)),
        )
        return
    got = head.step_logits(hidden, sampled=mask)
    want = _planned(head, ROWS_ALONE, lambda: head.step_logits(hidden, sampled=mask))
    assert torch.equal(got, want)


def test_the_probe_of_the_cpu_product_is_asked_once_per_dtype_and_width(monkeypatch):
    monkeypatch.setattr(torch_ref, "_COLUMNS_EXACT", {})
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda *a, **k: calls.append(1) or real_mm(*a, **k))
    first = torch_ref._mm_columns_exact(torch.bfloat16, 40)
    probed = len(calls)
    assert probed > 0 and torch_ref._mm_columns_exact(torch.bfloat16, 40) is first and len(calls) == probed
    torch_ref._mm_columns_exact(torch.bfloat16, 41)
    assert len(calls) > probed


def test_a_mixed_batch_in_one_pass_equals_its_greedy_and_sampled_parts():
    head = _head(n_probes=4, sampled_n_probes=4)  # equal probe counts: one pass over the whole batch
    hidden = _hidden(12, seed=5)
    mask = np.arange(12) % 4 == 1
    pinned = torch.tensor([3, VOCAB - 2])
    got = head.step_logits(hidden, sampled=mask, pinned=pinned)
    greedy = head.step_logits(hidden[~mask], pinned=pinned)
    sampled = head.step_logits(hidden[mask], sampled=np.ones(int(mask.sum()), bool), pinned=pinned)
    # (Pinned logits come from a matmul over the batch: rounding may differ with the batch size.)
    assert torch.equal(torch.isfinite(got[~mask]), torch.isfinite(greedy))
    torch.testing.assert_close(got[~mask], greedy, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(got[mask]).all()
    torch.testing.assert_close(got[mask], sampled, rtol=1e-6, atol=1e-6)
    head.sampled_n_probes = 6  # unequal: the batch is split, the parts are the same calls
    split = head.step_logits(hidden, sampled=mask, pinned=pinned)
    assert torch.equal(split[~mask], got[~mask])
    assert int(torch.isfinite(split[mask][:, :VOCAB]).sum()) == int(mask.sum()) * VOCAB


@pytest.mark.parametrize("rows", [8, 33])
def test_grouped_token_logits_equal_the_row_by_row_ones_bit_for_bit(rows):
    weight = torch.randn(VOCAB + PAD, HIDDEN, generator=torch.Generator().manual_seed(2))
    hidden = _hidden(rows, seed=4)
    ids = torch.stack([torch.randperm(VOCAB, generator=torch.Generator().manual_seed(r))[:40] for r in range(rows)])
    grouped = torch_ref.token_logits(hidden, weight, ids)
    assert torch.equal(grouped, torch_ref._logits_sparse(hidden, weight, ids, torch_ref.DEFAULT_PLAN))
    torch.testing.assert_close(grouped, torch.einsum("bnh,bh->bn", weight[ids], hidden), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [3, 16])
def test_sampled_rows_score_candidates_and_rescored_tokens_in_one_pass_with_the_same_logits(rows):
    """An all-sampled batch scores each row's rescored tail tokens in its candidates' pass (``extra_ids``);
    a mixed batch scores them in a pass of their own. The sampled rows' logits are the same bit for bit."""
    head = _head(n_probes=4)
    head.sampled_rescore = 30
    hidden = _hidden(rows, seed=6)
    alone = head.step_logits(hidden, sampled=np.ones(rows, bool))
    with_greedy = head.step_logits(torch.cat([hidden, hidden]), sampled=np.arange(2 * rows) < rows)
    assert torch.equal(alone, with_greedy[:rows])
    probes = head.select_probes(hidden)
    extra = torch.stack([torch.randperm(VOCAB, generator=torch.Generator().manual_seed(r))[:30] for r in range(rows)])
    ids, logits = torch_ref.candidate_logits(
        hidden, head.weight, head.members, probes, token_cluster=head.candidate_rows.token_cluster, extra_ids=extra
    )
    cand_ids, cand = head.candidate_logits(hidden, probes)
    assert torch.equal(ids, torch.cat([cand_ids, extra], dim=1))
    assert torch.equal(logits[:, : cand.shape[1]], cand)
    torch.testing.assert_close(logits[:, cand.shape[1] :], torch.einsum("bnh,bh->bn", head.weight[extra], hidden))


@pytest.mark.parametrize("rows", [1, 3])
def test_a_batch_with_fewer_rows_than_threads_is_cut_for_them_with_the_same_logits(monkeypatch, rows):
    """The sparse kernel shares whole CSR rows among the threads, so a batch of one row would run on one of
    them: each row's ids are cut into consecutive pieces, one per thread, each the same dot products."""
    weight = torch.randn(VOCAB + PAD, HIDDEN, generator=torch.Generator().manual_seed(5))
    hidden = _hidden(rows, seed=7)
    ids = torch.stack([torch.randperm(VOCAB, generator=torch.Generator().manual_seed(r))[:301] for r in range(rows)])
    plan = torch_ref.CpuPlan(min_ids_per_part=30)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert torch_ref._row_parts(rows, ids.shape[1], plan) == 8 // rows
    cut = torch_ref._logits_sparse(hidden, weight, ids, plan)
    head = _head(n_probes=21, cpu_plan=plan)
    step_cut = head.step_logits(hidden, sampled=np.arange(rows) % 2 == 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert torch_ref._row_parts(rows, ids.shape[1], plan) == 1
    assert torch.equal(cut, torch_ref._logits_sparse(hidden, weight, ids, plan))
    assert torch.equal(step_cut, head.step_logits(hidden, sampled=np.arange(rows) % 2 == 1))
    torch.testing.assert_close(cut, torch.einsum("bnh,bh->bn", weight[ids], hidden), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("rows", [1, 3])
def test_a_shards_padded_clusters_score_only_their_members_with_the_same_logits(monkeypatch, rows, threads):
    """A head over one vocabulary shard holds about half of each cluster at TP=2, padded to the largest by
    repeating the first member: a small batch scores each real member once and copies the padding's values."""
    from my_pkg.flashhead.clustering import random_balanced_assignment

    vocab, shard = 1024, 512
    weight = torch.randn(vocab, HIDDEN, generator=torch.Generator().manual_seed(9))
    assignments = random_balanced_assignment(vocab, 16, seed=2)
    clusters = int(assignments.max()) + 1
    head = FlashHead(
        weight[:shard],
        torch.randn(clusters, HIDDEN, generator=torch.Generator().manual_seed(4)),
        assignments[:shard],
        vocab_size=shard,
        n_probes=9,
        allow_empty_clusters=True,
        cpu_plan=torch_ref.CpuPlan(min_ids_per_part=8),
    )
    hidden = _hidden(rows, seed=11)
    probes = head.select_probes(hidden)
    members = torch.bincount(assignments[:shard], minlength=clusters).clamp(min=1)[probes].sum(1)
    assert int(members.sum()) * 8 < 7 * probes.numel() * head.cluster_size  # mostly padding: the compact path
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    scored = []
    values = torch_ref._sparse_values
    monkeypatch.setattr(torch_ref, "_sparse_values", lambda h, w, c, *a: scored.append(c) or values(h, w, c, *a))
    ids, logits = head.candidate_logits(hidden, probes)
    (cols,) = scored
    assert cols.numel() == int(members.sum())  # each real member once, no padding slot
    padded = torch_ref._logits_sparse(hidden, head.weight, ids, head.cpu_plan)
    assert torch.equal(logits, padded)  # bit for bit
    torch.testing.assert_close(logits, torch.einsum("bnh,bh->bn", head.weight[ids], hidden), rtol=1e-5, atol=1e-5)
