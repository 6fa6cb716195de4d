"""One rank of a tensor-parallel FlashHead step over vLLM's real TP group (gloo, CPU), for the spawned test.

Each rank builds vLLM's `ParallelLMHead` (loaded by its own weight loader) and our logits processor, then
runs decode steps through vLLM's TP group: the stage-1 exchange and vLLM's gather are the real collectives.
Rank 0 puts the gathered logits of each scenario on the queue.

The last scenarios time each rank's head for real (no collective) and serve a step a different way on each rank
(the ways differ in cost only), then make the ranks agree at load, as vLLM's model loader hook does, with one
rank that cannot serve FlashHead (its assets unreadable, or no controller at all): every rank must serve dense,
and no rank may wait in an exchange another skips.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import numpy as np
import torch

from my_pkg.engine import setup as engine_setup

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


def _timed_scenarios(rank: int, lm_head: Any, processor: Any, hidden: Any, centroids: Any, assignments: Any) -> dict:
    from my_pkg.engine.flashhead import FlashHeadController, StepRows
    from my_pkg.engine.flashhead.timing import StepWays

    del os.environ["MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD"]
    timed = FlashHeadController(centroids=centroids, assignments=assignments, config={"n_probes": 2}, vocab_size=VOCAB)
    processor._my_pkg_flashhead = timed
    engine_setup.build_head(timed, lm_head)  # as after the weights load: built, warmed up, timed alone
    results: dict[str, Any] = {f"own_timing_{rank}": _sides(timed.step_costs)}
    rows = StepRows(np.zeros(3, np.uint8), np.array([False, True, False]))
    ways = []
    for forced in ("flashhead", "masked"):
        # Rank 0 takes `forced`, rank 1 FlashHead's kernels: the gathered logits must not change.
        timed.ways = StepWays(_forcing(timed.step_costs, forced if rank == 0 else "flashhead"))
        timed.arm(lambda: rows)
        logits = processor(lm_head, hidden)
        if rank == 0:
            results[f"ways_{forced}"] = logits.numpy().copy()
        ways.append(timed.counters.rows_flashhead_masked)
    results[f"masked_rows_{rank}"] = ways
    results[f"exchanges_{rank}"] = timed.counters.stage1_exchanges
    for failing in (0, 1):
        for cause in ("assets_invalid", "no_controller"):
            results.update(_agreed_at_load(rank, failing, cause, lm_head, hidden, centroids, assignments))
    return results


def _forcing(costs: Any, way: str) -> Any:
    """`costs` with the masked way far cheaper (`masked`) or far dearer (`flashhead`) than FlashHead's kernels."""
    from dataclasses import replace

    far = 1e-9 if way == "masked" else 1e3
    return replace(costs, masked_greedy_s=(far,) * len(costs.batches), masked_sampled_s=(far,) * len(costs.batches))


def _agreed_at_load(
    rank: int, failing: int, cause: str, lm_head: Any, hidden: Any, centroids: Any, assignments: Any
) -> dict:
    """A fresh model on every rank, where rank `failing` cannot serve (`cause`); the load hook's agreement, then one
    armed decode step."""
    from types import SimpleNamespace

    from my_pkg.engine.flashhead import FlashHeadController, StepRows
    from my_pkg.engine.patches import logits_processor, model_loader

    processor = logits_processor.subclass()(VOCAB)
    controller = FlashHeadController(
        centroids=centroids, assignments=assignments, config={"n_probes": 2}, vocab_size=VOCAB
    )
    processor._my_pkg_flashhead = controller
    if rank == failing:
        if cause == "assets_invalid":
            controller.make_unavailable("assets_invalid", "FlashHead assets could not be loaded: no such file")
        else:
            processor._my_pkg_flashhead = None
    model = torch.nn.ModuleDict({"logits_processor": processor})
    model_config = SimpleNamespace(hf_config=SimpleNamespace(flash_head_cache_dir="flash_head_assets"))
    model_loader.build_after_loading(model, model_config)
    model_loader.agree_after_loading(model, model_config, torch.device("cpu"))
    rows = StepRows(np.zeros(3, np.uint8), np.zeros(3, bool))
    if processor._my_pkg_flashhead is not None:
        processor._my_pkg_flashhead.arm(lambda: rows)
    logits = processor(lm_head, hidden)
    name = f"agreed_{cause}_fails_on_{failing}"
    out: dict[str, Any] = {}
    if rank == 0:
        out[name] = logits.numpy().copy()
    own = processor._my_pkg_flashhead
    out[f"{name}_{rank}"] = None if own is None else (own.status().reason_code, own.counters.stage1_exchanges)
    return out


def _sides(costs: Any) -> tuple | None:
    """A timing as plain tuples (pickled by value through the queue)."""
    if costs is None:
        return None
    return (costs.batches, costs.dense_s, costs.greedy_s, costs.sampled_s, costs.mixed_s)
