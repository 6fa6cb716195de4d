"""A CPU head scores its candidates from a copy of the head's rows in cluster order, with the same logits bit for
bit as from the head itself; the copy is shared, counted, and follows a weight changed in place."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from my_pkg.flashhead import FlashHead
from my_pkg.flashhead import cluster_rows as cluster_rows_module
from my_pkg.flashhead.kernels import torch_ref
from tests.support.heads import random_head

VOCAB, HIDDEN, PAD = 2000, 24, 5  # 125 clusters, some padded; 5 padding rows in no cluster


def _pair(dtype: torch.dtype = torch.float32, **kw) -> tuple[FlashHead, FlashHead]:
    """The same head with the copy and without it."""
    with_copy, _ = random_head(VOCAB, HIDDEN, pad=PAD, n_probes=6, dtype=dtype, assignment_seed=2, **kw)
    without, _ = random_head(
        VOCAB, HIDDEN, pad=PAD, n_probes=6, dtype=dtype, assignment_seed=2, cluster_rows=False, **kw
    )
    assert with_copy.cluster_rows is not None and without.cluster_rows is None
    return with_copy, without


def _hidden(rows: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("kind", ["greedy", "sampled", "mixed"])
def test_the_copy_gives_the_logits_of_the_head_itself_bit_for_bit(rows, kind, dtype):
    copied, direct = _pair(dtype)
    hidden = _hidden(rows, seed=rows, dtype=dtype)
    mask = {"greedy": np.zeros(rows, bool), "sampled": np.ones(rows, bool), "mixed": np.arange(rows) % 3 == 0}[kind]
    pinned = torch.tensor([0, 11, VOCAB - 1])
    got = copied.step_logits(hidden, sampled=mask, pinned=pinned)
    assert torch.equal(got, direct.step_logits(hidden, sampled=mask, pinned=pinned))
    probes = copied.select_probes(hidden)
    ids, logits = copied.candidate_logits(hidden, probes)
    want_ids, want = direct.candidate_logits(hidden, probes)
    assert torch.equal(ids, want_ids) and torch.equal(logits, want)
    reference = torch.stack([direct.weight[ids[r]].double() @ hidden[r].double() for r in range(rows)])
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(logits.double(), reference, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("rows", [1, 8])
def test_a_shards_head_with_empty_clusters_gives_the_same_logits_from_its_copy(rows):
    """A vocabulary shard (tensor parallelism): clusters padded far beyond their members, some empty; batches of 8
    rows take the cluster-by-cluster path, small ones skip the padding."""
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(1000, 16, generator=g)
    assignments = torch.randint(0, 200, (1000,), generator=g)[:300]  # the first shard's 300 tokens
    kw = {"vocab_size": 300, "n_probes": 40, "allow_empty_clusters": True}
    centroids = torch.randn(200, 16, generator=g)
    copied = FlashHead(weight[:300], centroids, assignments, **kw)
    direct = FlashHead(weight[:300], centroids, assignments, cluster_rows=False, **kw)
    hidden = torch.randn(rows, 16, generator=g)
    probes = copied.select_probes(hidden)
    empty = torch.bincount(assignments, minlength=200)[probes] == 0
    assert bool(empty.any()) and not bool(empty.all())  # empty clusters among the probes
    ids, logits = copied.candidate_logits(hidden, probes)
    assert torch.equal(logits, direct.candidate_logits(hidden, probes)[1])
    torch.testing.assert_close(logits, torch.stack([weight[ids[r]] @ hidden[r] for r in range(rows)]))


def test_the_kernels_read_the_copy_with_the_cluster_map_in_its_rows(monkeypatch):
    copied, _ = _pair()
    seen = []
    kernel = torch_ref.candidate_logits
    spy = replace(copied.kernels, candidate_logits=lambda *a, **kw: seen.append((a, kw)) or kernel(*a, **kw))
    monkeypatch.setattr(copied.candidate_rows, "kernels", spy)
    hidden = _hidden(2)
    copied.step_logits(hidden)
    ((args, kw),) = seen
    rows = copied.cluster_rows
    assert args[1] is rows.rows and args[2] is rows.slots and kw["token_cluster"] is rows.token_cluster
    # Each cluster's members are consecutive rows of the copy, in the cluster map's order.
    assert torch.equal(rows.rows[rows.slots[:, 0]], copied.weight[copied.members[:, 0]])
    sizes = torch.bincount(rows.token_cluster)
    real = torch.arange(copied.cluster_size) < sizes.view(-1, 1)
    assert torch.equal(rows.slots[real] - rows.slots[:, :1].expand_as(rows.slots)[real], real.nonzero()[:, 1])
    assert torch.equal(rows.rows, copied.weight[:VOCAB][rows.order])


def test_the_copy_is_counted_and_shared_by_heads_over_the_same_weight_and_clusters():
    copied, direct = _pair()
    weight_bytes = VOCAB * HIDDEN * 4
    assert copied.cluster_rows.nbytes >= weight_bytes
    assert copied.extra_memory_bytes - copied.cluster_rows.nbytes < direct.extra_memory_bytes
    assert copied.cluster_rows.rows.data_ptr() != copied.weight.data_ptr()
    centroids = copied.centroids
    assignments = copied.cluster_rows.token_cluster.new_empty(VOCAB)
    assignments[copied.cluster_rows.order] = copied.cluster_rows.token_cluster
    drafter = FlashHead(copied.weight, centroids, assignments, vocab_size=VOCAB, n_probes=3)
    assert drafter.cluster_rows is copied.cluster_rows  # an EAGLE drafter's head over the target's LM head
    other = FlashHead(copied.weight, centroids, torch.roll(assignments, 1), vocab_size=VOCAB, n_probes=3)
    assert other.cluster_rows is not copied.cluster_rows  # other clusters: its own copy


def test_a_weight_changed_in_place_is_copied_again_before_the_next_step(monkeypatch):
    copied, direct = _pair()
    hidden = _hidden(4, seed=7)
    before = copied.step_logits(hidden)
    new = torch.randn(VOCAB + PAD, HIDDEN, generator=torch.Generator().manual_seed(9))
    direct.weight.data.copy_(new)  # as vLLM's weight loaders write: not seen by autograd's version counter
    copied.weight.data.copy_(new)
    with monkeypatch.context() as m:  # without the check the copy keeps the old rows
        m.setattr(cluster_rows_module.ClusterRows, "refresh", lambda self: None)
        assert torch.equal(copied.step_logits(hidden), before)
    after = copied.step_logits(hidden)
    assert torch.equal(after, direct.step_logits(hidden))
    assert not torch.equal(after, before)
    assert torch.equal(copied.cluster_rows.rows, new[:VOCAB][copied.cluster_rows.order])


def test_each_check_compares_another_row_and_a_change_anywhere_is_found_within_v_steps():
    copied, _ = _pair()
    rows = copied.cluster_rows
    copied.weight.data[1234] += 1.0  # one token's row
    hidden = _hidden(1)
    checked = set()
    for _ in range(VOCAB):
        checked.add(rows._next_check)
        copied.step_logits(hidden)
        if torch.equal(rows.rows, copied.weight[:VOCAB][rows.order]):
            break
    assert torch.equal(rows.rows, copied.weight[:VOCAB][rows.order])
    assert len(checked) > 1


def test_a_cpu_head_keeps_the_copy_by_default_and_not_with_the_setting_off():
    head, _ = random_head(64, 8, n_probes=2, cluster_rows=False)
    assert head.cluster_rows is None and head.candidate_rows.token_cluster is not None
    head, _ = random_head(64, 8, n_probes=2)
    assert head.cluster_rows is not None and head.candidate_rows.token_cluster is None


def test_a_row_that_is_not_a_number_is_no_change():
    """Rows compare bit for bit: a NaN in the head (a broken checkpoint) does not copy the head on every check."""
    copied, _ = _pair()
    rows = copied.cluster_rows
    token = int(rows.order[0])  # the row the next check compares
    copied.weight.data[token, 3] = float("nan")
    copied.step_logits(_hidden(1))  # differs from the copy: copied again, NaN included
    assert torch.isnan(rows.rows[0, 3])
    copy_made = rows.rows.data_ptr()
    rows._next_check = 0
    calls = []
    original = torch.index_select
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch, "index_select", lambda *a, **kw: calls.append(1) or original(*a, **kw))
        copied.step_logits(_hidden(1))
    assert calls == [] and rows.rows.data_ptr() == copy_made
