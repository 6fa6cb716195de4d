"""Tell the FlashHead logits processor which logits call is a decode step, and what its rows want (V1).

Installed with every FlashHead hook (`patches.on_flashhead_model`). Hooks vLLM's V1 model runner
(`GPUModelRunner`, which the CPU runner subclasses) and its `InputBatch`:

- `InputBatch.add_request` / `remove_request` keep, per request that needs exact dense logits
  (logprobs, grammar, logit bias, ...), the reason, and per request the ids vLLM stops it on
  (`all_stop_token_ids`: the tokenizer's EOS included), scored exactly on every row. Ids the controller
  pins on every row anyway (EOS, special tokens; shared with the batch by `execute_model` and `load_model`)
  are left out, so only requests with other stop ids are kept and a typical step looks at none of them.
- `GPUModelRunner.execute_model` arms the controller for its one `compute_logits` call over the
  batch's rows; any other logits call (warm-up, prompt logprobs in `sample_tokens`, a drafter)
  finds it disarmed and stays dense.
- `load_model` (`GPUModelRunner`'s and `CPUModelRunner`'s own) builds the head right after the
  weights load (`runner_hooks.prepare_after_load`).
- Speculative decoding: `GPUModelRunner._calc_spec_decode_metadata` is wrapped to keep, for the
  step, its host `num_draft_tokens` and the `SpecDecodeMetadata` it returns. A request with `n`
  drafts has `n + 1` consecutive logits rows (`n` verify rows, then the bonus row), so the step's
  rows are the requests' codes repeated (`spec_step_rows`), each served as without speculation. When the wrapper
  cannot be installed, speculative steps are served dense (`speculative_verify`), the rest of the
  hooks stay.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from my_pkg.engine.flashhead.rows import DenseReason, StepRows
from my_pkg.engine.patches import SPEC_METADATA_HOOK, compact_sampler, hook_error, record_hook_error
from my_pkg.engine.patches.runner_hooks import (
    classify,
    controller_of_runner,
    hook_load_model,
    require,
    run_armed,
    share_pinned_ids,
    shared_pinned_ids,
    spec_step_rows,
    union_stop_ids,
    warn_once,
    wrap_once,
)
from my_pkg.engine.vllm_uses import attributes, symbol

TARGET = "vllm.v1.worker.gpu_model_runner.GPUModelRunner, vllm.v1.worker.gpu_input_batch.InputBatch"
#: What the hooks rely on beyond their imports (`my_pkg.devtools.compat` checks it): the wrapped methods'
#: leading parameters, and what is read on the batch, the requests, the runner and the speculative metadata.
VLLM_SYMBOLS = (
    symbol("vllm.v1.worker.gpu_input_batch:InputBatch.add_request", "method", params=("self", "request")),
    symbol("vllm.v1.worker.gpu_input_batch:InputBatch.remove_request", "method", params=("self", "req_id")),
    *attributes(
        "vllm.v1.worker.gpu_input_batch:InputBatch",
        "num_reqs",
        "req_id_to_index",
        "temperature_cpu",
        "logitsprocs",
        "presence_penalties_cpu",
        "frequency_penalties_cpu",
        "repetition_penalties_cpu",
        "top_k_cpu",
        "top_p_cpu",
        "vocab_size",
    ),
    *attributes("vllm.v1.worker.gpu_input_batch:CachedRequestState", "req_id", "sampling_params"),
    *attributes("vllm.v1.sample.logits_processor.state:LogitsProcessors", "all"),
    symbol("vllm.v1.sample.logits_processor.builtin:MinPLogitsProcessor", "class"),
    *attributes("vllm.v1.sample.logits_processor.builtin:MinPLogitsProcessor", "min_p_cpu"),
    symbol("vllm.v1.sample.logits_processor.builtin:LogitBiasLogitsProcessor", "class"),
    symbol("vllm.v1.sample.logits_processor.builtin:MinTokensLogitsProcessor", "class"),
    symbol("vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model", "method", params=("self",)),
    symbol("vllm.v1.worker.gpu_model_runner:GPUModelRunner.load_model", "method", params=("self",)),
    *attributes("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "input_batch", "speculative_config"),
    symbol(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._calc_spec_decode_metadata",
        "method",
        params=("self", "num_draft_tokens", "cu_num_scheduled_tokens"),
    ),
    symbol(
        "vllm.v1.worker.cpu_model_runner:CPUModelRunner",
        "class",
        subclass_of="vllm.v1.worker.gpu_model_runner:GPUModelRunner",
    ),
    symbol("vllm.v1.worker.cpu_model_runner:CPUModelRunner.load_model", "method", params=("self",)),
)
_DENSE_TABLE = "_my_pkg_dense_requests"
_STOP_TABLE = "_my_pkg_stop_token_ids"
_BUILTIN_LOGITS_PROCESSORS = ("MinPLogitsProcessor", "LogitBiasLogitsProcessor", "MinTokensLogitsProcessor")
#: Where the step's `(num_draft_tokens, SpecDecodeMetadata)` is kept on the runner, cleared every step.
_SPEC_STASH = "_my_pkg_spec_step"
#: The sampler hook that draws compact rows (`compact_sampler.py`): without it no row is compact.
COMPACT_SAMPLER_HOOK = "compact_sampler"


def spec_hook_error() -> str | None:
    """Why speculative steps cannot be laid out (the metadata hook is not installed); None when they can."""
    return hook_error(SPEC_METADATA_HOOK)


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
    stop_ids = ()
    if stops:  # only the requests with stop ids beyond the pinned ones
        stop_ids = union_stop_ids(
            ids for req_id, ids in stops.items() if (row := index_of.get(req_id)) is not None and row < num_rows
        )
    temperature = np.asarray(input_batch.temperature_cpu[:num_rows], dtype=np.float32)
    sampled = temperature > 0.0
    min_p, compact, top_k_with_top_p = None, None, None
    try:
        min_p = _min_p(input_batch, num_rows)
        if min_p is not None and sampled.any():
            compact = sampled & (codes == 0) & _without_penalties(input_batch, num_rows)
            top_k_with_top_p = _top_k_with_top_p(input_batch, num_rows)
    except Exception as exc:  # noqa: BLE001 - no compact rows: vLLM's sampler draws them all
        warn_once("compact rows", exc)
        compact = None
    return StepRows(
        dense_codes=codes,
        sampled=sampled,
        stop_ids=stop_ids,
        compact=compact,
        temperature=temperature,
        min_p=min_p,
        top_k_with_top_p=top_k_with_top_p,
    )


def _min_p(input_batch: Any, num_rows: int) -> np.ndarray | None:
    """Each row's min_p, from vLLM's min-p logits processor (None when it cannot be read: no compact rows)."""
    for processor in getattr(getattr(input_batch, "logitsprocs", None), "all", ()):
        if type(processor).__name__ == "MinPLogitsProcessor":
            values = getattr(processor, "min_p_cpu", None)
            return None if values is None else np.asarray(values[:num_rows], dtype=np.float32)
    return None


def _top_k_with_top_p(input_batch: Any, num_rows: int) -> np.ndarray:
    """Rows with both a top_k (below the vocabulary, as vLLM stores none) and a top_p (below 1)."""
    top_k = np.asarray(input_batch.top_k_cpu[:num_rows])
    top_p = np.asarray(input_batch.top_p_cpu[:num_rows])
    return (top_k > 0) & (top_k < input_batch.vocab_size) & (top_p < 1.0)


def _without_penalties(input_batch: Any, num_rows: int) -> np.ndarray:
    """Rows with no presence, frequency or repetition penalty (vLLM would penalise only their exact tokens)."""
    return (
        (np.asarray(input_batch.presence_penalties_cpu[:num_rows]) == 0.0)
        & (np.asarray(input_batch.frequency_penalties_cpu[:num_rows]) == 0.0)
        & (np.asarray(input_batch.repetition_penalties_cpu[:num_rows]) == 1.0)
    )


def runner_step_rows(runner: Any) -> StepRows:
    """The rows of the runner's current step: one per request, or the speculative-decoding layout."""
    rows = step_rows(runner.input_batch)
    if rows.compact is not None and (
        hook_error(COMPACT_SAMPLER_HOOK) is not None or not compact_sampler.usable(runner)
    ):
        rows.compact = None
    speculative_config = getattr(runner, "speculative_config", None)
    if speculative_config is None:
        return rows
    if spec_hook_error() is not None:
        return StepRows(rows.dense_codes, rows.sampled, rows.stop_ids, all_dense="speculative_verify")
    stash = runner.__dict__.get(_SPEC_STASH)
    if stash is None:  # no metadata this step: one row per request, checked against the logits call
        return rows
    num_draft_tokens, _ = stash
    return spec_step_rows(rows, num_draft_tokens[: rows.num_rows])


