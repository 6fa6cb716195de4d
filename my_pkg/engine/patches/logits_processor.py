"""Serve FlashHead models' decode steps through FlashHead.

Uses vLLM's official replacement point: `LogitsProcessor` is a
`PluggableLayer`, and `register_oot` makes every later `LogitsProcessor(...)`
build our subclass. The registration is deferred until a FlashHead
architecture is resolved (`patches.on_flashhead_model`), that is after every
general plugin has loaded and right before the model is built, so that:

- a process that never builds a FlashHead model keeps vLLM's class untouched;
- another plugin that also replaces `LogitsProcessor` keeps its slot (vLLM
  asserts on a second registration and does not catch it): FlashHead then stays
  off with the reason in the status route, and the server runs as that plugin wants.

The subclass's constructor makes the model's `FlashHeadController` (reading its
assets and the tokenizer's stop and special ids); the runner hooks build its head
right after the weights load (`build_head`), or the first logits call does.

Under tensor parallelism each rank's head covers its vocabulary shard and its
share of the centroids (`_sharded_step`). Stage 1 is split: each rank scores its
`C / tp` centroids and keeps its best `K` clusters as keys (score, then cluster
id: `my_pkg.flashhead.probes`), one all-gather over the TP group exchanges them
(`[B, tp * K]` int64), and every rank takes the best `P` of the same gathered keys:
the probes the full stage 1 would choose, the same on every rank. Each rank then
scores the candidates in its vocabulary shard (FlashHead's kernels or its shard of
the dense product masked to them, whichever it finds cheaper: the same logits),
and vLLM's own gather joins the shards.

vLLM's gather is reached exactly once per armed step on every rank, and the
stage-1 exchange at most once, on every rank alike, failures included, because
whether and with which shape a rank reaches them never depends on anything that
can differ between ranks:

- vLLM's gather: every path of a step ends in it (a failure before it serves the
  rank's shard dense), as vLLM's own forward does.
- The stage-1 exchange happens on a step iff it is an armed decode step (the
  model runner arms every rank for the same scheduler output) and
  `FlashHeadController.exchange_width(B)` is not None: the settings, the step's
  size and whether every rank can serve FlashHead, which the ranks agreed on with
  one all-reduce when the model loaded (`model_loader.agree_after_loading`): alike
  on every rank. Its shape is `[B, width]`.
  It comes before anything that can fail on one rank only: reading the step's
  rows, building the head, the stage-1 scores and the step's dense reasons are
  all decided around it, never whether it happens. A rank that cannot score its
  share still sends keys (its clusters ranked below every scored one,
  `stage1_keys`), then serves its own shard dense; the other ranks choose their
  probes from the clusters that were scored (with every cluster probed: all of
  them), counted as `fallbacks`.
- Steps that are not armed (warm-up, prompt logprobs) and wrapped heads (LoRA)
  take vLLM's own forward on every rank, without an exchange.

`forward` may be called with another `self` than our instance: vLLM's LoRA
wrapper calls `type(base_layer).forward(wrapper, ...)`. Such calls always go to
vLLM's own `forward` bound to the wrapper (the adapters' logits are exact).
"""

from __future__ import annotations

import logging
import os
from functools import partial
from typing import Any

from my_pkg.engine.vllm_uses import attributes, symbol

logger = logging.getLogger(f"vllm.{__name__}")

TARGET = "vllm.model_executor.layers.logits_processor.LogitsProcessor"
#: What the subclass and the controller's set-up rely on beyond their imports (`my_pkg.devtools.compat`
#: checks it): vLLM's forward and helpers called with `self`, the configs read, the LM head and its shard.
VLLM_SYMBOLS = (
    symbol(
        "vllm.model_executor.layers.logits_processor:LogitsProcessor.forward",
        "method",
        params=("self", "lm_head", "hidden_states", "embedding_bias", "skip_gather"),
    ),
    symbol(
        "vllm.model_executor.layers.logits_processor:LogitsProcessor._get_logits",
        "method",
        params=("self", "hidden_states", "lm_head", "embedding_bias", "skip_gather"),
    ),
    symbol(
        "vllm.model_executor.layers.logits_processor:LogitsProcessor._gather_logits",
        "method",
        params=("self", "logits"),
    ),
    *attributes(
        "vllm.model_executor.layers.logits_processor:LogitsProcessor",
        "logits_as_input",
        "org_vocab_size",
        "soft_cap",
        "scale",
    ),
    symbol(
        "vllm.model_executor.layers.vocab_parallel_embedding:UnquantizedEmbeddingMethod.apply",
        "method",
        params=("self", "layer", "x", "bias"),
    ),
    *attributes("vllm.config:VllmConfig", "model_config", "parallel_config", "speculative_config", "lora_config"),
    *attributes("vllm.config:ModelConfig", "model", "dtype", "revision", "hf_config", "head_dtype"),
    *attributes("vllm.config:ParallelConfig", "pipeline_parallel_size"),
    *attributes("vllm.config:SpeculativeConfig", "method", "target_model_config"),
    *attributes("vllm.lora.layers.logits_processor:LogitsProcessorWithLoRA", "base_layer"),
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
        "num_org_elements",
    ),
    symbol("vllm.model_executor.layers.vocab_parallel_embedding:UnquantizedEmbeddingMethod", "class"),
    symbol("vllm.model_executor.layers.linear:UnquantizedLinearMethod", "class"),
    symbol("vllm.tokenizers.registry:cached_tokenizer_from_config", "function", params=("model_config",)),
)
CONTROLLER_ATTR = "_my_pkg_flashhead"
_subclass: type | None = None


