"""Build small random-weight Hugging Face checkpoints that vLLM can serve.

The models are random, so what they generate is gibberish, but they are real
checkpoints: config.json, model.safetensors and a tokenizer, loaded by vLLM
exactly like a model from a hub.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Shape of a random Llama checkpoint."""

    vocab_size: int = 4096
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = False
    seed: int = 0


def _build_tokenizer(vocab_size: int):
    """A word-level tokenizer over a synthetic vocabulary of `vocab_size` entries.

    Common English words come first so prompts tokenize to real ids; the rest
    are filler tokens. Byte-free and deterministic.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    words = (
        "the of and to a in is it you that he was for on are with as his they be at one have "
        "this from or had by hot word but what some we can out other were all there when up use "
        "your how said an each she which do their time if will way about many then them write "
        "would like so these her long make thing see him two has look more day could go come did "
        "number sound no most people my over know water than call first who may down side been "
        "now find any new work part take get place made live where after back little only round "
        "man year came show every good me give our under name very through just form sentence "
        "great think say help low line differ turn cause much mean before move right boy old too "
        "same tell does set three want air well also play small end put home read hand port large "
        "spell add even land here must big high such follow act why ask men change went light kind "
        "off need house picture try us again animal point mother world near build self earth father "
        "head stand own page should country found answer school grow study still learn plant cover "
        "food sun four between state keep eye never last let thought city tree cross farm hard start "
        "might story saw far sea draw left late run while press close night real life few north "
        '{ } [ ] : , " . ! ? 0 1 2 3 4 5 6 7 8 9 json name age true false null hello world'
    ).split()
    vocab: dict[str, int] = {}
    for token in specials + words:
        if token not in vocab and len(vocab) < vocab_size:
            vocab[token] = len(vocab)
    filler = 0
    while len(vocab) < vocab_size:
        vocab[f"w{filler}"] = len(vocab)
        filler += 1
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_llama(path: str | Path, spec: TinyLlamaSpec = TinyLlamaSpec()) -> Path:
    """Write a random Llama checkpoint with a tokenizer to `path` and return it.

    Re-running with the same spec is a no-op when the checkpoint is already there.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    marker = path / "tiny_model_spec.json"
    wanted = json.dumps(spec.__dict__, sort_keys=True)
    if marker.is_file() and marker.read_text() == wanted:
        return path
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    # A random head gives near-uniform logits; widen the spread so greedy
    # decoding has clear winners, as a trained head does.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path, safe_serialization=True)
    _build_tokenizer(spec.vocab_size).save_pretrained(path)
    marker.write_text(wanted)
    return path


def build_tiny_lora(path: str | Path, base_model: str | Path, rank: int = 8, seed: int = 1) -> Path:
    """Write a random PEFT LoRA adapter (q_proj and v_proj of every layer) for `base_model`.

    The adapter is strong enough to change greedy outputs, so a request that
    names it visibly runs through vLLM's LoRA path.
    """
    import torch
    from safetensors.torch import save_file

    path, base_model = Path(path), Path(base_model)
    config = json.loads((base_model / "config.json").read_text())
    hidden = config["hidden_size"]
    head_dim = hidden // config["num_attention_heads"]
    out_features = {"q_proj": hidden, "v_proj": config["num_key_value_heads"] * head_dim}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, out in out_features.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator) / hidden**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=generator)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": str(base_model),
                "r": rank,
                "lora_alpha": rank,
                "lora_dropout": 0.0,
                "bias": "none",
                "target_modules": sorted(out_features),
                "fan_in_fan_out": False,
                "modules_to_save": None,
            },
            indent=2,
        )
    )
    return path
