"""Which rows of a decode step FlashHead may serve: request classification and the step's rows.

A request is classified once, when the model runner takes it in, from its own
`SamplingParams` (`request_dense_reason`, `request_stop_ids`); the per-step hooks
(`patches/runner_hooks.py`) turn those classes into a `StepRows`. Imports numpy,
the contract and the vLLM-free `vllm_uses` helper only; vLLM objects reach it as plain arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from my_pkg.contract import DenseReason
from my_pkg.engine.vllm_uses import attributes

__all__ = [
    "DENSE_REQUEST_FIELDS",
    "FLASHHEAD_REQUEST_FIELDS",
    "OPT_OUT_ARG",
    "DenseReason",
    "StepRows",
    "request_dense_reason",
    "request_stop_ids",
]

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
FLASHHEAD_REQUEST_FIELDS = frozenset(
    {
        "prompt_logprobs",
        "prompt_logprob_token_ids",
        "n",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "max_tokens",
        "min_tokens",
        "prompt_logprob_start",
        "flat_logprobs",
        "detokenize",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "output_kind",
        "stream_interval",
        "skip_clone",
        "output_text_buffer_length",
        "extra_args",
        "skip_reading_prefix_cache",
        "repetition_detection",
        "routed_experts_prompt_start",
        "trace_decode_token_ids",
    }
)
#: `vllm_xargs` key a request sets to false to be served by the dense head.
OPT_OUT_ARG = "flashhead"
#: The `SamplingParams` fields read by name here (`my_pkg.devtools.compat` checks them; a unit test keeps
#: `DENSE_REQUEST_FIELDS` among them).
VLLM_SYMBOLS = (
    *attributes(
        "vllm.sampling_params:SamplingParams",
        "logprobs",
        "logprob_token_ids",
        "structured_outputs",
        "logit_bias",
        "allowed_token_ids",
        "bad_words",
        "thinking_token_budget",
        "watermarking",
        "extra_args",
        "stop_token_ids",
        "all_stop_token_ids",
        "temperature",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ),
)


def _request_fields(sampling_params: Any) -> tuple[str, ...]:
    """Public fields of vLLM's `SamplingParams` (a msgspec Struct), derived from the class."""
    fields = getattr(type(sampling_params), "__struct_fields__", None) or tuple(vars(sampling_params))
    return tuple(name for name in fields if not name.startswith("_"))


#: vLLM treats a temperature below this as greedy (`vllm.sampling_params._SAMPLING_EPS`).
GREEDY_TEMPERATURE = 1e-5


def _is_penalized_greedy(sampling_params: Any) -> bool:
    """A greedy request whose penalties change which token wins. Its penalised argmax can sit outside the
    probed clusters (measured in docs/flashhead-serving.md), so it is served by the dense head."""
    if float(getattr(sampling_params, "temperature", 1.0) or 0.0) >= GREEDY_TEMPERATURE:
        return False
    return (
        abs(float(getattr(sampling_params, "presence_penalty", 0.0) or 0.0)) > 0.0
        or abs(float(getattr(sampling_params, "frequency_penalty", 0.0) or 0.0)) > 0.0
        or abs(float(getattr(sampling_params, "repetition_penalty", 1.0) or 1.0) - 1.0) > 0.0
    )


def _is_set(value: Any, default: Any) -> bool:
    """A dense-request field asks for something: not None, False or empty, and not its default."""
    if value is None or value is False:
        return False
    if isinstance(value, (list, tuple, dict, set, frozenset)) and not value:
        return False
    return value != default


def _differs(value: Any, default: Any) -> bool:
    """An unknown field is set when it is not its default (a literal `False` against a `True` default
    included); an empty collection counts as an unset `None`."""

    def unset(x: Any) -> bool:
        return x is None or (isinstance(x, (list, tuple, dict, set, frozenset)) and not x)

    if unset(value) and unset(default):
        return False
    return value != default


def request_stop_ids(sampling_params: Any) -> tuple[int, ...]:
    """Every token id vLLM stops this request on: `all_stop_token_ids` holds the tokenizer's EOS (which
    `update_from_generation_config` keeps out of `stop_token_ids`), generation_config's EOS ids and the
    request's own `stop_token_ids`; set even with `ignore_eos` (min_tokens masks them)."""
    if sampling_params is None:
        return ()
    ids = getattr(sampling_params, "all_stop_token_ids", None)
    if ids is None:
        ids = getattr(sampling_params, "stop_token_ids", None)
    extra = getattr(sampling_params, "stop_token_ids", None) or ()
    return tuple(sorted({int(i) for i in (*(ids or ()), *extra)}))


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
    if _is_penalized_greedy(sampling_params):
        return DenseReason.PENALIZED_GREEDY
    for name in _request_fields(sampling_params):
        if name in DENSE_REQUEST_FIELDS or name in FLASHHEAD_REQUEST_FIELDS:
            continue
        if _differs(getattr(sampling_params, name, None), getattr(default, name, None)):
            return DenseReason.UNCLASSIFIED
    return None


@dataclass
class StepRows:
    """What the model runner knows about the rows of one decode step."""

    dense_codes: np.ndarray  # uint8 [rows], 0 = FlashHead may serve the row
    sampled: np.ndarray  # bool [rows], True for rows that sample (temperature > 0)
    stop_ids: tuple[int, ...] = ()  # every id the step's requests stop on, scored exactly on every row
    #: Speculative decoding: the step's verify rows (host, ascending), one per draft token.
    verify_rows: np.ndarray | None = None
    #: Set when the whole step is served dense for this reason (a `StepDenseReason`), whatever its rows ask.
    all_dense: str | None = None
    #: The rows the plugin may draw from the compact law (sampled, no penalty, no dense reason; None: none), with
    #: each row's temperature and min_p as vLLM's sampler applies them.
    compact: np.ndarray | None = None
    temperature: np.ndarray | None = None
    min_p: np.ndarray | None = None
    #: Bool per row: a top_k and a top_p (None: no row has both); a compact row's draw then resolves more clusters,
    #: and its exact set leaves them room (`compact.compact_clusters`).
    top_k_with_top_p: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        return int(self.dense_codes.shape[0])