def _resolve_model_dir(model_config: Any) -> str | None:
    model = str(getattr(model_config, "model", "") or "")
    if os.path.isdir(model):
        return model
    try:  # a hub id that is already in the local cache
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=getattr(model_config, "revision", None), local_files_only=True)
    except Exception:  # noqa: BLE001
        return None


def _unsupported_reason(vllm_config: Any) -> tuple[str, str] | None:
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


def _make_controller(org_vocab_size: int) -> Any:
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

    if _building_drafter():
        return _make_draft_controller(vllm_config, config, org_vocab_size)
    unsupported = _unsupported_reason(vllm_config) or runner_hook_failure(vllm_config)
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


def _make_draft_controller(vllm_config: Any, config: dict[str, Any], org_vocab_size: int) -> Any:
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
        vllm_config.model_config, config, org_vocab_size, _unsupported_reason(vllm_config)
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
    controller = _controller_from_model_dir(model_config, config, org_vocab_size, _unsupported_reason(vllm_config))
    return configure_draft(controller, config)


#: `vllm.compilation.backends.model_tag` while vLLM builds a speculative drafter.
_DRAFTER_TAGS = ("eagle_head", "draft_model", "medusa_head", "extract_hidden_states")


def _building_drafter() -> bool:
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
    from my_pkg.engine.patches import hook_error
    from my_pkg.engine.patches.model_runner import spec_hook_error

    return spec_state(
        getattr(vllm_config, "speculative_config", None),
        v2=bool(getattr(vllm_config, "use_v2_model_runner", False)),
        hook_error=spec_hook_error(),
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


def controller_of(layer: Any) -> tuple[Any, str | None]:
    """`(controller, wrapper)` for a `forward` call whose `self` is `layer`.

    `wrapper` is None when `layer` is our own processor, else the reason code
    under which a wrapper's steps are served dense (`lora` for vLLM's LoRA wrapper).
    """
    own = layer.__dict__.get(CONTROLLER_ATTR)
    if own is not None or _subclass is None or isinstance(layer, _subclass):
        return own, None
    base = getattr(layer, "base_layer", None)
    controller = base.__dict__.get(CONTROLLER_ATTR) if base is not None else None
    return controller, "lora" if "lora" in type(layer).__name__.lower() else "wrapped_head"


def subclass() -> type:
    """Build (once) the `LogitsProcessor` subclass; vLLM is imported only here."""
    global _subclass
    if _subclass is not None:
        return _subclass
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    vllm_forward = LogitsProcessor.forward

    class FlashHeadLogitsProcessor(LogitsProcessor):
        """vLLM's `LogitsProcessor`, with FlashHead for decode steps of FlashHead models."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._my_pkg_flashhead = None
            try:
                if not self.logits_as_input:
                    self._my_pkg_flashhead = _make_controller(self.org_vocab_size)
            except Exception:  # noqa: BLE001 - never break model construction
                logger.warning("my_pkg: FlashHead set-up failed; dense head in use", exc_info=True)

        def _postprocess(self, logits: Any) -> Any:
            import torch

            if self.soft_cap is not None:
                logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
            if self.scale != 1.0:
                logits = logits * self.scale
            return logits

        def forward(self, lm_head, hidden_states, embedding_bias=None, skip_gather=False):  # type: ignore[override]
            # `self` may be a wrapper (LoRA): only vLLM's forward, bound to `self`, is safe for it.
            try:
                controller, wrapper = controller_of(self)
            except Exception:  # noqa: BLE001 - an unknown caller gets vLLM's behaviour
                controller, wrapper = None, None
            if controller is None or skip_gather or embedding_bias is not None:
                return vllm_forward(self, lm_head, hidden_states, embedding_bias, skip_gather)
            if wrapper is not None:
                controller.serve_step_dense(int(hidden_states.shape[0]), wrapper)
                return vllm_forward(self, lm_head, hidden_states, embedding_bias, skip_gather)
            sharded = getattr(lm_head, "tp_size", 1) > 1
            armed = controller.armed  # read before `take_step` consumes it; the same on every rank
            try:
                if controller.head is None and controller.available:
                    build_head(controller, lm_head)  # the runner's load hook did not (see runner_hooks)
                elif controller.head is not None and controller.head.weight is not lm_head.weight:
                    controller.head = None
                    controller.make_unavailable(
                        "build_failed", "the LM head's weight changed after FlashHead was built; dense head in use"
                    )
                rows = controller.take_step()
            except Exception as exc:  # noqa: BLE001 - FlashHead must never take the engine down
                controller.record_fallback(exc, int(hidden_states.shape[0]))
                rows = None
            if sharded:
                width = controller.exchange_width(int(hidden_states.shape[0])) if armed else None
                if width is not None or rows is not None:
                    return self._sharded_step(controller, lm_head, hidden_states, rows, width)
            if rows is None:  # warm-up, prompt logprobs, drafter: vLLM's own head
                return vllm_forward(self, lm_head, hidden_states, embedding_bias, skip_gather)
            try:

                def dense(rows_hidden):
                    return vllm_forward(self, lm_head, rows_hidden)

                return controller.compute_logits(hidden_states, rows, dense, self._postprocess)
            except Exception as exc:  # noqa: BLE001 - FlashHead must never take the engine down
                controller.record_fallback(exc, int(hidden_states.shape[0]))
                return vllm_forward(self, lm_head, hidden_states, embedding_bias, skip_gather)

        def _sharded_step(self, controller, lm_head, hidden_states, rows, width):
            """A decode step over vLLM's vocab-parallel head: the stage-1 exchange when `width` is not None,
            this rank's vocabulary shard, then the gather (see the module docstring).

            Every rank reaches each collective exactly once whatever happens around it (a failure here
            serves this rank's shard dense), as vLLM's own forward does. `rows` is None when this rank
            could not read the step's rows (counted): its shard is served dense.
            """
            import torch

            num_org = lm_head.shard_indices.num_org_elements

            def dense_local(rows_hidden):
                return self._postprocess(self._get_logits(rows_hidden, lm_head, None, skip_gather=True)[:, :num_org])

            exchanged, scored = None, True
            if width is not None:
                exchanged, scored = self._exchange_stage1(controller, hidden_states, width, rows)
            try:
                if rows is None or not scored:
                    local = dense_local(hidden_states)
                else:
                    local = controller.compute_logits(
                        hidden_states, rows, dense_local, self._postprocess, exchanged=exchanged
                    )
            except Exception as exc:  # noqa: BLE001
                controller.record_fallback(exc, int(hidden_states.shape[0]))
                local = dense_local(hidden_states)
            padding = lm_head.weight.shape[0] - local.shape[1]
            if padding > 0:  # the shard's padding rows, cut again after the gather
                local = torch.nn.functional.pad(local, (0, padding), value=float("-inf"))
            logits = self._gather_logits(local)
            return logits[..., : self.org_vocab_size] if logits is not None else None

        @staticmethod
        def _exchange_stage1(controller, hidden_states, width, rows):
            """`(gathered keys [B, tp * width] or None, scored)`: the stage-1 exchange, one all-gather over the TP
            group, reached once by every rank of an armed step (each rank's keys: `FlashHeadController.stage1_payload`).
            `scored` is False when this rank could not score its share, or the exchange failed (counted): its shard is
            then served dense."""
            import torch
            from vllm.distributed import tensor_model_parallel_all_gather

            payload, scored = controller.stage1_payload(hidden_states, width, rows)
            try:
                # The int64 payload's bytes travel as float32 pairs (vLLM's CPU shared-memory all-gather has no int64
                # kernel); an all-gather only copies them, and each rank's pairs stay whole along the last dim.
                gathered = tensor_model_parallel_all_gather(payload.contiguous().view(torch.float32), dim=-1)
                return controller.stage1_received(gathered.contiguous().view(torch.int64), width), scored
            except Exception as exc:  # noqa: BLE001 - a communicator that refuses the exchange
                controller.record_fallback(exc, int(hidden_states.shape[0]))
                return None, False

    _subclass = FlashHeadLogitsProcessor
    return _subclass


def apply() -> None:
    """Register the subclass; raises if another plugin already replaced `LogitsProcessor`."""
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    ours = subclass()
    current = op_registry_oot.get(LogitsProcessor.__name__)
    if current is ours:
        return
    if current is not None:
        raise RuntimeError(f"LogitsProcessor is already replaced by {current.__module__}.{current.__qualname__}")
    LogitsProcessor.register_oot(ours)
