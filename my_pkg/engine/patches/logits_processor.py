"""Serve FlashHead models' decode steps through FlashHead.

Uses vLLM's official replacement point: `LogitsProcessor` is a
`PluggableLayer`, and `register_oot` makes every later `LogitsProcessor(...)`
build our subclass. For a model without FlashHead assets the subclass holds no
controller and every call goes straight to vLLM's own `forward`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(f"vllm.{__name__}")

TARGET = "vllm.model_executor.layers.logits_processor.LogitsProcessor"
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


def _unsupported_reason(vllm_config: Any) -> str | None:
    parallel = vllm_config.parallel_config
    if getattr(parallel, "tensor_parallel_size", 1) > 1:
        return "tensor parallel size > 1 (the head is sharded over ranks); dense head in use"
    if getattr(parallel, "pipeline_parallel_size", 1) > 1:
        return "pipeline parallel size > 1 is not supported; dense head in use"
    if getattr(vllm_config, "speculative_config", None) is not None:
        return "speculative decoding is enabled (draft/verify rows need dense logits); dense head in use"
    if getattr(vllm_config, "use_v2_model_runner", False):
        return (
            "vLLM's Model Runner V2 is in use, which this plugin does not hook yet; "
            "set VLLM_USE_V2_MODEL_RUNNER=0 to use FlashHead"
        )
    model_config = vllm_config.model_config
    head_dtype = getattr(model_config, "head_dtype", None)
    if head_dtype is not None and head_dtype != model_config.dtype:
        return f"head_dtype {head_dtype} differs from the model dtype {model_config.dtype}; dense head in use"
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

    from my_pkg.engine.flashhead_control import FlashHeadController

    reason = _unsupported_reason(vllm_config)
    if reason is None:
        try:
            from my_pkg.engine.patches import model_runner

            model_runner.apply()
        except Exception as exc:  # noqa: BLE001 - vLLM internals moved: stay dense
            reason = f"vLLM's model runner could not be hooked ({exc}); dense head in use"
    return FlashHeadController.from_model_dir(
        _resolve_model_dir(model_config),
        config,
        vocab_size=org_vocab_size,
        device_type=str(getattr(vllm_config.device_config, "device_type", "cpu")),
        unavailable_reason=reason,
    )


def _is_plain_weight(lm_head: Any) -> bool:
    method = type(getattr(lm_head, "quant_method", None)).__name__
    return method in ("UnquantizedEmbeddingMethod", "UnquantizedLinearMethod")


def subclass() -> type:
    """Build (once) the `LogitsProcessor` subclass; vLLM is imported only here."""
    global _subclass
    if _subclass is not None:
        return _subclass
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

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
            controller = self._my_pkg_flashhead
            if controller is None or skip_gather or embedding_bias is not None:
                return super().forward(lm_head, hidden_states, embedding_bias, skip_gather)
            try:
                rows = controller.take_step()
                if rows is None:  # warm-up, prompt logprobs, drafter: vLLM's own head
                    return super().forward(lm_head, hidden_states, embedding_bias, skip_gather)
                if controller.head is None and controller.available:
                    if not _is_plain_weight(lm_head):
                        controller.make_unavailable(
                            f"the LM head is quantized ({type(lm_head.quant_method).__name__}); dense head in use"
                        )
                    else:
                        controller.bind(lm_head.weight)

                def dense(rows_hidden):
                    return LogitsProcessor.forward(self, lm_head, rows_hidden)

                return controller.compute_logits(hidden_states, rows, dense, self._postprocess)
            except Exception as exc:  # noqa: BLE001 - FlashHead must never take the engine down
                controller.record_fallback(exc, int(hidden_states.shape[0]))
                return super().forward(lm_head, hidden_states, embedding_bias, skip_gather)

    _subclass = FlashHeadLogitsProcessor
    return _subclass


def apply() -> None:
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    ours = subclass()
    current = op_registry_oot.get(LogitsProcessor.__name__)
    if current is ours:
        return
    if current is not None:
        raise RuntimeError(f"LogitsProcessor is already replaced by {current.__module__}.{current.__qualname__}")
    LogitsProcessor.register_oot(ours)
