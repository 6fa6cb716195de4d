"""FlashHead as the drafter's head: hooks vLLM's `SpecDecodeBaseProposer` (the draft-model, EAGLE and
MTP drafters' base class).

Installed with every FlashHead hook (`patches.on_flashhead_model`, before the target is built, so
before the drafter loads):

- `load_model(target_model)`: right after vLLM loads the drafter (and gave an EAGLE head the target's
  LM head), finds the target's controller and the drafter's (`flashhead/draft.py`), decides the draft
  part (`draft.refusal`, `draft.link`) and builds the drafter's head, so that vLLM's KV-cache sizing
  counts its memory. An EAGLE head's controller is made here, over the target's assets: while vLLM
  builds and loads the head it has no LM head yet (vLLM's model loader would otherwise build FlashHead
  over the only vocabulary-sized module it has, its embedding).
- `_greedy_sample(hidden_states)`: the one call through which a drafter picks its greedy draft tokens
  (`compute_logits(...).argmax(-1)`); with a linked FlashHead drafter it runs armed with the step's
  rows (`draft.draft_rows`), so the drafter's `compute_logits` goes through FlashHead.
- `_sample_draft_tokens(hidden_states, sampling_metadata)`, where a step with sampled requests under
  `draft_sample_method: probabilistic` samples its drafts from the drafter's probabilities and keeps them
  for the rejection sampler: with a linked FlashHead drafter it runs armed with every row a FlashHead
  sampled row (exact candidates, estimated tail: a probability for every token). The rejection sampler
  divides by the probabilities the drafts were drawn from, whatever they are, so the emitted tokens keep
  the target's law; FlashHead's estimate only changes how often a draft is accepted. A greedy step goes
  through `_greedy_sample` unchanged. Installed only where vLLM has this method.

Either hook that fails leaves vLLM's drafter as it is (dense), logged once; a failure to link the drafter
is also reported as the draft part's `draft_hook_failed`, with the error. Under tensor parallelism the
ranks then agree, with one all-reduce every rank of a FlashHead target reaches, whether each linked a
drafter that can serve: when one did not, none keeps it (`agree_drafter`).
"""

from __future__ import annotations

import functools
from typing import Any

from my_pkg.engine.flashhead.controller import FlashHeadController
from my_pkg.engine.patches.runner_hooks import (
    controller_in,
    every_rank,
    lm_head_of,
    require,
    run_armed,
    tensor_parallel,
    warn_once,
    wrap_once,
)
from my_pkg.engine.setup import build_head, make_shared_draft_controller
from my_pkg.engine.vllm_uses import attributes, symbol

TARGET = "vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer"
#: What the hooks rely on beyond their imports (`my_pkg.devtools.compat` checks it).
VLLM_SYMBOLS = (
    symbol(
        "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.load_model",
        "method",
        params=("self", "target_model"),
    ),
    symbol(
        "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer._greedy_sample",
        "method",
        params=("self", "hidden_states"),
    ),
    symbol(
        "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer._sample_draft_tokens",
        "method",
        params=("self", "hidden_states", "sampling_metadata"),
    ),
    *attributes(
        "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer",
        "model",
        "vllm_config",
        "_enable_probabilistic_draft_probs",
    ),
    *attributes("vllm.v1.sample.metadata:SamplingMetadata", "all_greedy"),
    *attributes("vllm.config:ModelConfig", "enable_sleep_mode"),
)
#: Where the linked drafter's controller is kept on the proposer.
DRAFT_ATTR = "_my_pkg_flashhead_draft"
#: The draft part's codes decided when the drafter loads (None: FlashHead serves it), decided again when
#: vLLM loads it again; every other code comes from the configuration (`spec.spec_state`) and stays.
_DECIDED_AT_LOAD = frozenset(
    {None, "draft_not_loaded", "draft_no_assets", "draft_vocab_mismatch", "draft_head_unavailable"}
)


