"""One rank of a tensor-parallel FlashHead step over vLLM's real TP group (gloo, CPU), for the spawned test.

Each rank builds vLLM's `ParallelLMHead` (loaded by its own weight loader) and our logits processor, then
runs decode steps through vLLM's TP group: the stage-1 exchange and vLLM's gather are the real collectives.
Rank 0 puts the gathered logits of each scenario on the queue.
"""

from __future__ import annotations

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
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()
    return results
