"""FlashHead's parts under speculative decoding, as the status route reports them (`SpecState`).

Verify: the target's verify and bonus rows, served by FlashHead under the V1 model runner
(`patches/model_runner.py`) and Model Runner V2 (`patches/model_runner_v2.py`; not its adaptive
verification, which turns the part off at its first step, `without_verify`). Draft: the drafter's head,
served by FlashHead (under V1) when the drafter is a draft model (`method: draft_model`) that is itself
a FlashHead checkpoint with the target's vocabulary, or an EAGLE / EAGLE-3 head that computes its logits
with the target's LM head (`flashhead/draft.py`, `patches/spec_proposer.py`); decided when vLLM loads the
drafter, right after the target. Each part has its own `reason_code` (`contract.SpecReasonCode`);
FlashHead stays on for every other row. Imports the contract (and the vLLM-free `vllm_uses` helper)
only; vLLM's config reaches it as a plain argument.
"""

from __future__ import annotations

from typing import Any

from my_pkg.contract import SPEC_REASON_CODES, SpecPart, SpecState
from my_pkg.engine.vllm_uses import attributes

#: Read on the `SpeculativeConfig` it is handed (`my_pkg.devtools.compat` checks them).
VLLM_SYMBOLS = (*attributes("vllm.config:SpeculativeConfig", "method", "num_speculative_tokens"),)

__all__ = [
    "DRAFT_HEAD_METHODS",
    "MODEL_FREE_METHODS",
    "SHARED_HEAD_METHODS",
    "effective",
    "spec_state",
    "with_draft",
    "without_verify",
]

#: Speculative methods whose drafts come without an LM head.
MODEL_FREE_METHODS = frozenset({"ngram", "ngram_gpu", "suffix"})
#: Speculative methods whose drafter's head FlashHead can serve: a separate draft model, and EAGLE heads.
DRAFT_HEAD_METHODS = frozenset({"draft_model", "eagle", "eagle3"})
#: Of those, the drafters served over the target's assets: vLLM gives an EAGLE head without an `lm_head` of
#: its own the target's (`SpecDecodeBaseProposer._maybe_share_lm_head`), so its logits are the target's head's.
SHARED_HEAD_METHODS = frozenset({"eagle", "eagle3"})


def _part(code: str | None, detail: str | None = None) -> SpecPart:
    if code is None:
        return SpecPart(active=True)
    reason = SPEC_REASON_CODES[code] + (f": {detail}" if detail else "")
    return SpecPart(active=False, reason_code=code, reason=reason)


def spec_state(
    speculative_config: Any, *, v2: bool, hook_error: str | None, draft_hook_error: str | None = None
) -> SpecState | None:
    """The parts for this configuration (None without speculative decoding). `v2`: vLLM runs Model
    Runner V2 (whose drafters keep their dense heads); `hook_error`: why V1's speculative metadata is
    not hooked (None when it is; V2 needs no such hook);
    `draft_hook_error`: why vLLM's drafter is not hooked (None when it is). A draft model's or EAGLE
    head's part is `draft_not_loaded` until the drafter is loaded (`with_draft`)."""
    if speculative_config is None:
        return None
    method = getattr(speculative_config, "method", None)
    tokens = getattr(speculative_config, "num_speculative_tokens", None)
    if hook_error is not None and not v2:
        verify = _part("spec_hook_failed", hook_error)
    else:
        verify = _part(None)
    if method in MODEL_FREE_METHODS:
        draft = _part("no_draft_head")
    elif method not in DRAFT_HEAD_METHODS:
        draft = _part("draft_head_not_supported")
    elif v2:
        draft = _part("model_runner_v2")
    elif draft_hook_error is not None:
        draft = _part("draft_hook_failed", draft_hook_error)
    else:
        draft = _part("draft_not_loaded")
    return SpecState(
        method=None if method is None else str(method),
        num_speculative_tokens=None if tokens is None else int(tokens),
        verify=verify,
        draft=draft,
    )


def with_draft(spec: SpecState | None, code: str | None, detail: str | None = None) -> SpecState | None:
    """`spec` with the drafter's part decided: served by FlashHead (`code` None) or dense for `code` (a
    `SpecReasonCode`) and its `detail`. The status fills in `draft_n_probes` from the drafter's head."""
    if spec is None:
        return None
    return spec.model_copy(update={"draft": _part(code, detail), "draft_n_probes": None})


def without_verify(spec: SpecState | None, code: str, detail: str | None = None) -> SpecState | None:
    """`spec` with the verify part found dense at run time for `code` (a `SpecReasonCode`) and `detail`."""
    if spec is None:
        return None
    return spec.model_copy(update={"verify": _part(code, detail)})


def effective(spec: SpecState | None, flashhead_active: bool) -> SpecState | None:
    """`spec` as the status route shows it: no part is active while FlashHead itself is not."""
    if spec is None or flashhead_active:
        return spec
    inactive = _part("flashhead_inactive")
    return spec.model_copy(
        update={
            "verify": spec.verify if not spec.verify.active else inactive,
            "draft": spec.draft if not spec.draft.active else inactive,
        }
    )
