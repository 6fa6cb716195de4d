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

The subclass's constructor makes the model's `FlashHeadController`
(`my_pkg.engine.setup.make_controller`); the loader hook builds its head right
after the weights load (`setup.build_head`), or the first logits call does.

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
from typing import Any

from my_pkg.engine.setup import build_head, make_controller
from my_pkg.engine.vllm_uses import attributes, symbol

logger = logging.getLogger(f"vllm.{__name__}")

TARGET = "vllm.model_executor.layers.logits_processor.LogitsProcessor"
#: What the subclass relies on beyond its imports (`my_pkg.devtools.compat` checks it): vLLM's forward and
#: helpers called with `self`, the LM head and its shard.
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
    *attributes("vllm.lora.layers.logits_processor:LogitsProcessorWithLoRA", "base_layer"),
    *attributes(
        "vllm.model_executor.layers.vocab_parallel_embedding:VocabParallelEmbedding", "tp_size", "shard_indices"
    ),
    *attributes(
        "vllm.model_executor.layers.vocab_parallel_embedding:VocabParallelEmbeddingShardIndices", "num_org_elements"
    ),
)
CONTROLLER_ATTR = "_my_pkg_flashhead"
_subclass: type | None = None


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
                    self._my_pkg_flashhead = make_controller(self.org_vocab_size)
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
                    build_head(controller, lm_head)  # the load hook did not (see runner_hooks)
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
