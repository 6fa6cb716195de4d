"""Build a small EAGLE-1 head for a tiny Llama checkpoint (`tiny_model.build_tiny_llama`), as vLLM loads one
for `--speculative-config '{"method": "eagle", "model": DIR}'`.

vLLM's EAGLE Llama (`EagleLlamaForCausalLM`) runs one decoder layer over `fc([embed(token), hidden])`, where
`hidden` is the target's last hidden state; a checkpoint without `lm_head` and `embed_tokens` weights shares the
target's LM head and embeddings. So the head written here has only `fc` and one decoder layer (no input
layernorm: vLLM drops it on the first layer), named as EAGLE checkpoints name them (without the `model.`
prefix), and a Llama config with the target's shapes and vocabulary.

The weights are not trained: `fc` passes the target's hidden state through and the layer adds a small random
change, so the head's logits are close to the target's at the previous position. Its drafts are valid tokens of
the target's vocabulary, produced through the target's LM head, which is what the drafter tests need.
"""

from __future__ import annotations

import json
from pathlib import Path


def _build_head(path: str | Path, target: str | Path, kind: str, seed: int, scale: float, tensors, **config) -> Path:
    """Write the head `tensors(hidden, intermediate, kv_width, small)` returns, with a one-layer Llama config of
    the target's shapes and vocabulary (plus `config`), to `path` and return it; a no-op when the same head
    (target config, seed, scale, `config`) is there. `small(*shape)` draws seeded weights of scale `scale`."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    path, target = Path(path), Path(target)
    target_config = json.loads((target / "config.json").read_text())
    marker = path / f"tiny_{kind}_spec.json"
    wanted = json.dumps({"target": target_config, "seed": seed, "scale": scale, **config}, sort_keys=True)
    if marker.is_file() and marker.read_text() == wanted:
        return path
    hidden = target_config["hidden_size"]
    inter = target_config["intermediate_size"]
    heads, kv_heads = target_config["num_attention_heads"], target_config["num_key_value_heads"]
    generator = torch.Generator().manual_seed(seed)

    def small(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    weights = tensors(hidden, inter, kv_heads * (hidden // heads), small)
    llama = LlamaConfig(
        vocab_size=target_config["vocab_size"],
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=target_config["max_position_embeddings"],
        rms_norm_eps=target_config.get("rms_norm_eps", 1e-6),
        bos_token_id=target_config.get("bos_token_id"),
        eos_token_id=target_config.get("eos_token_id"),
        tie_word_embeddings=False,
        torch_dtype="float32",
        architectures=["LlamaForCausalLM"],
        **config,
    )
    path.mkdir(parents=True, exist_ok=True)
    llama.save_pretrained(path)
    save_file({name: t.contiguous() for name, t in weights.items()}, str(path / "model.safetensors"))
    marker.write_text(wanted)
    return path


def build_tiny_eagle(path: str | Path, target: str | Path, seed: int = 0, scale: float = 0.02) -> Path:
    """Write the EAGLE-1 head for the Llama at `target` to `path` and return it (a no-op when it is there)."""
    import torch

    def tensors(hidden, inter, kv_width, small):
        return {
            "fc.weight": torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1),  # [embed, hidden]
            "layers.0.self_attn.q_proj.weight": small(hidden, hidden),
            "layers.0.self_attn.k_proj.weight": small(kv_width, hidden),
            "layers.0.self_attn.v_proj.weight": small(kv_width, hidden),
            "layers.0.self_attn.o_proj.weight": small(hidden, hidden),
            "layers.0.post_attention_layernorm.weight": torch.ones(hidden),
            "layers.0.mlp.gate_proj.weight": small(inter, hidden),
            "layers.0.mlp.up_proj.weight": small(inter, hidden),
            "layers.0.mlp.down_proj.weight": small(hidden, inter),
        }

    return _build_head(path, target, "eagle", seed, scale, tensors)


def build_tiny_eagle3(path: str | Path, target: str | Path, seed: int = 0, scale: float = 0.02) -> Path:
    """Write an EAGLE-3 head for the Llama at `target` to `path` and return it (a no-op when it is there).

    vLLM's `Eagle3LlamaForCausalLM`: `fc` over the target's auxiliary hidden states (here those entering the
    target's layers 0 and 1: `eagle_aux_hidden_state_layer_ids`), one decoder layer (`midlayer`) whose
    attention reads `[embedding, hidden]`, a final norm; no `lm_head`, no `embed_tokens` and no `d2t` (the
    target's vocabulary), so vLLM gives it the target's LM head and embeddings. Untrained, as `build_tiny_eagle`."""
    import torch

    aux_layers = [0, 1]

    def tensors(hidden, inter, kv_width, small):
        last_aux = torch.cat([torch.zeros(hidden, hidden * (len(aux_layers) - 1)), torch.eye(hidden)], dim=1)
        return {
            "fc.weight": last_aux,
            "midlayer.input_layernorm.weight": torch.ones(hidden),
            "midlayer.hidden_norm.weight": torch.ones(hidden),
            "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
            "midlayer.self_attn.q_proj.weight": small(hidden, 2 * hidden),
            "midlayer.self_attn.k_proj.weight": small(kv_width, 2 * hidden),
            "midlayer.self_attn.v_proj.weight": small(kv_width, 2 * hidden),
            "midlayer.self_attn.o_proj.weight": small(hidden, hidden),
            "midlayer.mlp.gate_proj.weight": small(inter, hidden),
            "midlayer.mlp.up_proj.weight": small(inter, hidden),
            "midlayer.mlp.down_proj.weight": small(hidden, inter),
            "norm.weight": torch.ones(hidden),
        }

    return _build_head(
        path,
        target,
        "eagle3",
        seed,
        scale,
        tensors,
        eagle_aux_hidden_state_layer_ids=aux_layers,
        num_aux_hidden_states=len(aux_layers),
    )
