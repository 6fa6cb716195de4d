"""The `ModelRegistry` entry of a `FlashHead*` architecture (imported by `model_registry.apply`).

It loads vLLM's own class for the base architecture, after registering the
FlashHead logits processor: vLLM resolves the architecture right before it
builds the model, once every general plugin has loaded. The class lives at
module level so that vLLM's model-inspection subprocess can unpickle it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from vllm.model_executor.models.registry import _LazyRegisteredModel


@dataclass(frozen=True)
class FlashHeadRegisteredModel(_LazyRegisteredModel):
    def load_model_cls(self) -> type[nn.Module]:
        from my_pkg.engine.patches import logits_processor

        logits_processor.ensure_applied()
        return super().load_model_cls()
