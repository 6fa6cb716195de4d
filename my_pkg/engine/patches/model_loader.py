"""Builds FlashHead's head as soon as vLLM's model loader has the weights in their runtime format.

`TARGET`: `process_weights_after_loading` as vLLM's `BaseModelLoader.load_model` calls it, the last
step of loading a model. The runners' `load_model` hooks (`model_runner.py`, `model_runner_v2.py`)
cannot build the head after the first load: the FlashHead hooks are installed while vLLM resolves the
architecture, inside that very `load_model` call, so the call already running is vLLM's own. The loader
looks this function up in its module when it calls it, after the model is built, so the hook installed
then serves the first load too: vLLM profiles memory and sizes the KV cache with the head and its tables
allocated. Draft models load through the same function. Under sleep mode, or when the LM head is not one
module, the first logits call builds the head. Never raises: on failure the same fallback.

Under tensor parallelism the ranks then agree, with one all-reduce that every rank of a FlashHead model
reaches (whatever failed before it), whether each can serve FlashHead: when one cannot (its assets
could not be read, its head failed to build), none does, so that no rank ever waits in a stage-1
exchange another skips.
"""

from __future__ import annotations

import functools
from typing import Any

from my_pkg.engine.patches.runner_hooks import (
    controller_in,
    every_rank,
    lm_head_of,
    tensor_parallel,
    warn_once,
    wrap_once,
)
from my_pkg.engine.setup import build_head
from my_pkg.engine.vllm_uses import attributes, symbol

#: The module whose `process_weights_after_loading` (the name `BaseModelLoader.load_model` calls) is wrapped.
TARGET = "vllm.model_executor.model_loader.base_loader"
#: What the hook relies on beyond its imports (`my_pkg.devtools.compat` checks it).
VLLM_SYMBOLS = (
    symbol(
        "vllm.model_executor.model_loader.base_loader:process_weights_after_loading",
        "function",
        params=("model", "model_config", "target_device"),
    ),
    *attributes("vllm.config:ModelConfig", "enable_sleep_mode"),
)


def build_after_loading(model: Any, model_config: Any) -> None:
    """Build the head of `model`'s FlashHead controller over its LM head, when it has one not yet built."""
    controller = controller_in(model)
    if controller is None or controller.head is not None or not controller.available:
        return
    if getattr(model_config, "enable_sleep_mode", False):
        return  # the weights sit in the sleep-mode pool: see `runner_hooks.prepare_after_load`
    lm_head = lm_head_of(model)
    if lm_head is not None:
        build_head(controller, lm_head)


def agree_after_loading(model: Any, model_config: Any, device: Any) -> None:
    """Tensor parallelism: every rank of a model with FlashHead assets (config.json says so, alike on every rank)
    learns whether every rank's controller can serve (`FlashHeadController.agree`)."""
    hf_config = getattr(model_config, "hf_config", None)
    if not getattr(hf_config, "flash_head_cache_dir", None) or not tensor_parallel():
        return
    controller = None
    try:
        controller = controller_in(model)
    except Exception as exc:  # noqa: BLE001 - this rank cannot serve; it still takes part
        warn_once("process_weights_after_loading", exc)
    available = controller is not None and controller.available
    try:
        agreed = every_rank(available, device)
    except Exception as exc:  # noqa: BLE001 - no agreement: dense on this rank (the collective failed alike)
        warn_once("tensor-parallel agreement", exc)
        agreed = False
    if controller is not None:
        controller.agree(agreed)


def apply() -> None:
    import vllm.model_executor.model_loader.base_loader as base_loader

    original = base_loader.process_weights_after_loading

    @functools.wraps(original)
    def process_weights_after_loading(model, model_config, target_device, *args, **kwargs):
        result = original(model, model_config, target_device, *args, **kwargs)
        try:
            build_after_loading(model, model_config)
        except Exception as exc:  # noqa: BLE001 - the first logits call builds it instead
            warn_once("process_weights_after_loading", exc)
        agree_after_loading(model, model_config, target_device)
        return result

    wrap_once(base_loader, "process_weights_after_loading", process_weights_after_loading)
