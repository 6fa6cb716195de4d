"""Host cost per decode step of describing the step's rows to FlashHead, at many running requests.

Every step, the V1 and V2 runner hooks build the step's `StepRows` (dense codes, sampled rows, the
union of the ids the step's requests stop on) and the controller looks the pinned ids up by that
union (`PinnedRows.get`). This times exactly that host work, with vLLM's real `SamplingParams`
(every request stops on the tokenizer's EOS, as `all_stop_token_ids` says) on stand-ins of the
runner's batch, for two cases of who knows the ids the model pins anyway (EOS, special tokens):

* ``base ids unknown``: requests joined before the hooks knew them (or the previous code): every
  request carries its EOS, so the union walks every request every step;
* ``base ids shared``: the hooks drop the pinned ids when a request joins, so a typical request
  carries no stop ids and the union is empty without looking at any request.

Each case runs with every request plain, and with one request that has an extra stop id.

    python -m bench.experiments.step_overhead                 # 256 running requests
    python -m bench.experiments.step_overhead --requests 1024 --steps 20000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import torch

from bench._report import machine_description
from my_pkg.engine.flashhead.pins import PinnedRows
from my_pkg.engine.patches import model_runner, model_runner_v2, runner_hooks

EOS = 2
SPECIAL = (0, 1, 2, 3, 128000, 128001, 128009)  # what a controller typically pins: EOS and special ids
EXTRA_STOP = 4242
VOCAB, HIDDEN = 128256, 64


def _params(extra_stop: bool):
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.7, top_p=0.9, max_tokens=64, stop_token_ids=[EXTRA_STOP] if extra_stop else None
    )
    params.update_from_generation_config({"eos_token_id": [EOS, 128009]}, eos_token_id=EOS)
    return params


def _controller_like() -> SimpleNamespace:
    return SimpleNamespace(pinned_ids=SPECIAL)


def v1_step(num_requests: int, *, shared: bool, extra: bool) -> Callable[[], object]:
    """One V1 step: `model_runner.step_rows` over an `InputBatch` stand-in, then the pins lookup."""
    batch = SimpleNamespace(
        num_reqs=num_requests,
        req_id_to_index={f"r{i}": i for i in range(num_requests)},
        temperature_cpu=np.full(num_requests, 0.7, dtype=np.float32),
        logitsprocs=SimpleNamespace(all=[]),
    )
    if shared:
        runner_hooks.share_pinned_ids(batch, _controller_like())
    plain, with_extra = _params(False), _params(True)
    for i in range(num_requests):
        params = with_extra if extra and i == num_requests // 2 else plain
        model_runner._track(batch, SimpleNamespace(req_id=f"r{i}", sampling_params=params))
    pins, weight = PinnedRows(SPECIAL, (0, VOCAB)), torch.zeros(VOCAB, HIDDEN)

    def step() -> object:
        rows = model_runner.step_rows(batch)
        return pins.get(rows.stop_ids, weight)

    return step


def v2_step(num_requests: int, *, shared: bool, extra: bool) -> Callable[[], object]:
    """One V2 step: `model_runner_v2.step_rows` over a `Sampler` and `InputBatch` stand-in, then the pins."""
    slots = num_requests + 8
    sampler = SimpleNamespace(
        sampling_states=SimpleNamespace(max_num_reqs=slots, temperature=SimpleNamespace(np=np.full(slots, 0.7))),
        logits_processors=(),
    )
    if shared:
        runner_hooks.share_pinned_ids(sampler, _controller_like())
    plain, with_extra = _params(False), _params(True)
    for slot in range(num_requests):
        model_runner_v2.track(sampler, slot, with_extra if extra and slot == num_requests // 2 else plain)
    batch = SimpleNamespace(
        num_reqs=num_requests,
        idx_mapping_np=np.arange(num_requests, dtype=np.int32)[::-1].copy(),
        cu_num_logits_np=np.arange(num_requests + 1, dtype=np.int32),
    )
    pins, weight = PinnedRows(SPECIAL, (0, VOCAB)), torch.zeros(VOCAB, HIDDEN)

    def step() -> object:
        rows = model_runner_v2.step_rows(sampler, batch)
        return pins.get(rows.stop_ids, weight)

    return step


def time_step(step: Callable[[], object], steps: int, rounds: int) -> tuple[float, float, float]:
    """Median, lowest and highest microseconds per step over `rounds` rounds of `steps` calls."""
    step()
    per_round = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        per_round.append((time.perf_counter() - t0) / steps * 1e6)
    return statistics.median(per_round), min(per_round), max(per_round)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256, help="running requests (rows per step)")
    ap.add_argument("--steps", type=int, default=5000, help="steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    print(machine_description())
    print(f"{args.requests} running requests, {args.rounds} rounds of {args.steps} steps; microseconds per step")
    print("| runner | base ids | requests with an extra stop id | median µs/step | spread |")
    print("|---|---|---:|---:|---:|")
    for runner, make in (("V1", v1_step), ("V2", v2_step)):
        for shared in (False, True):
            for extra in (False, True):
                step = make(args.requests, shared=shared, extra=extra)
                median, low, high = time_step(step, args.steps, args.rounds)
                print(
                    f"| {runner} | {'shared' if shared else 'unknown'} | {1 if extra else 0} | "
                    f"{median:.1f} | {low:.1f}..{high:.1f} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
