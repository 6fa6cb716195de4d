"""The `ModelRegistry` entry of a `FlashHead*` architecture (imported by `model_registry.apply`).

It loads vLLM's own class for the base architecture, after installing every
FlashHead hook (`patches.on_flashhead_model`): vLLM resolves the architecture
right before it builds the model, once every general plugin has loaded. The class lives at
module level so that vLLM's model-inspection subprocess can unpickle it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from vllm.model_executor.models.registry import _LazyRegisteredModel

from my_pkg.engine.vllm_uses import symbol

#: The subclass below stays a frozen dataclass and overrides `load_model_cls` (`my_pkg.devtools.compat`).
VLLM_SYMBOLS = (
    symbol("vllm.model_executor.models.registry:_LazyRegisteredModel", "class", decorator="dataclass(frozen=True)"),
    symbol("vllm.model_executor.models.registry:_LazyRegisteredModel.load_model_cls", "method", params=("self",)),
)


@dataclass(frozen=True)
class FlashHeadRegisteredModel(_LazyRegisteredModel):
    def load_model_cls(self) -> type[nn.Module]:
        from my_pkg.engine.patches import on_flashhead_model

        on_flashhead_model()
        return super().load_model_cls()
