"""Engine half of my_pkg (`vllm.general_plugins` entry point `my_pkg_engine`).

vLLM calls `register()` in every process it starts (API server, engine core,
each worker), possibly several times. It is idempotent, imports vLLM only
inside the patches, never raises, and with `MY_PKG_DISABLE=1` changes nothing.
"""

from __future__ import annotations

import logging
from importlib import import_module

from my_pkg.env import plugin_disabled

logger = logging.getLogger(f"vllm.{__name__}")

# Applied in order; each is independent, so one that fails leaves the others in place.
# `logits_processor` and `model_runner` (or `model_runner_v2`) are applied later, only for a FlashHead model.
PATCHES = ("worker", "model_registry")

_applied: dict[str, bool] = {}
_registered = False


def register() -> None:
    """Apply every patch once per process; log one warning per patch that cannot apply."""
    global _registered
    if _registered:
        return
    _registered = True
    if plugin_disabled():
        logger.info("my_pkg: MY_PKG_DISABLE is set; vLLM left untouched")
        return
    for name in PATCHES:
        module = import_module(f"my_pkg.engine.patches.{name}")
        try:
            module.apply()
            _applied[name] = True
        except Exception as exc:  # noqa: BLE001 - a moved vLLM internal must not break vLLM
            _applied[name] = False
            logger.warning(
                "my_pkg: could not patch %s (%s: %s); that part of the plugin is off and vLLM is unchanged there",
                module.TARGET, type(exc).__name__, exc,
            )


def applied_patches() -> dict[str, bool]:
    """Which patches this process applied (empty when disabled or not registered)."""
    return dict(_applied)
