"""Tell the FlashHead logits processor which logits call is a decode step, under vLLM's Model Runner V2.

Model Runner V2 (`vllm/v1/worker/gpu/`, vLLM's default on CUDA) keeps per-request
state in slots: a request holds one slot (`RequestState.req_id_to_index`) from
the step it joins until it leaves, and row `i` of a step belongs to slot
`InputBatch.idx_mapping_np[i]`. Installed with every FlashHead hook
(`patches.on_flashhead_model`); a FlashHead model is served through it when vLLM
picks V2 (`VllmConfig.use_v2_model_runner`). It hooks:

- `Sampler.add_request(slot, sampling_params)`, where V2 writes a joining
  request's sampling state into its slot: records, per slot, why the request
  needs exact dense logits (`request_dense_reason`, the same reasons as under
  V1) and the ids vLLM stops it on (`all_stop_token_ids`) beyond those the controller pins on every
  row anyway (shared with the sampler at `load_model` and every `sample`). Like V2's own sampler
  state, a slot is rewritten whenever a request takes it; a slot never classified is dense
  (`unclassified`).
- `GPUModelRunner.sample`, which computes the logits of the step's rows with
  one `compute_logits` call and samples them: the controller is armed for that
  call only. Prompt logprobs (computed after `sample`), warm-up and profiling
  calls find it disarmed and stay dense; so does batch-sharded sampling, whose
  logits call skips the gather.
- `GPUModelRunner.load_model`, to build the head right after the weights load
  (`runner_hooks.prepare_after_load`).

Under speculative decoding a request with `n` drafts has `n + 1` logits rows, laid out as under V1:
verify rows served as the table of docs/flashhead-serving.md says (each row as without speculation), read
from V2's host `cu_num_logits_np` and `num_draft_tokens_per_req` (`spec_rows`). V2's adaptive
verification reallocates drafts on the device only, so its steps are dense (`speculative_verify`, and
`spec.verify.reason_code: "model_runner_v2"`). V2's drafters keep their dense heads.

Rows are sampled when their slot's temperature in V2's `SamplingStates` is
above 0; FlashHead's logits for them are deterministic, so a request's `seed`
still reproduces its text. The model state's `custom_sampler`
extension point is not used: the sampler receives the logits after they are
computed, too late to choose the head, and replacing it turns off V2's
rejection sampler and watermark checks.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from my_pkg.engine.flashhead.rows import DenseReason, StepRows
from my_pkg.engine.flashhead.spec import without_verify
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

TARGET = "vllm.v1.worker.gpu.model_runner.GPUModelRunner, vllm.v1.worker.gpu.sample.sampler.Sampler"
#: What the hooks rely on beyond their imports (`my_pkg.devtools.compat` checks it): the wrapped methods'
#: leading parameters, and what is read on the runner, the sampler, its slot states and the input batch.
VLLM_SYMBOLS = (
    symbol(
        "vllm.v1.worker.gpu.model_runner:GPUModelRunner.sample",
        "method",
        params=("self", "hidden_states", "input_batch"),
    ),
    symbol("vllm.v1.worker.gpu.model_runner:GPUModelRunner.load_model", "method", params=("self",)),
    *attributes(
        "vllm.v1.worker.gpu.model_runner:GPUModelRunner",
        "sampler",
        "batch_sharder",
        "speculative_config",
        "adaptive_verification",
        "model_state",
    ),
    *attributes("vllm.v1.worker.gpu.model_states.interface:ModelState", "num_new_sampled_tokens_per_step"),
    symbol(
        "vllm.v1.worker.gpu.sample.sampler:Sampler.add_request",
        "method",
        params=("self", "req_idx", "sampling_params"),
    ),
    *attributes("vllm.v1.worker.gpu.sample.sampler:Sampler", "sampling_states", "logits_processors"),
    *attributes("vllm.v1.worker.gpu.sample.states:SamplingStates", "max_num_reqs", "temperature"),
    *attributes("vllm.v1.worker.gpu.buffer_utils:UvaBackedTensor", "np"),
    *attributes(
        "vllm.v1.worker.gpu.input_batch:InputBatch",
        "num_reqs",
        "idx_mapping_np",
        "cu_num_logits_np",
        "num_draft_tokens",
        "num_draft_tokens_per_req",
    ),
    symbol("vllm.v1.worker.gpu.sample.logit_bias:LogitBiasState", "class"),
    symbol("vllm.v1.worker.gpu.sample.penalties:PenaltiesState", "class"),
    symbol("vllm.v1.worker.gpu.sample.bad_words:BadWordsState", "class"),
)
_DENSE_TABLE = "_my_pkg_dense_slots"
_STOP_TABLE = "_my_pkg_stop_token_ids"
_BUILTIN_LOGITS_PROCESSORS = ("LogitBiasState", "PenaltiesState", "BadWordsState")
_UNCLASSIFIED = int(DenseReason.UNCLASSIFIED)


def _has_custom_logits_processors(sampler: Any) -> bool:
    processors = getattr(sampler, "logits_processors", ())
    return any(type(p).__name__ not in _BUILTIN_LOGITS_PROCESSORS for p in processors)


def track(sampler: Any, slot: int, sampling_params: Any) -> None:
    """Record what the request now holding `slot` needs (unclassifiable: dense)."""
    code, stop_ids = classify(sampling_params, shared_pinned_ids(sampler))
    table: np.ndarray | None = sampler.__dict__.get(_DENSE_TABLE)
    if table is None:
        table = np.full(int(sampler.sampling_states.max_num_reqs), _UNCLASSIFIED, dtype=np.uint8)
        sampler.__dict__[_DENSE_TABLE] = table
    table[slot] = code
    stops: dict[int, tuple[int, ...]] = sampler.__dict__.setdefault(_STOP_TABLE, {})
    if stop_ids:
        stops[int(slot)] = stop_ids
    else:
        stops.pop(int(slot), None)


def forget(sampler: Any) -> None:
    """Drop what was recorded: every row is dense (`unclassified`) until its request is classified again."""
    sampler.__dict__.pop(_DENSE_TABLE, None)
    sampler.__dict__.pop(_STOP_TABLE, None)


def request_rows(sampler: Any, input_batch: Any) -> StepRows:
    """What each request of the step needs, in batch order, from V2's `InputBatch` and the sampler's slot state."""
    num_reqs = int(input_batch.num_reqs)
    slots = np.asarray(input_batch.idx_mapping_np[:num_reqs], dtype=np.intp)
    table: np.ndarray | None = sampler.__dict__.get(_DENSE_TABLE)
    if _has_custom_logits_processors(sampler):
        codes = np.full(num_reqs, DenseReason.CUSTOM_LOGITS_PROCESSORS, dtype=np.uint8)
    elif table is None:
        codes = np.full(num_reqs, _UNCLASSIFIED, dtype=np.uint8)
    else:
        codes = table[slots]
    states = sampler.sampling_states
    sampled = states.temperature.np[slots] > 0.0
    stops: dict[int, tuple[int, ...]] = sampler.__dict__.get(_STOP_TABLE) or {}
    stop_ids = ()
    if stops:  # only the slots whose request has stop ids beyond the pinned ones (some may have left)
        in_step = set(slots.tolist())
        stop_ids = union_stop_ids(ids for slot, ids in stops.items() if slot in in_step)
    return StepRows(dense_codes=codes, sampled=sampled, stop_ids=stop_ids)


def _logits_per_request(input_batch: Any, num_reqs: int) -> np.ndarray:
    return np.diff(np.asarray(input_batch.cu_num_logits_np[: num_reqs + 1], dtype=np.int64))


def step_rows(sampler: Any, input_batch: Any) -> StepRows:
    """What each logits row of the step needs: its request's code, once per row the request has."""
    rows = request_rows(sampler, input_batch)
    logits_per_request = _logits_per_request(input_batch, rows.num_rows)
    if np.all(logits_per_request == 1):
        return rows
    return StepRows(  # a request with several (or no) logits rows this step
        dense_codes=np.repeat(rows.dense_codes, logits_per_request),
        sampled=np.repeat(rows.sampled, logits_per_request),
        stop_ids=rows.stop_ids,
    )


