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


def build_tiny_eagle(path: str | Path, target: str | Path, seed: int = 0, scale: float = 0.02) -> Path:
    """Write the EAGLE-1 head for the Llama at `target` to `path` and return it (a no-op when it is there)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    path, target = Path(path), Path(target)
    target_config = json.loads((target / "config.json").read_text())
    marker = path / "tiny_eagle_spec.json"
    wanted = json.dumps({"target": target_config, "seed": seed, "scale": scale}, sort_keys=True)
    if marker.is_file() and marker.read_text() == wanted:
        return path
    hidden = target_config["hidden_size"]
    inter = target_config["intermediate_size"]
    heads, kv_heads = target_config["num_attention_heads"], target_config["num_key_value_heads"]
    kv_width = kv_heads * (hidden // heads)
    generator = torch.Generator().manual_seed(seed)

    def small(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    fc = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1)  # [embed, hidden] -> hidden
    tensors = {
        "fc.weight": fc,
        "layers.0.self_attn.q_proj.weight": small(hidden, hidden),
        "layers.0.self_attn.k_proj.weight": small(kv_width, hidden),
        "layers.0.self_attn.v_proj.weight": small(kv_width, hidden),
        "layers.0.self_attn.o_proj.weight": small(hidden, hidden),
        "layers.0.post_attention_layernorm.weight": torch.ones(hidden),
        "layers.0.mlp.gate_proj.weight": small(inter, hidden),
        "layers.0.mlp.up_proj.weight": small(inter, hidden),
        "layers.0.mlp.down_proj.weight": small(hidden, inter),
    }
    config = LlamaConfig(
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
    )
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path / "model.safetensors"))
    marker.write_text(wanted)
    return path


def build_tiny_eagle3(path: str | Path, target: str | Path, seed: int = 0, scale: float = 0.02) -> Path:
    """Write an EAGLE-3 head for the Llama at `target` to `path` and return it (a no-op when it is there).

    vLLM's `Eagle3LlamaForCausalLM`: `fc` over the target's auxiliary hidden states (here those entering the
    target's layers 0 and 1: `eagle_aux_hidden_state_layer_ids`), one decoder layer (`midlayer`) whose
    attention reads `[embedding, hidden]`, a final norm; no `lm_head`, no `embed_tokens` and no `d2t` (the
    target's vocabulary), so vLLM gives it the target's LM head and embeddings. Untrained, as `build_tiny_eagle`."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    path, target = Path(path), Path(target)
    target_config = json.loads((target / "config.json").read_text())
    aux_layers = [0, 1]
    marker = path / "tiny_eagle3_spec.json"
    wanted = json.dumps({"target": target_config, "seed": seed, "scale": scale, "aux": aux_layers}, sort_keys=True)
    if marker.is_file() and marker.read_text() == wanted:
        return path
    hidden = target_config["hidden_size"]
    inter = target_config["intermediate_size"]
    heads, kv_heads = target_config["num_attention_heads"], target_config["num_key_value_heads"]
    kv_width = kv_heads * (hidden // heads)
    generator = torch.Generator().manual_seed(seed)

    def small(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    eye = torch.eye(hidden)
    fc = torch.cat([torch.zeros(hidden, hidden * (len(aux_layers) - 1)), eye], dim=1)  # the last aux state
    tensors = {
        "fc.weight": fc,
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
    config = LlamaConfig(
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
        eagle_aux_hidden_state_layer_ids=aux_layers,
        num_aux_hidden_states=len(aux_layers),
    )
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path / "model.safetensors"))
    marker.write_text(wanted)
    return path
