"""Register the `FlashHead*` architectures with vLLM's `ModelRegistry`.

A FlashHead checkpoint names `FlashHead<Base>` in config.json `architectures`;
each maps to vLLM's own class for `<Base>`, so vLLM refuses such a model
without this plugin and a standard model is never touched.

Resolving a `FlashHead*` architecture (which vLLM does right before it builds
the model) is also what registers the FlashHead logits processor
(`patches/logits_processor.py`): nothing else in vLLM changes for other models.
"""

from __future__ import annotations

from my_pkg.engine.vllm_uses import attributes, symbol

TARGET = "vllm.ModelRegistry"
#: What `apply` relies on beyond its imports (`my_pkg.devtools.compat` checks it): `ModelRegistry` is an
#: instance, and a registered entry is rebuilt from its two leading fields.
VLLM_SYMBOLS = (
    symbol("vllm:ModelRegistry", "attribute"),
    symbol("vllm.model_executor.models.registry:_LazyRegisteredModel", "class", params=("module_name", "class_name")),
    *attributes("vllm.model_executor.models.registry:_LazyRegisteredModel", "module_name", "class_name"),
)
PREFIX = "FlashHead"
BASE_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma2ForCausalLM",
    "GemmaForCausalLM",
    "Phi3ForCausalLM",
    "GraniteForCausalLM",
    "Olmo2ForCausalLM",
)


def flashhead_architectures(supported: set[str]) -> dict[str, str]:
    """`FlashHead<Base>` → `<Base>` for every base architecture this vLLM supports."""
    return {PREFIX + base: base for base in BASE_ARCHITECTURES if base in supported}


def apply() -> None:
    from vllm import ModelRegistry
    from vllm.model_executor.models.registry import _LazyRegisteredModel

    from my_pkg.engine.patches.flashhead_model_entry import FlashHeadRegisteredModel

    registered = ModelRegistry.models
    entries = {}
    for flash_name, base in flashhead_architectures(set(registered)).items():
        entry = registered[base]
        if not isinstance(entry, _LazyRegisteredModel):
            raise RuntimeError(f"{base} is not a lazily registered vLLM model")
        entries[flash_name] = FlashHeadRegisteredModel(entry.module_name, entry.class_name)
    registered.update(entries)