def spec_rows(runner: Any, sampler: Any, input_batch: Any) -> StepRows:
    """The rows of a step under speculative decoding. A request with `n` drafts has `n + 1` logits rows
    (`cu_num_logits_np`): its verify rows, then its bonus row, as under V1 (`runner_hooks.spec_step_rows`),
    each served as without speculation. Steps V2 lays out on the device only (adaptive verification, several
    new tokens per step) are served dense."""
    rows = request_rows(sampler, input_batch)
    num_reqs = rows.num_rows
    drafts = getattr(input_batch, "num_draft_tokens_per_req", None)
    if drafts is None or int(input_batch.num_draft_tokens) == 0:
        return step_rows(sampler, input_batch)
    if getattr(runner, "adaptive_verification", None) is not None:
        _refuse_verify(runner, "adaptive verification reallocates the drafts on the device only")
        return StepRows(rows.dense_codes, rows.sampled, rows.stop_ids, all_dense="speculative_verify")
    if _new_tokens_per_step(runner) != 1:
        _refuse_verify(runner, "the model state samples several new tokens per step")
        return StepRows(rows.dense_codes, rows.sampled, rows.stop_ids, all_dense="speculative_verify")
    drafts = np.asarray(drafts[:num_reqs], dtype=np.int64)
    if drafts.shape != (num_reqs,) or not np.array_equal(_logits_per_request(input_batch, num_reqs), drafts + 1):
        return StepRows(rows.dense_codes, rows.sampled, rows.stop_ids, all_dense="unexpected_rows")
    return spec_step_rows(rows, drafts)


