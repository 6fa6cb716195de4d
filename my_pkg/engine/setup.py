"""From a vLLM config and an LM head to a ready FlashHead controller: everything the engine does while vLLM
builds and loads a model, in one place.

- `make_controller`, while vLLM builds the model's logits processor: the target's controller (its assets, the
  tokenizer's stop and special ids, why it cannot serve, speculative decoding's parts) or a draft model's
  (`make_draft_controller`); `make_shared_draft_controller` once an EAGLE head has the target's LM head.
- `build_head`, right after the weights load (or at the first logits call): the head over the loaded LM head,
  warmed up and, on CPU, timed beside vLLM's own product for it.

The patches (`patches/logits_processor.py`, `model_loader.py`, `runner_hooks.py`, `spec_proposer.py`) call it;
it calls none of them, and learns which hooks are installed from `my_pkg.engine.patches`' registry.
"""

from __future__ import annotations

import logging
import os
from functools import partial
from typing import Any

from my_pkg.engine.vllm_uses import attributes, symbol

logger = logging.getLogger(f"vllm.{__name__}")

#: What the set-up reads beyond its imports (`my_pkg.devtools.compat` checks it): the configs, the LM head's
#: product and type.
VLLM_SYMBOLS = (
    *attributes("vllm.config:VllmConfig", "model_config", "parallel_config", "speculative_config", "lora_config"),
    *attributes("vllm.config:ModelConfig", "model", "dtype", "revision", "hf_config", "head_dtype"),
    *attributes("vllm.config:ParallelConfig", "pipeline_parallel_size"),
    *attributes("vllm.config:SpeculativeConfig", "method", "target_model_config"),
    symbol(
        "vllm.model_executor.layers.vocab_parallel_embedding:UnquantizedEmbeddingMethod.apply",
        "method",
        params=("self", "layer", "x", "bias"),
    ),
    symbol("vllm.model_executor.layers.vocab_parallel_embedding:UnquantizedEmbeddingMethod", "class"),
    symbol("vllm.model_executor.layers.linear:UnquantizedLinearMethod", "class"),
    symbol("vllm.tokenizers.registry:cached_tokenizer_from_config", "function", params=("model_config",)),
    *attributes(
        "vllm.model_executor.layers.vocab_parallel_embedding:VocabParallelEmbedding",
        "quant_method",
        "tp_size",
        "tp_rank",
        "shard_indices",
    ),
    *attributes(
        "vllm.model_executor.layers.vocab_parallel_embedding:VocabParallelEmbeddingShardIndices",
        "org_vocab_start_index",
        "org_vocab_end_index",
    ),
)


def _resolve_model_dir(model_config: Any) -> str | None:
    model = str(getattr(model_config, "model", "") or "")
    if os.path.isdir(model):
        return model
    try:  # a hub id that is already in the local cache
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=getattr(model_config, "revision", None), local_files_only=True)
    except Exception:  # noqa: BLE001
        return None


def unsupported_reason(vllm_config: Any) -> tuple[str, str] | None:
    """`(code, message)` when this vLLM configuration cannot use FlashHead, else None."""
    parallel = vllm_config.parallel_config
    if getattr(parallel, "pipeline_parallel_size", 1) > 1:
        return "pipeline_parallel", "pipeline parallel size > 1 is not supported; dense head in use"
    if getattr(vllm_config, "lora_config", None) is not None:
        return "lora", ("LoRA is enabled (adapters change the logits, which FlashHead cannot see); dense head in use")
    model_config = vllm_config.model_config
    head_dtype = getattr(model_config, "head_dtype", None)
    if head_dtype is not None and head_dtype != model_config.dtype:
        return "head_dtype", (
            f"head_dtype {head_dtype} differs from the model dtype {model_config.dtype}; dense head in use"
        )
    return None


def make_controller(org_vocab_size: int) -> Any:
    """A controller when the model being built has FlashHead assets, else None."""
    from vllm.config import get_current_vllm_config

    vllm_config = get_current_vllm_config()
    model_config = vllm_config.model_config
    if model_config is None:
        return None
    hf_config = model_config.hf_config
    config = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))
    if not config.get("flash_head_cache_dir"):
        return None

    from my_pkg.engine.patches import runner_hook_failure

    if building_drafter():
        return make_draft_controller(vllm_config, config, org_vocab_size)
    unsupported = unsupported_reason(vllm_config) or runner_hook_failure(vllm_config)
    controller = _controller_from_model_dir(model_config, config, org_vocab_size, unsupported)
    controller.spec = _spec_state(vllm_config)
    return controller


def _controller_from_model_dir(
    model_config: Any, config: dict[str, Any], org_vocab_size: int, unsupported: tuple[str, str] | None
) -> Any:
    """The controller over the model directory's assets, unavailable for `unsupported` (its pinned ids are the
    tokenizer's stop and special ids only when it may serve)."""
    from my_pkg.engine.flashhead.controller import FlashHeadController

    return FlashHeadController.from_model_dir(
        _resolve_model_dir(model_config),
        config,
        vocab_size=org_vocab_size,
        unavailable=unsupported,
        pinned_ids=tokenizer_stop_and_special_ids(model_config) if unsupported is None else (),
    )


