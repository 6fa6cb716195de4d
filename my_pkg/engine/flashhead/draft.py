"""FlashHead as the drafter's head under speculative decoding (`method: draft_model`, `eagle`, `eagle3`).

Two kinds of drafter compute their logits through a head FlashHead has assets for:

- a draft model that is itself a FlashHead checkpoint (its config.json names its assets, as
  `my-pkg flashhead build` writes them): its own head, over its own assets;
- an EAGLE / EAGLE-3 head without an `lm_head` of its own: vLLM gives it the target's LM head
  (`SpecDecodeBaseProposer._maybe_share_lm_head`), so its logits are the target's head's, over the
  target's assets. An EAGLE head that brings its own LM head has no assets (`draft_no_assets`).

Either drafter gets its own `FlashHeadController`, with its own probe count, `draft_n_probes`: a draft
model's while vLLM builds it (`patches/logits_processor.py`), an EAGLE head's right after vLLM's
`load_model` gave it the target's LM head (`patches/spec_proposer.py`, over the target's assets; before
that the head has no LM head to build over). Right after vLLM loads the drafter,
`patches/spec_proposer.py` links it to the target's controller (`link`) or records why the drafter's
head stays dense (`refusal`); from then on each draft step arms the drafter's controller with all of
its rows (`draft_rows`: greedy rows, or sampled rows under probabilistic drafting), so that the
drafter's `compute_logits` call goes through FlashHead as a decode step does. An EAGLE drafter's head is
a second FlashHead head over the same LM-head weight (the weight is shared, the centroids and cluster
tables are its own copy, counted in the status's `extra_memory_bytes`).

Drafts never change what the target emits (vLLM's rejection sampler verifies them against the
target's logits); a draft token FlashHead picks differently from the dense drafter only changes
whether it is accepted. The target's controller owns the drafter's: its status reports the draft
part and the drafter's counters, and its settings `enabled` and `dense_batch_threshold` apply to
both. Imports the contract, numpy and the controller; vLLM objects reach it as plain arguments.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from my_pkg.engine.flashhead.controller import FlashHeadController
from my_pkg.engine.flashhead.rows import StepRows
from my_pkg.engine.flashhead.spec import DRAFT_HEAD_METHODS, SHARED_HEAD_METHODS, with_draft
from my_pkg.engine.vllm_uses import attributes

logger = logging.getLogger(f"vllm.{__name__}")

__all__ = ["configure_draft", "default_draft_n_probes", "draft_rows", "link", "refusal"]

#: Read on the proposer and the draft model's config (`my_pkg.devtools.compat` checks them).
VLLM_SYMBOLS = (
    *attributes(
        "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer",
        "method",
        "use_heterogeneous_vocab",
        "use_local_argmax_reduction",
        "draft_model_config",
    ),
    *attributes("vllm.config:ModelConfig", "hf_config"),
)


def default_draft_n_probes(config: dict[str, Any], num_clusters: int | None) -> int:
    """The drafter's probe count at start-up: `MY_PKG_FLASHHEAD_DRAFT_N_PROBES` when set, else the checkpoint's
    own `n_probes` (the builder's calibrated choice for its top-1 agreement target; an EAGLE head's is the
    target's), else the builder's default; at most its clusters. `MY_PKG_FLASHHEAD_N_PROBES` sets the
    target's count only."""
    from my_pkg import env
    from my_pkg.flashhead.spec import default_n_probes

    configured = env.MY_PKG_FLASHHEAD_DRAFT_N_PROBES
    if configured is None:
        configured = config.get("n_probes")
    if isinstance(configured, int) and not isinstance(configured, bool) and configured > 0:
        n_probes = configured
    else:
        n_probes = default_n_probes(num_clusters) if num_clusters else 1
    if num_clusters and n_probes > num_clusters:
        logger.warning("my_pkg: draft_n_probes=%d exceeds %d clusters; using %d", n_probes, num_clusters, num_clusters)
        n_probes = num_clusters
    return n_probes


def configure_draft(controller: FlashHeadController, config: dict[str, Any]) -> FlashHeadController:
    """Make `controller` (built over the draft model's assets) a drafter's: its own probe count and no
    live fidelity check (the acceptance rate measures its drafts)."""
    controller.settings.n_probes = default_draft_n_probes(config, controller.num_clusters)
    controller.settings.fidelity_every = 0
    controller.spec = None
    return controller


def draft_rows(num_rows: int, *, sampled: bool = False) -> StepRows:
    """A draft step's rows, every one served by FlashHead: greedy, or (`sampled`, probabilistic drafting)
    FlashHead's sampled rows, whose logits cover every token. A draft token never reaches the output
    unverified, so a request that needs the target's exact logits (logprobs, grammar, ...) needs nothing
    of its drafts."""
    return StepRows(dense_codes=np.zeros(num_rows, dtype=np.uint8), sampled=np.full(num_rows, sampled, dtype=bool))


def _has_assets(model_config: Any) -> bool:
    hf_config = getattr(model_config, "hf_config", None)
    return bool(getattr(hf_config, "flash_head_cache_dir", None))


def refusal(
    proposer: Any,
    target: FlashHeadController,
    draft: FlashHeadController | None,
    *,
    shares_target_head: bool = False,
) -> tuple[str, str | None] | None:
    """`(SpecReasonCode, detail)` when the drafter's head cannot be FlashHead, else None.

    `proposer` is vLLM's drafter (a `SpecDecodeBaseProposer`) once it loaded its model, `draft` the
    controller found in that model (None when its logits processor made none), `shares_target_head`
    whether the drafter computes its logits with the target's LM head module (an EAGLE head's assets
    are the target's: they fit no other head)."""
    method = getattr(proposer, "method", None)
    if method not in DRAFT_HEAD_METHODS:
        return ("draft_head_not_supported", f"method {method!r}")
    if getattr(proposer, "use_heterogeneous_vocab", False):
        return ("draft_vocab_mismatch", "vLLM maps the drafter's tokenizer onto the target's")
    if method in SHARED_HEAD_METHODS and not shares_target_head:
        return ("draft_no_assets", "the EAGLE head has an LM head of its own; FlashHead's assets are the target's")
    if draft is None:
        if method not in SHARED_HEAD_METHODS and not _has_assets(getattr(proposer, "draft_model_config", None)):
            return ("draft_no_assets", None)
        return ("draft_head_unavailable", "the drafter's logits processor has no FlashHead controller")
    if draft.vocab_size != target.vocab_size:
        return ("draft_vocab_mismatch", f"{draft.vocab_size} draft tokens, {target.vocab_size} target tokens")
    if getattr(proposer, "use_local_argmax_reduction", False):
        return ("draft_head_unavailable", "use_local_argmax_reduction takes the drafter's argmax without its logits")
    if not draft.available:
        return ("draft_head_unavailable", draft.unavailable_reason)
    return None


def link(
    target: FlashHeadController, draft: FlashHeadController | None, refused: tuple[str, str | None] | None
) -> None:
    """Record the drafter's part on the target's controller: `draft` serves the drafts (it follows the
    target's `enabled` and `dense_batch_threshold` from now on), or the part stays dense for `refused`."""
    if refused is None and draft is not None:
        target.draft = draft
        draft.settings.enabled = target.settings.enabled
        draft.settings.dense_batch_threshold = target.settings.dense_batch_threshold
        target.spec = with_draft(target.spec, None)
    else:
        target.draft = None
        code, detail = refused if refused is not None else ("draft_head_unavailable", None)
        target.spec = with_draft(target.spec, code, detail)
