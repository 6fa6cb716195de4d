"""FlashHead at tensor parallel 2 over vLLM's real TP group: two spawned processes, gloo on CPU.

The stage-1 exchange and vLLM's gather are the real collectives; a rank that raises inside FlashHead
(stage 1 or stage 2) must not leave the other waiting: every scenario of both ranks has to finish.
"""

from __future__ import annotations

import multiprocessing
import queue as queues
import socket

import numpy as np
import pytest
import torch

from tests.support import tp_ranks
from tests.support.tp_ranks import CLUSTERS, VOCAB

TIMEOUT_S = 240  # two imports of vLLM on a busy 2-core machine; a deadlock waits forever


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def results():
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
    processes = [context.Process(target=tp_ranks.run_rank, args=(rank, port, queue)) for rank in (0, 1)]
    for process in processes:
        process.start()
    replies = {}
    try:
        for _ in processes:
            rank, kind, value = queue.get(timeout=TIMEOUT_S)
            assert kind == "done", f"rank {rank} failed:\n{value}"
            replies[rank] = value
    except queues.Empty:
        pytest.fail(f"a rank did not finish within {TIMEOUT_S} s (deadlock?); finished: {sorted(replies)}")
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    return replies


def _dense():
    weight, _, _, hidden = tp_ranks.problem()
    return hidden @ weight.T


def test_each_rank_scores_half_of_the_centroids_and_its_vocabulary_shard(results):
    assert [results[r]["share"] for r in (0, 1)] == [(0, CLUSTERS // 2), (CLUSTERS // 2, CLUSTERS)]
    assert [results[r]["vocab_range"] for r in (0, 1)] == [(0, 128), (128, VOCAB)]  # vLLM pads shards to 64


def test_every_cluster_probed_gives_the_dense_logits(results):
    torch.testing.assert_close(torch.from_numpy(results[0]["full"]), _dense())


def test_few_probes_are_the_full_stage_1s_and_exact(results):
    weight, assignments, centroids, hidden = tp_ranks.problem()
    logits = torch.from_numpy(results[0]["few"])
    finite = torch.isfinite(logits)
    greedy = finite.clone()
    greedy[1] = False  # row 1 samples: estimates outside its candidates
    torch.testing.assert_close(logits[greedy], _dense()[greedy])
    probes = torch.topk(hidden @ centroids.T, 2, dim=1).indices
    for row in (0, 2):  # greedy rows: exactly the members of the full stage 1's probes
        expected = torch.nonzero(torch.isin(assignments, probes[row])).flatten()
        assert torch.nonzero(finite[row]).flatten().tolist() == expected.tolist()
    assert finite[1].all()  # the sampled row: estimates elsewhere
    assert results[0]["fallbacks_few_0"] == results[1]["fallbacks_few_1"] == 0


def test_a_rank_raising_in_stage_1_finishes_the_step_on_both_ranks(results):
    logits = torch.from_numpy(results[0]["stage1_fails_on_rank_1"])
    shard = results[1]["vocab_range"][0]
    torch.testing.assert_close(logits[:, shard:VOCAB], _dense()[:, shard:])  # rank 1: its shard dense
    assert not torch.isfinite(logits[[0, 2], :shard]).all()  # rank 0: FlashHead
    assert results[1]["fallbacks_stage1_fails_on_rank_1_1"] == 1
    assert results[0]["fallbacks_stage1_fails_on_rank_1_0"] == 0


def test_a_rank_raising_in_stage_2_finishes_the_step_on_both_ranks(results):
    logits = torch.from_numpy(results[0]["stage2_fails_on_rank_1"])
    shard = results[1]["vocab_range"][0]
    torch.testing.assert_close(logits[:, shard:VOCAB], _dense()[:, shard:])
    assert results[1]["fallbacks_stage2_fails_on_rank_1_1"] == 2


def test_each_rank_times_its_own_part_and_the_first_exchange_agrees_on_the_slowest(results):
    """Both ranks' real timings (every batch, every side) cross vLLM's all-gather on the first decode step, and
    each rank then holds the same agreed timing: each side's slowest rank at each batch both timed."""
    from my_pkg.flashhead.step_costs import StepCosts, slowest_costs

    own = [StepCosts(*results[rank][f"own_timing_{rank}"]) for rank in (0, 1)]
    assert all(costs.batches[0] == 1 and costs.sampled_s is not None for costs in own)
    expected = slowest_costs(own)
    for rank in (0, 1):
        agreed = results[rank][f"agreed_timing_{rank}"]
        assert agreed is not None
        for got, want in zip(
            agreed,
            (expected.batches, expected.dense_s, expected.greedy_s, expected.sampled_s, expected.mixed_s),
            strict=True,
        ):
            np.testing.assert_array_equal(np.asarray(got, dtype=float), np.asarray(want, dtype=float))
    assert own[0].dense_s != own[1].dense_s  # two timings, not one timing twice


def test_the_ranks_plan_from_their_slowest_times_and_skip_the_exchange_together(results):
    """Rank 0's timing pays at one row only, rank 1's at one and two: the first exchange gives both ranks the
    slowest of the two, which serves every step dense from 2 rows; a step of 2 rows then goes dense on both ranks
    without an exchange, and one of 1 row exchanges and is served by FlashHead on both."""
    assert (results[0]["dense_from_0"], results[1]["dense_from_1"]) == (2, 3)  # each rank's own timing
    for rank in (0, 1):
        seen = [results[rank][f"{name}_{rank}"] for name in ("three_rows", "two_rows", "one_row")]
        assert [s["agreed"] for s in seen] == [2, 2, 2]
        assert [s["exchanges"] for s in seen] == [1, 1, 2]
        assert [s["slower"] for s in seen] == [3, 5, 5] and [s["flashhead"] for s in seen] == [0, 0, 1]
        assert all(s["fallbacks"] == 0 for s in seen)
    dense = _dense()
    torch.testing.assert_close(torch.from_numpy(results[0]["three_rows"]), dense)
    torch.testing.assert_close(torch.from_numpy(results[0]["two_rows"]), dense[:2])
    one_row = torch.from_numpy(results[0]["one_row"])
    shard = results[1]["vocab_range"][0]
    assert not torch.isfinite(one_row[0, :shard]).all() and not torch.isfinite(one_row[0, shard:VOCAB]).all()
    finite = torch.isfinite(one_row)
    torch.testing.assert_close(one_row[finite], dense[:1][finite])
