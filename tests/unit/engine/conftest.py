"""Shared by the engine tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def flashhead_hooks():
    """Every FlashHead hook installed, as when a worker resolves a FlashHead architecture; the
    `LogitsProcessor` replacement is taken back afterwards so that other tests build vLLM's own."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.custom_op import op_registry_oot

    from my_pkg.engine import patches

    before = op_registry_oot.get("LogitsProcessor")
    with set_current_vllm_config(VllmConfig()):  # as in the worker that builds the model
        patches.on_flashhead_model()
    yield patches
    if before is None:
        op_registry_oot.pop("LogitsProcessor", None)
    else:
        op_registry_oot["LogitsProcessor"] = before


@pytest.fixture(autouse=True)
def flashhead_at_every_batch(monkeypatch):
    """The engine tests' heads are tiny: timed beside the dense head (the default when no threshold is set),
    every step would go dense. These tests check what FlashHead serves; the timing has tests of its own,
    which unset the variable."""
    monkeypatch.setenv("MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD", "never")
