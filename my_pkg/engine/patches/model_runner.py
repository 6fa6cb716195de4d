"""Tell the FlashHead logits processor which logits call is a decode step, and what its rows want (V1).

Installed with every FlashHead hook (`patches.on_flashhead_model`). Hooks vLLM's V1 model runner
(`GPUModelRunner`, which the CPU runner subclasses) and its `InputBatch`:

- `InputBatch.add_request` / `remove_request` keep, per request that needs exact dense logits
  (logprobs, grammar, logit bias, ...), the reason, and per request the ids vLLM stops it on
  (`all_stop_token_ids`: the tokenizer's EOS included), scored exactly on every row.
- `GPUModelRunner.execute_model` arms the controller for its one `compute_logits` call over the
  batch's rows; any other logits call (warm-up, prompt logprobs in `sample_tokens`, a drafter)
  finds it disarmed and stays dense.
- `load_model` (`GPUModelRunner`'s and `CPUModelRunner`'s own) builds the head right after the
  weights load (`runner_hooks.prepare_after_load`).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from my_pkg.engine.flashhead.rows import DenseReason, StepRows
from my_pkg.engine.patches.runner_hooks import (
    WRAPPED,
    classify,
    controller_of_runner,
    hook_load_model,
    require,
    run_armed,
    union_stop_ids,
    warn_once,
)

TARGET = "vllm.v1.worker.gpu_model_runner.GPUModelRunner, vllm.v1.worker.gpu_input_batch.InputBatch"
_DENSE_TABLE = "_my_pkg_dense_requests"
_STOP_TABLE = "_my_pkg_stop_token_ids"
_BUILTIN_LOGITS_PROCESSORS = ("MinPLogitsProcessor", "LogitBiasLogitsProcessor", "MinTokensLogitsProcessor")


def _has_custom_logits_processors(input_batch: Any) -> bool:
    processors = getattr(getattr(input_batch, "logitsprocs", None), "all", ())
    return any(type(p).__name__ not in _BUILTIN_LOGITS_PROCESSORS for p in processors)


def step_rows(input_batch: Any) -> StepRows:
    """What each row of the current batch needs, from the V1 `InputBatch`."""
    num_rows = input_batch.num_reqs
    index_of = input_batch.req_id_to_index
    codes = np.zeros(num_rows, dtype=np.uint8)
    if _has_custom_logits_processors(input_batch):
        codes[:] = DenseReason.CUSTOM_LOGITS_PROCESSORS
    else:
        table: dict[str, int] = input_batch.__dict__.get(_DENSE_TABLE) or {}
        for req_id, code in table.items():  # only the requests that need dense rows
            row = index_of.get(req_id)
            if row is not None and row < num_rows:
                codes[row] = code
    stops: dict[str, tuple[int, ...]] = input_batch.__dict__.get(_STOP_TABLE) or {}
    in_step = (ids for req_id, ids in stops.items() if (row := index_of.get(req_id)) is not None and row < num_rows)
    # Seeded rows are sampled rows too: FlashHead's logits draw nothing at random, so the seed reproduces.
    sampled = np.asarray(input_batch.temperature_cpu[:num_rows]) > 0.0
    return StepRows(dense_codes=codes, sampled=sampled, stop_ids=union_stop_ids(in_step))


def _track(input_batch: Any, request: Any) -> None:
    """Record why `request` needs dense rows, if it does, and the ids vLLM stops it on."""
    code, stop_ids = classify(getattr(request, "sampling_params", None))
    table = input_batch.__dict__.setdefault(_DENSE_TABLE, {})
    if code:
        table[request.req_id] = code
    else:
        table.pop(request.req_id, None)
    stops = input_batch.__dict__.setdefault(_STOP_TABLE, {})
    if stop_ids:
        stops[request.req_id] = stop_ids
    else:
        stops.pop(request.req_id, None)


def apply() -> None:
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    require(
        (InputBatch, "add_request"),
        (InputBatch, "remove_request"),
        (GPUModelRunner, "execute_model"),
        (GPUModelRunner, "load_model"),
    )
    try:  # the CPU runner loads its model without calling GPUModelRunner.load_model
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except ImportError:
        CPUModelRunner = None
    for runner_class in (GPUModelRunner, CPUModelRunner):
        if runner_class is not None:
            hook_load_model(runner_class)

    original_add = InputBatch.add_request
    original_remove = InputBatch.remove_request
    original_execute = GPUModelRunner.execute_model

    @functools.wraps(original_add)
    def add_request(self, request, *args, **kwargs):
        result = original_add(self, request, *args, **kwargs)
        try:
            _track(self, request)
        except Exception as exc:  # noqa: BLE001 - vLLM's bookkeeping already happened; never raise into it
            warn_once("add_request", exc)
        return result

    @functools.wraps(original_remove)
    def remove_request(self, req_id, *args, **kwargs):
        try:
            for name in (_DENSE_TABLE, _STOP_TABLE):
                table = self.__dict__.get(name)
                if table:
                    table.pop(req_id, None)
        except Exception as exc:  # noqa: BLE001
            warn_once("remove_request", exc)
        return original_remove(self, req_id, *args, **kwargs)

    @functools.wraps(original_execute)
    def execute_model(self, *args, **kwargs):
        try:
            controller = controller_of_runner(self)
        except Exception:  # noqa: BLE001 - without a controller the step is simply dense
            controller = None
        return run_armed(
            controller, lambda: step_rows(self.input_batch), lambda: original_execute(self, *args, **kwargs)
        )

    for owner, name, hook in (
        (InputBatch, "add_request", add_request),
        (InputBatch, "remove_request", remove_request),
        (GPUModelRunner, "execute_model", execute_model),
    ):
        if not getattr(getattr(owner, name), WRAPPED, False):  # applying twice wraps once
            setattr(hook, WRAPPED, True)
            setattr(owner, name, hook)
