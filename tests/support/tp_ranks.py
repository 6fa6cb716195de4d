"""One rank of a tensor-parallel FlashHead step over vLLM's real TP group (gloo, CPU), for the spawned test.

Each rank builds vLLM's `ParallelLMHead` (loaded by its own weight loader) and our logits processor, then
runs decode steps through vLLM's TP group: the stage-1 exchange and vLLM's gather are the real collectives.
Rank 0 puts the gathered logits of each scenario on the queue.

The last scenarios time each rank's head for real (no collective), then give the ranks different timings, so
that the batch they agree to serve dense from, through the stage-1 exchange, is known.
"""

from __future__ import annotations

import math
import os
import traceback
from typing import Any

import numpy as np
import torch

VOCAB, HIDDEN, CAP = 200, 16, 8
CLUSTERS = VOCAB // CAP


def problem() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(weight, assignments, centroids, hidden)`, the same on every rank."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator)
    assignments = torch.randperm(VOCAB, generator=generator) % CLUSTERS
    centroids = torch.stack([weight[assignments == c].mean(0) for c in range(CLUSTERS)])
    hidden = torch.randn(3, HIDDEN, generator=generator)
    return weight, assignments, centroids, hidden


def _broken(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("boom on this rank")


def run_rank(rank: int, port: int, queue: Any) -> None:
    try:
        queue.put((rank, "done", _scenarios(rank, port)))
    except BaseException:  # noqa: BLE001 - the parent reports it
        queue.put((rank, "error", traceback.format_exc()))


def _scenarios(rank: int, port: int) -> dict[str, Any]:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    from my_pkg.engine.flashhead import FlashHeadController, StepRows
    from my_pkg.engine.patches import logits_processor

    # As vLLM's CPU worker sets it: the ranks' shared-memory communicator (the one serving uses) finds its peers.
    os.environ["VLLM_DIST_IDENT"] = f"my-pkg-tp-test-{port}"
    os.environ["MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD"] = "never"  # no timing until the timed scenarios
    torch.set_num_threads(1)
    weight, assignments, centroids, hidden = problem()
    results: dict[str, Any] = {}
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(2, rank, f"tcp://127.0.0.1:{port}", rank, backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=2)
        try:
            lm_head = ParallelLMHead(VOCAB, HIDDEN)
            lm_head.weight_loader(lm_head.weight, weight)
            lm_head.quant_method.process_weights_after_loading(lm_head)  # as vLLM's loader does (CPU GEMM set-up)
            processor = logits_processor.subclass()(VOCAB)
            controller = FlashHeadController(
                centroids=centroids, assignments=assignments, config={"n_probes": 2}, vocab_size=VOCAB
            )
            processor._my_pkg_flashhead = controller
            rows = StepRows(np.zeros(3, np.uint8), np.array([False, True, False]))

            def step(name: str) -> None:
                controller.arm(lambda: rows)
                logits = processor(lm_head, hidden)
                if rank == 0:  # numpy: pickled by value through the queue (a tensor would share memory)
                    results[name] = logits.numpy().copy()
                results[f"fallbacks_{name}_{rank}"] = controller.counters.fallbacks

            processor(lm_head, hidden)  # vLLM's warm-up call: builds the head, no exchange
            results["share"] = (controller.stage1.start, controller.stage1.end)
            results["vocab_range"] = controller.vocab_range
            step("few")
            controller.settings.n_probes = controller.head.n_probes = CLUSTERS
            step("full")
            controller.settings.n_probes = controller.head.n_probes = 2
            if rank == 1:
                controller.stage1.keys = _broken  # this rank cannot score its share
            step("stage1_fails_on_rank_1")
            if rank == 1:
                del controller.stage1.keys
                controller.head.step_logits = _broken  # this rank fails in stage 2
            step("stage2_fails_on_rank_1")
            results.update(_timed_scenarios(rank, lm_head, processor, hidden, centroids, assignments))
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()
    return results


def _rank_costs(rank: int) -> Any:
    """Rank 0's FlashHead pays at one row only, rank 1's at one and two (0.5 s where it pays, 2 s where not; the
    dense head 1 s at every batch): the slowest of them pays at one row only."""
    from my_pkg.flashhead.step_costs import StepCosts

    flash = (0.5, 2.0, 2.0) if rank == 0 else (0.5, 0.5, 2.0)
    return StepCosts((1, 2, 3), (1.0, 1.0, 1.0), flash, flash, (math.nan, *flash[1:]))


def _timed_scenarios(rank: int, lm_head: Any, processor: Any, hidden: Any, centroids: Any, assignments: Any) -> dict:
    from my_pkg.contract import FlashHeadUpdate
    from my_pkg.engine.flashhead import FlashHeadController, StepRows
    from my_pkg.engine.patches import logits_processor

    del os.environ["MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD"]
    timed = FlashHeadController(centroids=centroids, assignments=assignments, config={"n_probes": 2}, vocab_size=VOCAB)
    processor._my_pkg_flashhead = timed
    logits_processor.build_head(timed, lm_head)  # as after the weights load: built, warmed up, timed alone
    results: dict[str, Any] = {f"own_timing_{rank}": _sides(timed.step_costs)}
    timed.arm(lambda: StepRows(np.zeros(1, np.uint8), np.zeros(1, bool)))
    processor(lm_head, hidden[:1])  # the first exchange carries both real timings through vLLM's all-gather
    results[f"agreed_timing_{rank}"] = _sides(timed.agreed_costs)
    timed.apply(FlashHeadUpdate(enabled=True))  # an update on every rank: the agreement is forgotten
    timed.step_costs = _rank_costs(rank)
    counters = timed.counters
    base = (counters.stage1_exchanges, counters.rows_dense["slower_than_dense"], counters.rows_flashhead)
    results[f"dense_from_{rank}"] = timed.dense_from()
    for name, rows in (("three_rows", 3), ("two_rows", 2), ("one_row", 1)):
        step_rows = StepRows(np.zeros(rows, np.uint8), np.arange(rows) % 2 == 1)
        timed.arm(lambda step_rows=step_rows: step_rows)
        logits = processor(lm_head, hidden[:rows])
        if rank == 0:
            results[name] = logits.numpy().copy()
        results[f"{name}_{rank}"] = {
            "agreed": timed.dense_from_agreed,
            "exchanges": counters.stage1_exchanges - base[0],
            "slower": counters.rows_dense["slower_than_dense"] - base[1],
            "flashhead": counters.rows_flashhead - base[2],
            "fallbacks": timed.counters.fallbacks,
        }
    return results


def _sides(costs: Any) -> tuple | None:
    """A timing as plain tuples (pickled by value through the queue)."""
    if costs is None:
        return None
    return (costs.batches, costs.dense_s, costs.greedy_s, costs.sampled_s, costs.mixed_s)