def link_drafter(proposer: Any, target_model: Any) -> None:
    """Decide the draft part of the target's status, and build the drafter's head when it is FlashHead."""
    from my_pkg.engine.flashhead.draft import link, refusal
    from my_pkg.engine.flashhead.spec import SHARED_HEAD_METHODS

    proposer.__dict__.pop(DRAFT_ATTR, None)
    target = controller_in(target_model)
    spec = target.spec if target is not None else None
    if spec is None or spec.draft.reason_code not in _DECIDED_AT_LOAD:
        return  # no FlashHead target, or a part decided by the configuration (model-free, V2, other methods)
    draft = controller_in(getattr(proposer, "model", None))
    shares_target_head = _shares_target_head(proposer, target_model)
    if draft is None and shares_target_head and getattr(proposer, "method", None) in SHARED_HEAD_METHODS:
        draft = _shared_head_controller(proposer)
    refused = refusal(proposer, target, draft, shares_target_head=shares_target_head)
    if refused is None and draft is not None:
        _build(proposer, draft)
        if not draft.available:
            refused = ("draft_head_unavailable", draft.unavailable_reason)
    link(target, draft, refused)
    if refused is None:
        proposer.__dict__[DRAFT_ATTR] = draft


def agree_drafter(proposer: Any, target_model: Any) -> None:
    """Tensor parallelism: every rank of a FlashHead target (its config says so, alike on every rank) learns whether
    every rank linked a drafter that can serve; when one did not, every rank unlinks its own (`draft_head_unavailable`),
    so that no rank's draft step waits in a stage-1 exchange another skips. Never raises."""
    config = getattr(getattr(getattr(proposer, "vllm_config", None), "model_config", None), "hf_config", None)
    if not getattr(config, "flash_head_cache_dir", None) or not tensor_parallel():
        return
    draft = proposer.__dict__.get(DRAFT_ATTR)
    try:
        head = _lm_head(getattr(proposer, "model", None))
        device = head.weight.device if head is not None else "cpu"
        agreed = every_rank(draft is not None and draft.available, device)
    except Exception as exc:  # noqa: BLE001 - no agreement: the drafter stays dense (the collective failed alike)
        warn_once("drafter tensor-parallel agreement", exc)
        agreed = False
    if agreed:
        return
    try:
        from my_pkg.engine.flashhead.draft import link

        proposer.__dict__.pop(DRAFT_ATTR, None)
        own = draft if draft is not None else controller_in(getattr(proposer, "model", None))
        if own is not None:
            own.agree(False)
        if draft is not None:
            target = controller_in(target_model)
            if target is not None:
                link(target, draft, ("draft_head_unavailable", draft.unavailable_reason))
    except Exception as exc:  # noqa: BLE001
        warn_once("drafter tensor-parallel agreement", exc)


def _shares_target_head(proposer: Any, target_model: Any) -> bool:
    """Whether the drafter computes its logits with the target's LM head module (vLLM shares it with an
    EAGLE head that has none of its own)."""
    target_head = _lm_head(target_model)
    return target_head is not None and _lm_head(getattr(proposer, "model", None)) is target_head


def _lm_head(model: Any) -> Any:
    if model is None:
        return None
    unwrap = getattr(model, "unwrap", None)
    return lm_head_of(unwrap() if callable(unwrap) else model)


def _record_failure(target_model: Any, exc: BaseException) -> None:
    """The draft part says why linking failed (`draft_hook_failed`); never raises."""
    try:
        from my_pkg.engine.flashhead.spec import with_draft

        target = controller_in(target_model)
        if target is not None and target.spec is not None and target.spec.draft.reason_code in _DECIDED_AT_LOAD:
            target.draft = None
            target.spec = with_draft(target.spec, "draft_hook_failed", f"{type(exc).__name__}: {exc}")
    except Exception:  # noqa: BLE001
        pass


def _build(proposer: Any, draft: FlashHeadController) -> None:
    """Build the drafter's head over the drafter's LM head (as `runner_hooks.prepare_after_load` does the
    target's), unless vLLM's model loader did (`patches/model_loader.py`); under sleep mode, or when the LM
    head is not one module, its first logits call does."""
    if draft.head is not None or getattr(getattr(proposer, "draft_model_config", None), "enable_sleep_mode", False):
        return
    lm_head = _lm_head(proposer.model)
    if lm_head is not None:
        build_head(draft, lm_head)