def make_draft_controller(vllm_config: Any, config: dict[str, Any], org_vocab_size: int) -> Any:
    """The drafter's own controller (`flashhead/draft.py`) while vLLM builds a draft model (`draft_model`)
    with FlashHead assets beside a FlashHead target; None for every other drafter: an EAGLE head gets its
    controller once it has the target's LM head (`make_shared_draft_controller`), the others stay dense
    (`spec.draft` says why once the drafter is loaded)."""
    from my_pkg.engine.flashhead.draft import configure_draft
    from my_pkg.engine.flashhead.spec import DRAFT_HEAD_METHODS, SHARED_HEAD_METHODS

    speculative_config = getattr(vllm_config, "speculative_config", None)
    method = getattr(speculative_config, "method", None)
    if method not in DRAFT_HEAD_METHODS or method in SHARED_HEAD_METHODS:
        return None
    target_config = getattr(getattr(speculative_config, "target_model_config", None), "hf_config", None)
    if not getattr(target_config, "flash_head_cache_dir", None):
        return None  # reported by nobody: the status route reports the target's FlashHead, which has none
    controller = _controller_from_model_dir(
        vllm_config.model_config, config, org_vocab_size, unsupported_reason(vllm_config)
    )
    return configure_draft(controller, config)


def make_shared_draft_controller(vllm_config: Any, org_vocab_size: int) -> Any:
    """A drafter's controller over the target's assets, for an EAGLE head whose logits processor computes
    its logits with the target's LM head (`patches/spec_proposer.py`); None when the target has no assets."""
    from my_pkg.engine.flashhead.draft import configure_draft

    model_config = getattr(getattr(vllm_config, "speculative_config", None), "target_model_config", None)
    hf_config = getattr(model_config, "hf_config", None)
    if hf_config is None:
        return None
    config = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))
    if not config.get("flash_head_cache_dir"):
        return None
    controller = _controller_from_model_dir(model_config, config, org_vocab_size, unsupported_reason(vllm_config))
    return configure_draft(controller, config)


#: `vllm.compilation.backends.model_tag` while vLLM builds a speculative drafter.
_DRAFTER_TAGS = ("eagle_head", "draft_model", "medusa_head", "extract_hidden_states")


def building_drafter() -> bool:
    """Whether the model being built is a speculative drafter (EAGLE/MTP head, draft model): vLLM tags
    the target "backbone" while it builds it, and a drafter by its role."""
    try:
        import vllm.compilation.backends as backends

        return getattr(backends, "model_tag", "backbone") in _DRAFTER_TAGS
    except Exception:  # noqa: BLE001 - an older vLLM: treat it as the target
        return False


def _spec_state(vllm_config: Any) -> Any:
    """Speculative decoding's parts for this configuration (None without it)."""
    from my_pkg.engine.flashhead.spec import spec_state
    from my_pkg.engine.patches import SPEC_METADATA_HOOK, hook_error

    return spec_state(
        getattr(vllm_config, "speculative_config", None),
        v2=bool(getattr(vllm_config, "use_v2_model_runner", False)),
        hook_error=hook_error(SPEC_METADATA_HOOK),
        draft_hook_error=hook_error("spec_proposer"),
    )


def tokenizer_stop_and_special_ids(model_config: Any) -> list[int]:
    """The EOS and special token ids of the tokenizer vLLM loads for this model (`--tokenizer` may name
    another directory than the model's; its EOS may be an added token that is not special). Empty when
    vLLM loads no tokenizer or it cannot be read: the model directory's ids are pinned anyway."""
    try:
        from vllm.tokenizers.registry import cached_tokenizer_from_config

        tokenizer = cached_tokenizer_from_config(model_config)
        if tokenizer is None:
            return []
        ids = {getattr(tokenizer, "eos_token_id", None)}
        ids.update(getattr(tokenizer, "all_special_ids", None) or ())
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        ids.update(int(i) for i, token in added.items() if getattr(token, "special", False))
        return sorted(int(i) for i in ids if isinstance(i, int) and i >= 0)
    except Exception as exc:  # noqa: BLE001 - the model directory's ids are still pinned
        logger.info("my_pkg: FlashHead pins no tokenizer ids (%s: %s)", type(exc).__name__, exc)
        return []


def build_head(controller: Any, lm_head: Any) -> None:
    """Build the controller's head over `lm_head` (its vocabulary shard under tensor parallelism) and warm
    it up, then time it beside vLLM's own product for the head (`FlashHeadController.measure_costs`);
    called right after the weights load (`runner_hooks.prepare_after_load`) or at the first logits call.
    Never raises."""
    if not _is_plain_weight(lm_head):
        controller.make_unavailable(
            "quantized_head", f"the LM head is quantized ({type(lm_head.quant_method).__name__}); dense head in use"
        )
        return
    vocab_range = shard = None
    if getattr(lm_head, "tp_size", 1) > 1:
        indices = lm_head.shard_indices
        vocab_range = (int(indices.org_vocab_start_index), int(indices.org_vocab_end_index))
        shard = (int(lm_head.tp_rank), int(lm_head.tp_size))
    # vLLM's batch-invariant mode asks for output that does not depend on the batch down to the last bit: then
    # nothing is timed and FlashHead's kernels serve every step (the masked way rounds its exact values as the dense
    # product does, the kernels as their own products do).
    dense = None if _batch_invariant() else partial(dense_product, lm_head)
    controller.prepare(lm_head.weight, vocab_range=vocab_range, shard=shard, dense=dense)


def _batch_invariant() -> bool:
    """vLLM's `VLLM_BATCH_INVARIANT` (read through `vllm.envs`, which declares it for type checkers only)."""
    import vllm.envs

    return bool(getattr(vllm.envs, "VLLM_BATCH_INVARIANT", False))


def dense_product(lm_head: Any, hidden: Any) -> Any:
    """vLLM's own product for the head, as its logits processor computes it (on CPU a packed GEMM)."""
    return lm_head.quant_method.apply(lm_head, hidden)


def _is_plain_weight(lm_head: Any) -> bool:
    method = type(getattr(lm_head, "quant_method", None)).__name__
    return method in ("UnquantizedEmbeddingMethod", "UnquantizedLinearMethod")
