"""FlashHead over a vocab-parallel head: each rank scores its own shard, vLLM's gather joins them.

Two ranks are simulated in one process: each has its own processor, controller and
weight shard, and the gather is replaced by recording the rank's local logits.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from my_pkg.engine.flashhead import FlashHeadController, StepRows
from my_pkg.engine.patches import logits_processor

VOCAB, HIDDEN, CAP = 200, 16, 8
CLUSTERS = VOCAB // CAP
SHARD = 104  # vLLM pads each shard: rank 1 holds tokens [104, 200) and 8 padding rows


class UnquantizedEmbeddingMethod:
    """Stands in for vLLM's class of the same name (matched by name)."""

    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.weight, bias)


@pytest.fixture(autouse=True)
def vllm_config():
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


@pytest.fixture
def weight():
    torch.manual_seed(0)
    return torch.randn(VOCAB, HIDDEN)


ASSIGNMENTS = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1)) % CLUSTERS


def _ranks(weight, n_probes, pinned_ids=()):
    """Two (processor, lm_head) pairs over the shards of `weight`, as vLLM's VocabParallelEmbedding lays them out."""
    assignments = ASSIGNMENTS
    centroids = torch.stack([weight[assignments == c].mean(0) for c in range(CLUSTERS)])
    ranks = []
    for start in (0, SHARD):
        end = min(start + SHARD, VOCAB)
        rows = torch.zeros(SHARD, HIDDEN)
        rows[: end - start] = weight[start:end]
        shard = SimpleNamespace(org_vocab_start_index=start, org_vocab_end_index=end, num_org_elements=end - start)
        lm_head = SimpleNamespace(
            weight=rows, quant_method=UnquantizedEmbeddingMethod(), tp_size=2, shard_indices=shard
        )
        processor = logits_processor.subclass()(VOCAB)
        processor._my_pkg_flashhead = FlashHeadController(
            centroids=centroids,
            assignments=assignments,
            config={"n_probes": n_probes},
            vocab_size=VOCAB,
            pinned_ids=pinned_ids,
        )
        gathered = []
        processor._gather_logits = lambda local, out=gathered: out.append(local) or None
        ranks.append((processor, lm_head, gathered))
    return ranks


def _step(ranks, hidden, sampled=None):
    """One decode step on both ranks; the gathered logits `[B, VOCAB]`."""
    num_rows = hidden.shape[0]
    for processor, lm_head, _gathered in ranks:
        rows = StepRows(
            np.zeros(num_rows, np.uint8), np.zeros(num_rows, bool) if sampled is None else np.asarray(sampled)
        )
        processor._my_pkg_flashhead.arm(lambda rows=rows: rows)
        assert processor(lm_head, hidden) is None  # this rank's logits went to the gather
    return torch.cat([gathered.pop() for _, _, gathered in ranks], dim=1)[:, :VOCAB]


def test_the_head_is_built_on_the_first_logits_call_over_each_rank_shard(weight):
    ranks = _ranks(weight, n_probes=2)
    hidden = torch.randn(3, HIDDEN)
    for processor, lm_head, _ in ranks:  # vLLM's warm-up call: not a decode step, but the head gets built
        controller = processor._my_pkg_flashhead
        processor(lm_head, hidden)
        assert controller.head is not None and controller.status().active is True
        assert controller.counters.steps == 0
    assert [p._my_pkg_flashhead.vocab_range for p, _, _ in ranks] == [(0, SHARD), (SHARD, VOCAB)]


def test_every_cluster_probed_gives_the_dense_logits(weight):
    hidden = torch.randn(4, HIDDEN)
    logits = _step(_ranks(weight, n_probes=CLUSTERS), hidden)
    torch.testing.assert_close(logits, hidden @ weight.T)


def test_few_probes_score_the_same_clusters_on_both_ranks_exactly(weight):
    hidden = torch.randn(4, HIDDEN)
    ranks = _ranks(weight, n_probes=2, pinned_ids=(VOCAB - 1,))
    logits = _step(ranks, hidden)
    dense = hidden @ weight.T
    finite = torch.isfinite(logits)
    torch.testing.assert_close(logits[finite], dense[finite])
    assert finite[:, VOCAB - 1].all()  # a pinned id in rank 1's shard is scored on every row
    # the candidates are the members of the same top clusters, whichever rank holds them
    head = ranks[0][0]._my_pkg_flashhead.head
    probes = head.select_probes(hidden)
    for row in range(hidden.shape[0]):
        expected = {int(t) for t in torch.nonzero(torch.isin(ASSIGNMENTS, probes[row])).flatten()}
        assert set(torch.nonzero(finite[row]).flatten().tolist()) == expected | {VOCAB - 1}
    for processor, _, _ in ranks:
        assert processor._my_pkg_flashhead.counters.rows_flashhead == 4


def test_a_failing_rank_serves_its_shard_dense_and_still_reaches_the_gather(weight, monkeypatch):
    hidden = torch.randn(2, HIDDEN)
    ranks = _ranks(weight, n_probes=1)
    _step(ranks, hidden)  # builds the heads
    controller = ranks[1][0]._my_pkg_flashhead

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(controller.head, "step_logits", broken)
    logits = _step(ranks, hidden)
    torch.testing.assert_close(logits[:, SHARD:], (hidden @ weight.T)[:, SHARD:])  # rank 1: dense
    assert not torch.isfinite(logits[:, :SHARD]).all()  # rank 0: still FlashHead
    assert controller.counters.fallbacks == 1


def test_sampled_rows_get_estimates_on_every_shard(weight):
    hidden = torch.randn(2, HIDDEN)
    logits = _step(_ranks(weight, n_probes=1), hidden, sampled=[True, False])
    assert torch.isfinite(logits[0]).all()
    assert not torch.isfinite(logits[1]).all()
