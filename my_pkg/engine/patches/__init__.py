"""Everything this plugin changes inside vLLM, one module per vLLM component.

Each module has `TARGET` (what it changes) and `apply() -> None`, which resolves every vLLM
symbol it needs before changing anything (so a moved internal leaves vLLM as it was and
raises), and is idempotent. Two moments install them:

1. `my_pkg.engine.register()`, in every vLLM process: `PATCHES`.
   - `worker`: adds the `my_pkg_*` methods (`my_pkg.engine.rpc`) to vLLM's `WorkerBase`.
   - `model_registry`: registers the `FlashHead*` architectures, each mapped to vLLM's own
     class (`flashhead_model_entry`).
   - `top_p_sampler`: vLLM's CPU top-k/top-p masks without sorting every row (the same law,
     `my_pkg.sampling.top_p`); off with `MY_PKG_FAST_TOP_P=0`.
2. `on_flashhead_model()`, called by that registry entry when vLLM resolves a `FlashHead*`
   architecture, right before it builds the model: `FLASHHEAD_HOOKS`.
   - `logits_processor`: an out-of-tree `LogitsProcessor` that serves the decode steps through
     FlashHead; correct whatever `self` it is called with (vLLM's LoRA wrapper).
   - `model_runner`: which logits call is the decode step of the V1 GPU/CPU model runner, what
     each row asked for, and the head built right after the weights load.
   - `compact_sampler`: the V1 sampler draws FlashHead's compact sampled rows from their compact law
     (`my_pkg.engine.flashhead.compact_step`); off with `MY_PKG_FLASHHEAD_COMPACT_SAMPLING=0`.
   - `model_runner_v2`: the same for Model Runner V2 (the CUDA default).
   - `spec_proposer`: FlashHead as the drafter's head under speculative decoding (a draft model that
     is itself a FlashHead checkpoint): vLLM's `SpecDecodeBaseProposer`.
   `runner_hooks` holds what the two runner hooks share and the lookups of a runner's or a
   worker's controller.
"""

from __future__ import annotations

import logging
from importlib import import_module
from typing import Any

from my_pkg.engine.vllm_uses import attributes

#: Read on the vLLM config (`my_pkg.devtools.compat` checks it; the imports it derives).
VLLM_SYMBOLS = (*attributes("vllm.config:VllmConfig", "use_v2_model_runner"),)

logger = logging.getLogger(f"vllm.{__name__}")

#: Applied by `my_pkg.engine.register()` in every process.
PATCHES = ("worker", "model_registry", "top_p_sampler")
#: Installed by `on_flashhead_model()`, once a FlashHead model is about to be built.
FLASHHEAD_HOOKS = (
    "logits_processor",
    "model_loader",
    "model_runner",
    "compact_sampler",
    "model_runner_v2",
    "spec_proposer",
)

_NOT_TRIED = "not installed (no FlashHead architecture was resolved in this process)"
#: The V1 runner's speculative-decoding metadata hook (`model_runner.py` records it, `setup.py` reads it).
SPEC_METADATA_HOOK = "model_runner.spec_metadata"
_hook_errors: dict[str, str | None] = {}
_warned: set[str] = set()


def on_flashhead_model() -> None:
    """Install every FlashHead hook the process building the model needs; never raises.

    In the process that builds the model (a vLLM config is current: the worker) that is all of
    `FLASHHEAD_HOOKS`; elsewhere (vLLM's model-inspection subprocess) only the logits processor,
    which is all such a process meets. A hook that cannot be installed is recorded: the logits
    processor's failure (another plugin holds the slot) is logged once and answers the status route
    (`logits_processor_taken`); a runner hook's failure makes the controller unavailable only when
    vLLM runs that runner (`runner_hook_failed`, see `runner_hook_failure`).
    """
    try:
        from vllm.config import get_current_vllm_config_or_none

        building = get_current_vllm_config_or_none() is not None
    except Exception:  # noqa: BLE001 - a moved helper: install them all
        building = True
    for name in FLASHHEAD_HOOKS if building else FLASHHEAD_HOOKS[:1]:
        try:
            import_module(f"{__name__}.{name}").apply()
            _hook_errors[name] = None
        except Exception as exc:  # noqa: BLE001 - a moved vLLM internal must not break vLLM
            _hook_errors[name] = str(exc) or type(exc).__name__
            if name == "logits_processor" and _hook_errors[name] not in _warned:
                _warned.add(_hook_errors[name])
                logger.warning("my_pkg: FlashHead cannot hook vLLM's logits: %s; dense head in use", exc)
            else:
                logger.debug("my_pkg: %s not hooked: %s", name, exc)


def hook_error(name: str) -> str | None:
    """Why the FlashHead hook `name` is not installed in this process; None when it is."""
    return _hook_errors.get(name, _NOT_TRIED)


def record_hook_error(name: str, error: str | None) -> None:
    """What a hook module found when it installed part `name` of itself (None: installed)."""
    _hook_errors[name] = error


def runner_hook_failure(vllm_config: Any) -> tuple[str, str] | None:
    """`("runner_hook_failed", message)` when the hook of the model runner vLLM uses is not installed.

    Called while the model is built (a vLLM config is current). vLLM caches a resolved architecture,
    so when this process resolved it earlier without a config, the hooks are installed now, through
    the same entry."""
    v2 = bool(getattr(vllm_config, "use_v2_model_runner", False))
    name = "model_runner_v2" if v2 else "model_runner"
    if name not in _hook_errors:
        on_flashhead_model()
    error = hook_error(name)
    if error is None:
        return None
    runner = "Model Runner V2" if v2 else "model runner"
    return "runner_hook_failed", f"vLLM's {runner} could not be hooked ({error}); dense head in use"


def no_controller_status() -> Any:
    """The `FlashHeadState` of a worker whose model has no controller, with the reason."""
    from my_pkg.engine.flashhead.report import status_without_controller

    error = _hook_errors.get("logits_processor")
    if error is not None:
        return status_without_controller(
            "logits_processor_taken", f"FlashHead cannot hook vLLM's logits: {error}; dense head in use"
        )
    return status_without_controller()
