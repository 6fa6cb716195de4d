"""Draw FlashHead's compact sampled rows inside vLLM's V1 sampler (`my_pkg.engine.flashhead.compact_step`).

Installed with every FlashHead hook (`patches.on_flashhead_model`). A decode step whose FlashHead controller
planned compact rows returns, for those rows, a placeholder row (exact on their exact set, `-inf` elsewhere), and
vLLM's sampler processes it as any row (min_tokens, temperature, min_p). Two hooks then draw them:

- `GPUModelRunner._sample` (class level): when the controller holds a plan for the very tensor `_sample` got (the
  logits `compute_logits` returned, compared by identity) and the step is not speculative, the plan is made active
  on the runner's `TopKTopPSampler` for the duration of the call; any other call runs as vLLM's.
- `TopKTopPSampler.forward` (per instance: vLLM binds it in `__init__`): with an active plan, the compact rows are
  drawn from the compact law with seeds drawn as vLLM's `forward_cpu` draws them (one `randint` from the row's
  generator, so a seeded request consumes its generator as before; vLLM's CPU noise on the exact tokens), greedy
  rows are skipped (vLLM overwrites them with the argmax), and every other row goes to vLLM's own `forward` on a
  sub-batch.

Rows qualify only where the sampler is vLLM's CPU one (`forward_cpu`), returns no processed logprobs and draws
float32 noise (`usable`); the model runner's hooks ask before planning any. A draw that raises is counted, logged
once, and vLLM's own `forward` serves the whole call (the rows' generators restored first); a plan that no call
takes is counted (`unmatched_rows`). Neither ever raises into vLLM.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import numpy as np
import torch

from my_pkg.engine.flashhead import compact_step
from my_pkg.engine.patches.runner_hooks import controller_of_runner, require, warn_once, wrap_once
from my_pkg.engine.vllm_uses import attributes, symbol

TARGET = "vllm.v1.worker.gpu_model_runner.GPUModelRunner._sample, vllm.v1.sample.ops.topk_topp_sampler.TopKTopPSampler"
#: What the hooks rely on beyond their imports (`my_pkg.devtools.compat` checks it).
VLLM_SYMBOLS = (
    symbol(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample",
        "method",
        params=("self", "logits", "spec_decode_metadata"),
    ),
    *attributes("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "sampler"),
    *attributes("vllm.v1.sample.sampler:Sampler", "topk_topp_sampler"),
    symbol(
        "vllm.v1.sample.ops.topk_topp_sampler:TopKTopPSampler.forward_cpu",
        "method",
        params=("self", "logits", "generators", "k", "p"),
    ),
    *attributes("vllm.v1.sample.ops.topk_topp_sampler:TopKTopPSampler", "logprobs_mode", "use_fp64_gumbel"),
)

logger = logging.getLogger(f"vllm.{__name__}")

#: Where the active `(plan, controller)` sits on the `TopKTopPSampler` instance during `_sample`.
_ACTIVE = "_my_pkg_compact_plan"
_warned = False


def _sampler_of(runner: Any) -> Any:
    return getattr(getattr(runner, "sampler", None), "topk_topp_sampler", None)


def usable(runner: Any) -> bool:
    """Whether the runner's sampler can draw compact rows: vLLM's CPU `forward_cpu` (wrapped here on first use),
    raw logprobs, float32 noise. Never raises."""
    try:
        sampler = _sampler_of(runner)
        if sampler is None or getattr(sampler, "use_fp64_gumbel", True):
            return False
        if getattr(sampler, "logprobs_mode", None) != "raw_logprobs":
            return False
        forward = sampler.__dict__.get("forward")
        if getattr(forward, "_my_pkg_wrapped", False):
            return True
        if getattr(forward, "__func__", None) is not type(sampler).forward_cpu:
            return False
        _wrap_forward(sampler, forward)
        return True
    except Exception as exc:  # noqa: BLE001 - no compact rows then
        warn_once("compact_sampler", exc)
        return False


def _wrap_forward(sampler: Any, original: Any) -> None:
    @functools.wraps(original)
    def forward(logits, generators, k, p):
        active = sampler.__dict__.get(_ACTIVE)
        if active is None:
            return original(logits, generators, k, p)
        return _draw_step(original, *active, logits, generators, k, p)

    forward._my_pkg_wrapped = True  # type: ignore[attr-defined]
    sampler.forward = forward


def _draw_step(original, plan, controller, logits, generators, k, p):
    """The step's tokens: compact rows from their plan, greedy rows skipped, the others by vLLM's `forward`."""
    global _warned
    rows = plan.rows
    states = {int(row): generators[int(row)].get_state() for row in rows if int(row) in generators}
    try:
        seeds = torch.randint(0, 2**31, (rows.size,), dtype=torch.long)
        for i, row in enumerate(rows.tolist()):
            if row in generators:
                seeds[i] = torch.randint(0, 2**31, (1,), generator=generators[row], dtype=torch.long).item()
        tokens = compact_step.draw(plan, logits, k, p, seeds, controller.counters.compact)
    except Exception as exc:  # noqa: BLE001 - vLLM's own draw serves the call
        for row, state in states.items():
            generators[row].set_state(state)
        controller.counters.compact["failed_rows"] += int(rows.size)
        if not _warned:
            _warned = True
            logger.warning(
                "my_pkg: compact draw failed (%s: %s); vLLM's sampler drew those rows (counted, logged once)",
                type(exc).__name__,
                exc,
                exc_info=exc,
            )
        return original(logits, generators, k, p)
    sampled = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    sampled[torch.from_numpy(rows)] = tokens.to(sampled.device)
    others = np.flatnonzero(plan.others)
    if others.size:
        index = torch.from_numpy(others)
        position = {int(row): i for i, row in enumerate(others)}
        sub_generators = {position[row]: gen for row, gen in generators.items() if row in position}
        sub_k = k.index_select(0, index) if k is not None else None
        sub_p = p.index_select(0, index) if p is not None else None
        part, _ = original(logits.index_select(0, index), sub_generators, sub_k, sub_p)
        sampled[index] = part
    return sampled, None


def apply() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    require((GPUModelRunner, "_sample"))
    original = GPUModelRunner._sample

    @functools.wraps(original)
    def _sample(self, logits, spec_decode_metadata, *args, **kwargs):
        sampler = None
        try:
            controller = controller_of_runner(self)
            if controller is not None and controller.compact.plan is not None:
                plan = controller.compact.take(logits) if spec_decode_metadata is None else None
                controller.compact.drop()
                sampler = _sampler_of(self) if plan is not None else None
                if sampler is not None:
                    sampler.__dict__[_ACTIVE] = (plan, controller)
        except Exception as exc:  # noqa: BLE001 - vLLM's sampler draws the step
            warn_once("_sample", exc)
        try:
            return original(self, logits, spec_decode_metadata, *args, **kwargs)
        finally:
            if sampler is not None:
                sampler.__dict__.pop(_ACTIVE, None)

    wrap_once(GPUModelRunner, "_sample", _sample)
