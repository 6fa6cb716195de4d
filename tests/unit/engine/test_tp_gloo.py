"""FlashHead at tensor parallel 2 over vLLM's real TP group: two spawned processes, gloo on CPU.

The stage-1 exchange and vLLM's gather are the real collectives; a rank that raises inside FlashHead
(stage 1 or stage 2) must not leave the other waiting: every scenario of both ranks has to finish.
"""

from __future__ import annotations

import multiprocessing
import queue as queues
import socket

import pytest
import torch

from tests.support import tp_ranks
from tests.support.tp_ranks import CLUSTERS, VOCAB

pytestmark = pytest.mark.slow  # every test here spawns gloo ranks

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


@pytest.mark.slow
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


def test_each_rank_times_its_own_part(results):
    own = [results[rank][f"own_timing_{rank}"] for rank in (0, 1)]
    assert all(costs is not None and costs[0][0] == 1 and costs[3] is not None for costs in own)
    assert own[0][1] != own[1][1]  # two timings, not one timing twice


def test_ranks_that_serve_a_step_different_ways_gather_the_same_logits(results):
    """Rank 0 serves the step the masked way, rank 1 with FlashHead's kernels: the gathered logits are those of both
    ranks on the kernels (the ways differ in cost only), and both exchanged on each step."""
    assert results[0]["masked_rows_0"] == [0, 3] and results[1]["masked_rows_1"] == [0, 0]
    assert results[0]["exchanges_0"] == results[1]["exchanges_1"] == 2
    kernels, mixed = (torch.from_numpy(results[0][f"ways_{way}"]) for way in ("flashhead", "masked"))
    assert torch.equal(torch.isinf(mixed), torch.isinf(kernels))
    torch.testing.assert_close(mixed, kernels)


@pytest.mark.parametrize("failing", [0, 1])
@pytest.mark.parametrize("cause", ["assets_invalid", "no_controller"])
def test_a_rank_that_cannot_serve_at_load_makes_every_rank_dense_without_a_hang(results, failing, cause):
    """Each failure on each rank, over vLLM's real TP group: the ranks agree when the model loads (one all-reduce),
    every rank then serves vLLM's dense logits, and no rank enters a stage-1 exchange (a hang if one did alone)."""
    name = f"agreed_{cause}_fails_on_{failing}"
    torch.testing.assert_close(torch.from_numpy(results[0][name]), _dense())
    for rank in (0, 1):
        seen = results[rank][f"{name}_{rank}"]
        if rank == failing and cause == "no_controller":
            assert seen is None
            continue
        code, exchanges = seen
        assert exchanges == 0
        assert code == ("assets_invalid" if rank == failing else "tensor_parallel_rank")
