"""FlashHead over a vocab-parallel head: each rank scores its share of the centroids, the ranks exchange
their best clusters, each scores the candidates in its own shard, vLLM's gather joins them.

Two ranks are simulated in one process, as two threads: each has its own processor, controller and
weight shard; the stage-1 exchange is an all-gather between the threads (a barrier that times out if a
rank never reaches it), and vLLM's gather is replaced by recording the rank's local logits. vLLM's real
TP group runs in `test_tp_gloo.py`.
"""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from my_pkg.engine.flashhead import FlashHeadController, StepRows
from my_pkg.engine.patches import logits_processor
from my_pkg.flashhead.step_costs import StepCosts
from tests.support.vllm_fakes import UnquantizedEmbeddingMethod, default_vllm_config

VOCAB, HIDDEN, CAP = 200, 16, 8
CLUSTERS = VOCAB // CAP
SHARD = 104  # vLLM pads each shard: rank 1 holds tokens [104, 200) and 8 padding rows


@pytest.fixture(autouse=True)
def vllm_config():
    with default_vllm_config():
        yield


class ThreadGroup:
    """The TP group's all-gather between ranks that are threads of this process; counts each rank's calls."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=20)
        self.local = threading.local()
        self.parts: dict[int, torch.Tensor] = {}
        self.calls: Counter[int] = Counter()

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        rank = self.local.rank
        self.calls[rank] += 1
        self.parts[rank] = tensor
        self.barrier.wait()
        shapes = {tuple(self.parts[r].shape) for r in range(len(self.parts))}
        gathered = torch.cat([self.parts[r] for r in range(len(self.parts))], dim=dim)
        self.barrier.wait()
        assert len(shapes) == 1, f"the ranks sent different shapes: {shapes}"  # a real all-gather would hang
        return gathered


@pytest.fixture(autouse=True)
def group(monkeypatch):
    import vllm.distributed

    group = ThreadGroup(2)
    monkeypatch.setattr(vllm.distributed, "tensor_model_parallel_all_gather", group.all_gather)
    return group


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
    for rank, start in enumerate((0, SHARD)):
        end = min(start + SHARD, VOCAB)
        rows = torch.zeros(SHARD, HIDDEN)
        rows[: end - start] = weight[start:end]
        shard = SimpleNamespace(org_vocab_start_index=start, org_vocab_end_index=end, num_org_elements=end - start)
        lm_head = SimpleNamespace(
            weight=rows, quant_method=UnquantizedEmbeddingMethod(), tp_size=2, tp_rank=rank, shard_indices=shard
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


def _on_ranks(group, ranks, call):
    """`call(rank, processor, lm_head)` on every rank at once, each in its own thread."""

    def run(rank):
        group.local.rank = rank
        processor, lm_head, _ = ranks[rank]
        return call(rank, processor, lm_head)

    with ThreadPoolExecutor(len(ranks)) as pool:
        return list(pool.map(run, range(len(ranks))))


def _step(group, ranks, hidden, sampled=None, source=None):
    """One armed decode step on both ranks; the gathered logits `[B, VOCAB]`. `source(rank, rows)` may replace
    a rank's step rows."""
    num_rows = hidden.shape[0]
    rows = StepRows(np.zeros(num_rows, np.uint8), np.zeros(num_rows, bool) if sampled is None else np.asarray(sampled))

    def call(rank, processor, lm_head):
        processor._my_pkg_flashhead.arm(lambda: rows if source is None else source(rank, rows))
        return processor(lm_head, hidden)

    assert _on_ranks(group, ranks, call) == [None, None]  # each rank's logits went to the gather
    return torch.cat([gathered.pop() for _, _, gathered in ranks], dim=1)[:, :VOCAB]


def _build(group, ranks, hidden):
    """vLLM's warm-up call (not a decode step) on both ranks: the heads get built."""
    _on_ranks(group, ranks, lambda rank, processor, lm_head: processor(lm_head, hidden))
    for _, _, gathered in ranks:
        gathered.clear()


