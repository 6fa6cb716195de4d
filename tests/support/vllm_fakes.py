"""Stand-ins for the vLLM objects the engine half's unit tests hand to its patches."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.nn.functional as F


class UnquantizedEmbeddingMethod:
    """Stands in for vLLM's class of the same name (the plugin matches it by name): the dense product."""

    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.weight, bias)


@contextmanager
def default_vllm_config() -> Iterator[None]:
    """A default vLLM config in context, as during model construction (no model: no FlashHead)."""
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield
