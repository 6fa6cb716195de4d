"""Tell the FlashHead logits processor which logits call is a decode step, and what its rows want.

Applied only when a FlashHead model is built. Hooks vLLM's V1 model runner
(`GPUModelRunner`, which the CPU runner subclasses) and its `InputBatch`:

- `InputBatch.add_request` / `remove_request` keep, per request that needs exact
  dense logits (logprobs, grammar, logit bias, ...), the reason, and per request
  with `stop_token_ids` of its own, those ids (scored exactly on every row);
  other requests are not tracked, so a step costs nothing per plain request.
- `GPUModelRunner.execute_model` arms the controller for its one
  `compute_logits` call over the batch's rows; any other logits call (warm-up,
  prompt logprobs in `sample_tokens`, a drafter) finds it disarmed and stays dense.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import numpy as np

from my_pkg.engine.flashhead_control import controller_of_runner
from my_pkg.engine.request_rows import DenseReason, StepRows, request_dense_reason

logger = logging.getLogger(f"vllm.{__name__}")

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
    codes = np.zeros(num_rows, dtype=np.uint8)
    if _has_custom_logits_processors(input_batch):
        codes[:] = DenseReason.CUSTOM_LOGITS_PROCESSORS
    else:
        table: dict[str, int] = input_batch.__dict__.get(_DENSE_TABLE) or {}
        index_of = input_batch.req_id_to_index
        for req_id, code in table.items():  # only the requests that need dense rows
            row = index_of.get(req_id)
            if row is not None and row < num_rows:
                codes[row] = code
    stop_ids: set[int] = set()
    stops: dict[str, tuple[int, ...]] = input_batch.__dict__.get(_STOP_TABLE) or {}
    for req_id, ids in stops.items():  # only the requests with stop_token_ids of their own
        row = input_batch.req_id_to_index.get(req_id)
        if row is not None and row < num_rows:
            stop_ids.update(ids)
    # Seeded rows are sampled rows too: FlashHead's logits draw nothing at random, so the seed reproduces.
    sampled = np.asarray(input_batch.temperature_cpu[:num_rows]) > 0.0
    return StepRows(dense_codes=codes, sampled=sampled, stop_ids=tuple(sorted(stop_ids)))


def _track(input_batch: Any, request: Any) -> None:
    """Record why `request` needs dense rows, if it does (unclassifiable: dense)."""
    try:
        reason = request_dense_reason(getattr(request, "sampling_params", None))
    except Exception:  # noqa: BLE001 - an odd request is served dense, never an error
        reason = DenseReason.UNCLASSIFIED
    table = input_batch.__dict__.setdefault(_DENSE_TABLE, {})
    if reason is None:
        table.pop(request.req_id, None)
    else:
        table[request.req_id] = int(reason)
    stop_ids = tuple(getattr(getattr(request, "sampling_params", None), "stop_token_ids", None) or ())
    stops = input_batch.__dict__.setdefault(_STOP_TABLE, {})
    if stop_ids:
        stops[request.req_id] = stop_ids
    else:
        stops.pop(request.req_id, None)


_warned: set[str] = set()


def _warn_once(hook: str, exc: BaseException) -> None:
    if hook not in _warned:
        _warned.add(hook)
        logger.warning("my_pkg: %s hook failed (%s: %s); vLLM's own behaviour kept", hook,
                       type(exc).__name__, exc, exc_info=exc)


def apply() -> None:
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for owner, name in ((InputBatch, "add_request"), (InputBatch, "remove_request"), (GPUModelRunner, "execute_model")):
        if not callable(getattr(owner, name, None)):
            raise AttributeError(f"{owner.__module__}.{owner.__qualname__}.{name} is missing")
    if getattr(GPUModelRunner.execute_model, "_my_pkg_wrapped", False):
        return

    original_add = InputBatch.add_request
    original_remove = InputBatch.remove_request
    original_execute = GPUModelRunner.execute_model

    @functools.wraps(original_add)
    def add_request(self, request, *args, **kwargs):
        result = original_add(self, request, *args, **kwargs)
        try:
            _track(self, request)
        except Exception as exc:  # noqa: BLE001 - vLLM's bookkeeping already happened; never raise into it
            _warn_once("add_request", exc)
        return result

    @functools.wraps(original_remove)
    def remove_request(self, req_id, *args, **kwargs):
        try:
            for name in (_DENSE_TABLE, _STOP_TABLE):
                table = self.__dict__.get(name)
                if table:
                    table.pop(req_id, None)
        except Exception as exc:  # noqa: BLE001
            _warn_once("remove_request", exc)
        return original_remove(self, req_id, *args, **kwargs)

    @functools.wraps(original_execute)
    def execute_model(self, *args, **kwargs):
        try:
            controller = controller_of_runner(self)
        except Exception:  # noqa: BLE001 - without a controller the step is simply dense
            controller = None
        if controller is None:
            return original_execute(self, *args, **kwargs)
        controller.arm(lambda: step_rows(self.input_batch))
        try:
            return original_execute(self, *args, **kwargs)
        finally:
            controller.disarm()

    execute_model._my_pkg_wrapped = True  # type: ignore[attr-defined]
    InputBatch.add_request = add_request
    InputBatch.remove_request = remove_request
    GPUModelRunner.execute_model = execute_model