def test_the_head_is_built_on_the_first_logits_call_over_each_rank_shard(group, weight):
    ranks = _ranks(weight, n_probes=2)
    _build(group, ranks, torch.randn(3, HIDDEN))  # vLLM's warm-up call: not a decode step, but the head gets built
    for processor, _, _ in ranks:
        controller = processor._my_pkg_flashhead
        assert controller.head is not None and controller.status().active is True
        assert controller.counters.steps == 0
    assert [p._my_pkg_flashhead.vocab_range for p, _, _ in ranks] == [(0, SHARD), (SHARD, VOCAB)]
    shares = [(p._my_pkg_flashhead.stage1.start, p._my_pkg_flashhead.stage1.end) for p, _, _ in ranks]
    assert shares == [(0, CLUSTERS // 2), (CLUSTERS // 2, CLUSTERS)]
    for processor, _, _ in ranks:  # the share is a view of the head's centroids, not a second copy
        controller = processor._my_pkg_flashhead
        storage = controller.head.centroids.untyped_storage().data_ptr()
        assert controller.stage1.centroids.untyped_storage().data_ptr() == storage
    assert group.calls == {}  # no exchange outside decode steps


def test_every_cluster_probed_gives_the_dense_logits(group, weight):
    hidden = torch.randn(4, HIDDEN)
    logits = _step(group, _ranks(weight, n_probes=CLUSTERS), hidden)
    torch.testing.assert_close(logits, hidden @ weight.T)
    assert group.calls == {0: 1, 1: 1}


def test_few_probes_score_the_same_clusters_on_both_ranks_exactly(group, weight):
    hidden = torch.randn(4, HIDDEN)
    ranks = _ranks(weight, n_probes=2, pinned_ids=(VOCAB - 1,))
    logits = _step(group, ranks, hidden)
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


def _broken(*args, **kwargs):
    raise RuntimeError("boom")


def test_a_rank_failing_in_stage_2_serves_its_shard_dense_and_still_reaches_both_collectives(
    group, weight, monkeypatch
):
    hidden = torch.randn(2, HIDDEN)
    ranks = _ranks(weight, n_probes=1)
    _build(group, ranks, hidden)
    controller = ranks[1][0]._my_pkg_flashhead
    monkeypatch.setattr(controller.head, "step_logits", _broken)
    logits = _step(group, ranks, hidden)
    torch.testing.assert_close(logits[:, SHARD:], (hidden @ weight.T)[:, SHARD:])  # rank 1: dense
    assert not torch.isfinite(logits[:, :SHARD]).all()  # rank 0: still FlashHead
    assert controller.counters.fallbacks == 1
    assert group.calls == {0: 1, 1: 1}


def test_a_rank_failing_in_stage_1_still_exchanges_and_the_other_probes_the_scored_clusters(group, weight, monkeypatch):
    hidden = torch.randn(3, HIDDEN)
    ranks = _ranks(weight, n_probes=2)
    _build(group, ranks, hidden)
    failing = ranks[1][0]._my_pkg_flashhead
    monkeypatch.setattr(failing.stage1, "keys", _broken)
    logits = _step(group, ranks, hidden)
    assert group.calls == {0: 1, 1: 1}
    dense = hidden @ weight.T
    torch.testing.assert_close(logits[:, SHARD:], dense[:, SHARD:])  # rank 1: its shard dense
    assert failing.counters.fallbacks == 1 and ranks[0][0]._my_pkg_flashhead.counters.fallbacks == 0
    head = ranks[0][0]._my_pkg_flashhead.head
    scored = head.centroids[: CLUSTERS // 2]  # rank 0's share: rank 1's clusters ranked last
    probes = torch.topk(hidden @ scored.T, 2, dim=1).indices
    for row in range(hidden.shape[0]):
        members = torch.nonzero(torch.isin(ASSIGNMENTS[:SHARD], probes[row])).flatten()
        assert set(torch.nonzero(torch.isfinite(logits[row, :SHARD])).flatten().tolist()) == set(members.tolist())


def test_a_rank_failing_to_read_the_step_rows_still_exchanges_once(group, weight):
    hidden = torch.randn(2, HIDDEN)
    ranks = _ranks(weight, n_probes=CLUSTERS)

    def source(rank, rows):
        if rank == 1:
            raise RuntimeError("rows")
        return rows

    logits = _step(group, ranks, hidden, source=source)
    torch.testing.assert_close(logits, hidden @ weight.T)  # full probes on rank 0, dense on rank 1
    assert group.calls == {0: 1, 1: 1}
    assert ranks[1][0]._my_pkg_flashhead.counters.fallbacks == 1


def test_a_rank_whose_head_failed_to_build_still_takes_part_in_the_exchange(group, weight, monkeypatch):
    from my_pkg.flashhead.head import FlashHead

    hidden = torch.randn(2, HIDDEN)
    ranks = _ranks(weight, n_probes=CLUSTERS)
    real = FlashHead.from_settings

    def refused(weight, *args, **kwargs):  # only rank 1 fails to build its head (say, out of memory on that device)
        if weight.data_ptr() == ranks[1][1].weight.data_ptr():
            raise MemoryError("no room")
        return real(weight, *args, **kwargs)

    monkeypatch.setattr(FlashHead, "from_settings", refused)
    _build(group, ranks, hidden)
    failed = ranks[1][0]._my_pkg_flashhead
    assert failed.head is None and failed.unavailable_code == "build_failed" and failed.stage1 is not None
    logits = _step(group, ranks, hidden)
    torch.testing.assert_close(logits, hidden @ weight.T)
    assert group.calls == {0: 1, 1: 1}


def test_a_rank_whose_head_stood_down_after_timing_itself_still_takes_part_in_the_exchange(group, weight, monkeypatch):
    """On an accelerator each rank times its own part at load: one whose kernels measured slower than its shard of
    the dense product stands down alone, and must still reach every collective of a step."""
    from my_pkg.engine.flashhead import build

    monkeypatch.delenv("MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD", raising=False)
    hidden = torch.randn(2, HIDDEN)
    ranks = _ranks(weight, n_probes=CLUSTERS)
    slow_weight = ranks[1][1].weight.data_ptr()

    def measure(head, *args):
        greedy_s = 2.0 if head.weight.data_ptr() == slow_weight else 0.5
        return StepCosts(batches=(1,), dense_s=(1.0,), greedy_s=(greedy_s,), sampled_s=None)

    monkeypatch.setattr(build, "on_host", lambda head: False)
    monkeypatch.setattr(build, "measure", measure)
    _build(group, ranks, hidden)
    stood_down, serving = ranks[1][0]._my_pkg_flashhead, ranks[0][0]._my_pkg_flashhead
    assert stood_down.head is None and stood_down.unavailable_code == "slower_than_dense"
    assert serving.head is not None and serving.available
    logits = _step(group, ranks, hidden)
    torch.testing.assert_close(logits, hidden @ weight.T)  # full probes on rank 0, the dense shard on rank 1
    assert group.calls == {0: 1, 1: 1}


def test_no_exchange_when_flashhead_is_disabled(group, weight):
    hidden = torch.randn(2, HIDDEN)
    ranks = _ranks(weight, n_probes=1)
    for processor, _, _ in ranks:
        processor._my_pkg_flashhead.settings.enabled = False
    torch.testing.assert_close(_step(group, ranks, hidden), hidden @ weight.T)
    assert group.calls == {}


def test_steps_above_the_threshold_exchange_nothing_and_go_dense_on_both_ranks(group, weight):
    hidden = torch.randn(3, HIDDEN)
    ranks = _ranks(weight, n_probes=1)
    for processor, _, _ in ranks:
        processor._my_pkg_flashhead.settings.dense_batch_threshold = 2
    torch.testing.assert_close(_step(group, ranks, hidden), hidden @ weight.T)
    assert group.calls == {}
    _step(group, ranks, hidden[:2])
    assert group.calls == {0: 1, 1: 1}
    for processor, _, _ in ranks:
        counters = processor._my_pkg_flashhead.counters
        assert counters.rows_dense == {"batch_threshold": 3} and counters.rows_flashhead == 2
        assert counters.stage1_exchanges == 1


def test_mixed_steps_probe_each_kind_of_row_from_one_exchange(group, weight):
    """Greedy rows probe `n_probes`, sampled rows `sampled_n_probes`, from one exchange of the larger."""
    hidden = torch.randn(4, HIDDEN)
    ranks = _ranks(weight, n_probes=1)
    for processor, _, _ in ranks:
        processor._my_pkg_flashhead.settings.sampled_n_probes = 3
    _build(group, ranks, hidden)
    logits = _step(group, ranks, hidden, sampled=[True, False, True, False])
    assert group.calls == {0: 1, 1: 1}
    full = ranks[0][0]._my_pkg_flashhead.head.select_probes(hidden, n_probes=3)
    for row in (1, 3):  # greedy: the members of the full stage 1's best cluster, exactly
        members = torch.nonzero(ASSIGNMENTS == full[row, 0]).flatten()
        assert set(torch.nonzero(torch.isfinite(logits[row])).flatten().tolist()) == set(members.tolist())
    assert torch.isfinite(logits[[0, 2]]).all()


def test_sampled_rows_get_estimates_on_every_shard(group, weight):
    hidden = torch.randn(2, HIDDEN)
    logits = _step(group, _ranks(weight, n_probes=1), hidden, sampled=[True, False])
    assert torch.isfinite(logits[0]).all()
    assert not torch.isfinite(logits[1]).all()


def _masked_below(rows: int) -> StepCosts:
    """The masked way cheaper than FlashHead's kernels from `rows` rows on."""
    kernels = tuple(0.5 if b < rows else 5.0 for b in (1, 2, 4))
    return StepCosts((1, 2, 4), (1.0, 1.0, 1.0), kernels, None, masked_greedy_s=(1.2, 1.2, 1.2))


def test_ranks_that_serve_a_step_different_ways_give_the_same_logits_and_exchange_alike(group, weight):
    """Each rank chooses its own way from its own timing (the ways differ in cost only): rank 0 takes the masked way
    from 2 rows, rank 1 never; both exchange on every armed step, and the gathered logits are what both ranks on
    FlashHead's kernels give."""
    from my_pkg.engine.flashhead.timing import StepWays

    hidden = torch.randn(4, HIDDEN)
    ranks = _ranks(weight, n_probes=2)
    _build(group, ranks, hidden)
    kernels = _step(group, ranks, hidden)
    controllers = [processor._my_pkg_flashhead for processor, _, _ in ranks]
    controllers[0].step_costs = _masked_below(2)
    controllers[0].ways = StepWays(controllers[0].step_costs)
    mixed = _step(group, ranks, hidden)
    assert controllers[0].counters.rows_flashhead_masked == 4 and controllers[1].counters.rows_flashhead_masked == 0
    assert torch.equal(torch.isinf(mixed), torch.isinf(kernels))
    torch.testing.assert_close(mixed, kernels)
    assert group.calls == {0: 2, 1: 2}


def test_a_rank_failing_in_the_exchange_keeps_the_ranks_in_step(group, weight, monkeypatch):
    """Rank 1 cannot score its share: the payloads keep their shape, it serves its shard dense, and the next step
    exchanges on both ranks again."""
    hidden = torch.randn(2, HIDDEN)
    ranks = _ranks(weight, n_probes=1)
    _build(group, ranks, hidden)
    controllers = [processor._my_pkg_flashhead for processor, _, _ in ranks]
    monkeypatch.setattr(controllers[1].stage1, "keys", _broken)
    logits = _step(group, ranks, hidden)
    torch.testing.assert_close(logits[:, SHARD:], (hidden @ weight.T)[:, SHARD:])  # rank 1: its shard dense
    assert controllers[1].counters.fallbacks == 1 and controllers[0].counters.fallbacks == 0
    _step(group, ranks, hidden)
    assert group.calls == {0: 2, 1: 2}


def test_after_the_load_agreement_a_rank_without_assets_makes_every_rank_dense_without_exchanging(group, weight):
    """A rank whose assets could not be read agrees dense with the others when the model loads: no rank enters the
    stage-1 exchange, and the gathered logits are the dense head's."""
    hidden = torch.randn(2, HIDDEN)
    ranks = _ranks(weight, n_probes=2)
    ranks[1][0]._my_pkg_flashhead.make_unavailable("assets_invalid", "a file is missing on this node")
    _build(group, ranks, hidden)
    for processor, _, _ in ranks:
        processor._my_pkg_flashhead.agree(False)
    torch.testing.assert_close(_step(group, ranks, hidden), hidden @ weight.T)
    assert group.calls == {}
    assert ranks[0][0]._my_pkg_flashhead.status().reason_code == "tensor_parallel_rank"
