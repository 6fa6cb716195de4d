"""Engine half of my_pkg (`vllm.general_plugins` entry point `my_pkg_engine`).

vLLM calls `register()` in every process it starts (API server, engine core,
each worker), possibly several times. It is idempotent, imports vLLM only
inside the patches, never raises, and with `MY_PKG_DISABLE=1` changes nothing.

Reading order: `patches/` (what changes in vLLM, and when), `flashhead/` (FlashHead
in one worker: the controller and its parts), `rpc.py` (the worker methods the
admin API calls).
"""

from __future__ import annotations

import logging
from importlib import import_module

from my_pkg.env import plugin_disabled

logger = logging.getLogger(f"vllm.{__name__}")

_registered = False


def register() -> None:
    """Apply `patches.PATCHES` once per process; log one warning per patch that cannot apply.

    Each is independent, so one that fails leaves the others in place. The FlashHead hooks are
    installed later, by the registry entry of a FlashHead model (`patches.on_flashhead_model`).
    """
    global _registered
    if _registered:
        return
    _registered = True
    if plugin_disabled():
        logger.info("my_pkg: MY_PKG_DISABLE is set; vLLM left untouched")
        return
    from my_pkg.engine.patches import PATCHES

    for name in PATCHES:
        module = import_module(f"my_pkg.engine.patches.{name}")
        try:
            module.apply()
        except Exception as exc:  # noqa: BLE001 - a moved vLLM internal must not break vLLM
            logger.warning(
                "my_pkg: could not patch %s (%s: %s); that part of the plugin is off and vLLM is unchanged there",
                module.TARGET,
                type(exc).__name__,
                exc,
            )
