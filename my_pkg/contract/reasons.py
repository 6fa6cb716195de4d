"""Why FlashHead is not active, why a part of speculative decoding is not served, why a row is served dense.

Each set of codes is a `Literal` (what the status replies carry) with a table of one line per code, in
its order; docs/flashhead-serving.md's tables are generated from the tables (a unit test keeps them in step).
"""

from __future__ import annotations

from enum import IntEnum
from typing import Final, Literal

#: `FlashHeadState.reason_code`: why FlashHead is not active on a worker (null when it is).
ReasonCode = Literal[
    "disabled",
    "not_built",
    "no_assets",
    "assets_invalid",
    "assets_mismatch",
    "build_failed",
    "quantized_head",
    "warm_up_failed",
    "slower_than_dense",
    "tensor_parallel_rank",
    "pipeline_parallel",
    "speculative_decoding",
    "lora",
    "head_dtype",
    "runner_hook_failed",
    "logits_processor_taken",
]
#: One line per `ReasonCode`, in its order (docs/flashhead-serving.md's table is generated from it).
REASON_CODES: Final[dict[str, str]] = {
    "disabled": "turned off (`MY_PKG_FLASHHEAD=0` or `PUT enabled=false`)",
    "not_built": "the head is not built yet (it is built right after vLLM loads the weights)",
    "no_assets": "the model has no FlashHead assets (no `flash_head_cache_dir` in config.json)",
    "assets_invalid": "the assets could not be read",
    "assets_mismatch": "the assets do not match the model's vocabulary",
    "build_failed": "the head could not be built over the LM head vLLM loaded",
    "quantized_head": "the LM head is quantized",
    "warm_up_failed": "the head failed its warm-up step",
    "slower_than_dense": "on an accelerator, FlashHead's kernels measured at least as slow as the dense head at one "
    "row when the model loaded (`MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD` set: not timed, FlashHead serves)",
    "tensor_parallel_rank": "another tensor-parallel rank cannot serve FlashHead (agreed when the model loads)",
    "pipeline_parallel": "pipeline parallel size > 1",
    "speculative_decoding": "not reported (`spec` gives each part of speculative decoding its own code)",
    "lora": "LoRA is on (adapters change the logits)",
    "head_dtype": "`head_dtype` differs from the model's dtype",
    "runner_hook_failed": "vLLM's model runner could not be hooked (a vLLM internal moved)",
    "logits_processor_taken": "another plugin replaced vLLM's `LogitsProcessor` first",
}


#: `SpecPart.reason_code`: why FlashHead does not serve one part of speculative decoding (null when it does).
SpecReasonCode = Literal[
    "flashhead_inactive",
    "model_runner_v2",
    "spec_hook_failed",
    "no_draft_head",
    "draft_head_not_supported",
    "draft_not_loaded",
    "draft_hook_failed",
    "draft_no_assets",
    "draft_vocab_mismatch",
    "draft_head_unavailable",
]
#: One line per `SpecReasonCode`, in its order (docs/flashhead-serving.md's table is generated from it).
SPEC_REASON_CODES: Final[dict[str, str]] = {
    "flashhead_inactive": "FlashHead is not active on this model (see `reason_code`)",
    "model_runner_v2": "Model Runner V2: its drafters' heads, and verify rows it lays out on the device only "
    "(adaptive verification), are not served by FlashHead in this version",
    "spec_hook_failed": "vLLM's speculative-decoding metadata could not be hooked (a vLLM internal moved)",
    "no_draft_head": "the drafter has no LM head (n-gram, suffix decoding)",
    "draft_head_not_supported": "FlashHead as this method's draft head is not implemented in this version "
    "(only `draft_model`, EAGLE and EAGLE-3 drafters: MTP and Medusa heads stay dense)",
    "draft_not_loaded": "the drafter is not loaded yet (decided right after vLLM loads it)",
    "draft_hook_failed": "vLLM's drafter could not be hooked (a vLLM internal moved)",
    "draft_no_assets": "the drafter's head has no FlashHead assets (a draft model without `flash_head_cache_dir` "
    "in its config.json, an EAGLE head with an LM head of its own)",
    "draft_vocab_mismatch": "the drafter's vocabulary differs from the target's",
    "draft_head_unavailable": "the draft model's FlashHead head cannot serve (its assets or its LM head, see `reason`)",
}


class DenseReason(IntEnum):
    """Why a request's rows are served by the dense head. The value is the row's code in the engine's step
    rows (0, no member, means FlashHead may serve it); `label` is its key in `FlashHeadCounters.rows_dense`."""

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
    PENALIZED_GREEDY = 11

    @property
    def label(self) -> str:
        return self.name.lower()


#: Why a whole step (or a wrapper's call) is served dense, whatever its requests asked for.
StepDenseReason = Literal[
    "batch_threshold",
    "disabled",
    "unavailable",
    "error",
    "unexpected_rows",
    "lora",
    "wrapped_head",
    "speculative_verify",
]
#: Every key of `FlashHeadCounters.rows_dense`: the requests' `DenseReason` labels, then the steps'.
DenseRowReason = Literal[
    "logprobs",
    "structured_output",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "custom_logits_processors",
    "unclassified",
    "thinking_budget",
    "watermark",
    "opt_out",
    "penalized_greedy",
    "batch_threshold",
    "disabled",
    "unavailable",
    "error",
    "unexpected_rows",
    "lora",
    "wrapped_head",
    "speculative_verify",
]
#: One line per `DenseRowReason`, in its order (docs/flashhead-serving.md's table is generated from it).
DENSE_ROW_REASONS: Final[dict[str, str]] = {
    "logprobs": "the request asked for `logprobs` or `logprob_token_ids`",
    "structured_output": "structured output (JSON schema, regex, grammar)",
    "logit_bias": "the request set `logit_bias`",
    "allowed_token_ids": "the request set `allowed_token_ids`",
    "bad_words": "the request set `bad_words`",
    "custom_logits_processors": "custom logits processors are configured on the server (every row)",
    "unclassified": "a request field this plugin does not know is set, or the request could not be classified",
    "thinking_budget": "the request set `thinking_token_budget`",
    "watermark": "the request asked for watermarking",
    "opt_out": 'the request opted out (`"vllm_xargs": {"flashhead": false}`)',
    "penalized_greedy": "a greedy request with a repetition, frequency or presence penalty",
    "batch_threshold": "the step had more rows than `dense_batch_threshold`",
    "disabled": "FlashHead is turned off",
    "unavailable": "FlashHead is not available on this model (see `reason_code`)",
    "error": "FlashHead raised during the step; the dense head answered",
    "unexpected_rows": "the logits call had another number of rows than the step announced",
    "lora": "vLLM's LoRA wrapper received the step",
    "wrapped_head": "another layer wrapping the logits processor received the step",
    "speculative_verify": "a speculative-decoding step whose verify rows FlashHead does not serve (see `spec.verify`)",
}
