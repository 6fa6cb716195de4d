"""Which rows of a decode step FlashHead may serve: request classification and the step's rows.

A request is classified once, when the model runner takes it in, from its own
`SamplingParams`; the per-step hooks (`patches/model_runner.py`,
`patches/model_runner_v2.py`) turn those classes into a `StepRows`. Imports
numpy only; vLLM objects reach it as plain arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np


class DenseReason(IntEnum):
    """Why a row is served by the dense head; the value is the row's code in `StepRows.dense_codes`
    (0, no member, means FlashHead may serve it) and `label` the key of its counter."""

    LOGPROBS = 1
    STRUCTURED_OUTPUT = 2
    LOGIT_BIAS = 3
    ALLOWED_TOKEN_IDS = 4
    BAD_WORDS = 5
    CUSTOM_LOGITS_PROCESSORS = 6
    UNCLASSIFIED = 7
    THINKING_BUDGET = 8
    WATERMARK = 9
    OPT_OUT = 10

    @property
    def label(self) -> str:
        return self.name.lower()


#: `SamplingParams` fields that need exact dense logits when a request sets them, checked in this order.
DENSE_REQUEST_FIELDS: dict[str, DenseReason] = {
    "logprobs": DenseReason.LOGPROBS,
    "logprob_token_ids": DenseReason.LOGPROBS,
    "structured_outputs": DenseReason.STRUCTURED_OUTPUT,
    "logit_bias": DenseReason.LOGIT_BIAS,
    "allowed_token_ids": DenseReason.ALLOWED_TOKEN_IDS,
    "bad_words": DenseReason.BAD_WORDS,
    "thinking_token_budget": DenseReason.THINKING_BUDGET,
    "watermarking": DenseReason.WATERMARK,
}
#: `SamplingParams` fields FlashHead serves as they are: vLLM's sampler, penalties and stop
#: handling run on the candidates' exact logits, or the field does not touch logits at all.
#: Prompt logprobs come from a separate logits call over the prompt, which is always dense:
#: the request's generated tokens can still use FlashHead.
FLASHHEAD_REQUEST_FIELDS = frozenset({
    "prompt_logprobs", "prompt_logprob_token_ids",
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens",
    "prompt_logprob_start", "flat_logprobs", "detokenize", "skip_special_tokens",
    "spaces_between_special_tokens", "include_stop_str_in_output", "output_kind", "stream_interval",
    "skip_clone", "output_text_buffer_length", "extra_args", "skip_reading_prefix_cache",
    "repetition_detection", "routed_experts_prompt_start", "trace_decode_token_ids",
})
#: `vllm_xargs` key a request sets to false to be served by the dense head.
OPT_OUT_ARG = "flashhead"


def _request_fields(sampling_params: Any) -> tuple[str, ...]:
    """Public fields of vLLM's `SamplingParams` (a msgspec Struct), derived from the class."""
    fields = getattr(type(sampling_params), "__struct_fields__", None) or tuple(vars(sampling_params))
    return tuple(name for name in fields if not name.startswith("_"))


def _is_set(value: Any, default: Any) -> bool:
    if value is None or value is False:
        return False
    if isinstance(value, (list, tuple, dict, set, frozenset)) and not value:
        return False
    return value != default


def _is_off(value: Any) -> bool:
    """`false` as a request's `vllm_xargs` value can spell it (vLLM types them str | int | float)."""
    if isinstance(value, str):
        return value.strip().lower() in ("false", "0", "no", "off")
    return value is not None and value == 0


_DEFAULTS: dict[type, Any] = {}


def _default_of(sampling_params: Any) -> Any:
    cls = type(sampling_params)
    if cls not in _DEFAULTS:
        _DEFAULTS[cls] = cls()
    return _DEFAULTS[cls]


def request_dense_reason(sampling_params: Any) -> DenseReason | None:
    """The reason a request needs exact dense logits, or None when FlashHead may serve it.

    Derived from the request's own `SamplingParams`: a field that needs dense
    logits (`DENSE_REQUEST_FIELDS`) and is set, a `vllm_xargs` opt-out, or any
    field this plugin does not know (a newer vLLM) set to a non-default value
    makes the request dense.
    """
    if sampling_params is None:
        return None
    default = _default_of(sampling_params)
    for name, reason in DENSE_REQUEST_FIELDS.items():
        if _is_set(getattr(sampling_params, name, None), getattr(default, name, None)):
            return reason
    extra_args = getattr(sampling_params, "extra_args", None) or {}
    if _is_off(extra_args.get(OPT_OUT_ARG)):
        return DenseReason.OPT_OUT
    for name in _request_fields(sampling_params):
        if name in DENSE_REQUEST_FIELDS or name in FLASHHEAD_REQUEST_FIELDS:
            continue
        if _is_set(getattr(sampling_params, name, None), getattr(default, name, None)):
            return DenseReason.UNCLASSIFIED
    return None


@dataclass
class StepRows:
    """What the model runner knows about the rows of one decode step."""

    dense_codes: np.ndarray  # uint8 [rows], 0 = FlashHead may serve the row
    sampled: np.ndarray  # bool [rows], True for rows that sample (temperature > 0)
    stop_ids: tuple[int, ...] = ()  # the step's requests' own stop_token_ids, scored exactly on every row

    @property
    def num_rows(self) -> int:
        return int(self.dense_codes.shape[0])