def _new_tokens_per_step(runner: Any) -> int:
    return int(getattr(getattr(runner, "model_state", None), "num_new_sampled_tokens_per_step", 1))


def _refuse_verify(runner: Any, why: str) -> None:
    """Show in the status that this server's verify rows are dense, and `why` (once; its steps say so by their
    count)."""
    controller = controller_of_runner(runner)
    if controller is not None and controller.spec is not None and controller.spec.verify.active:
        controller.spec = without_verify(controller.spec, "model_runner_v2", why)


def runner_step_rows(runner: Any, sampler: Any, input_batch: Any) -> StepRows:
    """The rows of the runner's current step: one per logits row, or the speculative-decoding layout."""
    if getattr(runner, "speculative_config", None) is None:
        return step_rows(sampler, input_batch)
    return spec_rows(runner, sampler, input_batch)


def apply() -> None:
    """Hook V2's `Sampler.add_request`, `GPUModelRunner.sample` and `load_model`; raises, changing nothing,
    if one is missing."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    require((Sampler, "add_request"), (GPUModelRunner, "sample"), (GPUModelRunner, "load_model"))
    hook_load_model(GPUModelRunner, "sampler")

    original_add = Sampler.add_request
    original_sample = GPUModelRunner.sample

    @functools.wraps(original_add)
    def add_request(self, req_idx, sampling_params, *args, **kwargs):
        result = original_add(self, req_idx, sampling_params, *args, **kwargs)
        try:
            track(self, req_idx, sampling_params)
        except Exception as exc:  # noqa: BLE001 - vLLM's bookkeeping already happened; never raise into it
            forget(self)
            warn_once("V2 Sampler.add_request", exc)
        return result

    @functools.wraps(original_sample)
    def sample(self, hidden_states, input_batch, *args, **kwargs):
        try:
            controller = controller_of_runner(self)
            if getattr(self, "batch_sharder", None) is not None:
                controller = None
            sampler = self.sampler
        except Exception:  # noqa: BLE001 - without a controller the step is simply dense
            controller = None
        try:  # requests joining from the next step on leave the pinned ids out
            share_pinned_ids(self.sampler, controller)
        except Exception as exc:  # noqa: BLE001 - requests then carry every stop id
            warn_once("V2 GPUModelRunner.sample", exc)
        return run_armed(
            controller,
            lambda: runner_step_rows(self, sampler, input_batch),
            lambda: original_sample(self, hidden_states, input_batch, *args, **kwargs),
        )

    wrap_once(Sampler, "add_request", add_request)
    wrap_once(GPUModelRunner, "sample", sample)