def _track(input_batch: Any, request: Any) -> None:
    """Record why `request` needs dense rows, if it does, and the ids vLLM stops it on beyond the pinned ones."""
    code, stop_ids = classify(getattr(request, "sampling_params", None), shared_pinned_ids(input_batch))
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


def _hook_spec_metadata(runner_class: type) -> None:
    """Wrap `_calc_spec_decode_metadata` to keep its host inputs and its result for the step; a vLLM
    without it leaves speculative steps dense (`speculative_verify`) and the other hooks installed."""
    original = getattr(runner_class, "_calc_spec_decode_metadata", None)
    if not callable(original):
        record_hook_error(SPEC_METADATA_HOOK, f"{runner_class.__qualname__}._calc_spec_decode_metadata is missing")
        return

    @functools.wraps(original)
    def calc_spec_decode_metadata(self, num_draft_tokens, *args, **kwargs):
        result = original(self, num_draft_tokens, *args, **kwargs)
        try:
            self.__dict__[_SPEC_STASH] = (np.array(num_draft_tokens, dtype=np.int64), result)
        except Exception as exc:  # noqa: BLE001 - the step finds no stash and is checked by its row count
            warn_once("_calc_spec_decode_metadata", exc)
        return result

    wrap_once(runner_class, "_calc_spec_decode_metadata", calc_spec_decode_metadata)
    record_hook_error(SPEC_METADATA_HOOK, None)


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
            hook_load_model(runner_class, "input_batch")

    _hook_spec_metadata(GPUModelRunner)
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
            self.__dict__.pop(_SPEC_STASH, None)
            controller = controller_of_runner(self)
        except Exception:  # noqa: BLE001 - without a controller the step is simply dense
            controller = None
        try:  # before vLLM adds this step's requests to the batch (a new batch learns them here)
            batch = self.__dict__.get("input_batch")
            if batch is not None:
                share_pinned_ids(batch, controller)
        except Exception as exc:  # noqa: BLE001 - requests then carry every stop id
            warn_once("execute_model", exc)
        return run_armed(controller, lambda: runner_step_rows(self), lambda: original_execute(self, *args, **kwargs))

    wrap_once(InputBatch, "add_request", add_request)
    wrap_once(InputBatch, "remove_request", remove_request)
    wrap_once(GPUModelRunner, "execute_model", execute_model)