def _shared_head_controller(proposer: Any) -> FlashHeadController | None:
    """Give an EAGLE head that computes its logits with the target's LM head a drafter's controller over the
    target's assets, on its logits processor (the one FlashHead processor in the drafter); None when it has
    no such processor or the target's assets cannot serve it. Made here, not while vLLM builds the drafter:
    until `load_model` shares the target's LM head, the drafter has none to build it over."""
    from my_pkg.engine.patches.logits_processor import CONTROLLER_ATTR, subclass

    model = proposer.model
    unwrap = getattr(model, "unwrap", None)
    model = unwrap() if callable(unwrap) else model
    processors = [m for m in model.modules() if isinstance(m, subclass()) and not m.logits_as_input]
    if len(processors) != 1:
        return None
    controller = make_shared_draft_controller(proposer.vllm_config, processors[0].org_vocab_size)
    if controller is not None:
        processors[0].__dict__[CONTROLLER_ATTR] = controller
    return controller


def apply() -> None:
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    from my_pkg.engine.flashhead.draft import draft_rows  # imported once, not on every draft step

    require((SpecDecodeBaseProposer, "load_model"), (SpecDecodeBaseProposer, "_greedy_sample"))
    original_load = SpecDecodeBaseProposer.load_model
    original_greedy = SpecDecodeBaseProposer._greedy_sample

    @functools.wraps(original_load)
    def load_model(self, target_model, *args, **kwargs):
        result = original_load(self, target_model, *args, **kwargs)
        try:
            link_drafter(self, target_model)
        except Exception as exc:  # noqa: BLE001 - the drafter stays dense
            self.__dict__.pop(DRAFT_ATTR, None)
            warn_once("drafter load_model", exc)
            _record_failure(target_model, exc)
        agree_drafter(self, target_model)
        return result

    @functools.wraps(original_greedy)
    def greedy_sample(self, hidden_states, *args, **kwargs):
        draft = self.__dict__.get(DRAFT_ATTR)
        if draft is None:
            return original_greedy(self, hidden_states, *args, **kwargs)
        try:
            rows = draft_rows(int(hidden_states.shape[0]))
        except Exception as exc:  # noqa: BLE001 - this step's drafts are dense
            warn_once("drafter _greedy_sample", exc)
            return original_greedy(self, hidden_states, *args, **kwargs)
        return run_armed(draft, lambda: rows, lambda: original_greedy(self, hidden_states, *args, **kwargs))

    hooks = [("load_model", load_model), ("_greedy_sample", greedy_sample)]
    original_sample = getattr(SpecDecodeBaseProposer, "_sample_draft_tokens", None)
    if original_sample is not None:  # probabilistic drafting; greedy drafting needs only the hooks above

        @functools.wraps(original_sample)
        def sample_draft_tokens(self, hidden_states, sampling_metadata, *args, **kwargs):
            draft = self.__dict__.get(DRAFT_ATTR)
            call = functools.partial(original_sample, self, hidden_states, sampling_metadata, *args, **kwargs)
            if draft is None:
                return call()
            try:
                probabilistic = bool(getattr(self, "_enable_probabilistic_draft_probs", False)) and not bool(
                    sampling_metadata.all_greedy
                )
                rows = draft_rows(int(hidden_states.shape[0]), sampled=True) if probabilistic else None
            except Exception as exc:  # noqa: BLE001 - this step's drafts are dense
                warn_once("drafter _sample_draft_tokens", exc)
                return call()
            if rows is None:  # greedy drafts: through `_greedy_sample`, hooked
                return call()
            return run_armed(draft, lambda: rows, call)

        hooks.append(("_sample_draft_tokens", sample_draft_tokens))
    for name, hook in hooks:
        wrap_once(SpecDecodeBaseProposer, name, hook)
