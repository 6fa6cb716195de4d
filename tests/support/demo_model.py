"""The demo's model: a small Llama trained on real English text, with a vocabulary large against its body.

FlashHead pays off when the LM head is a large part of a decode step. This model has a 32,768-token
vocabulary on a hidden size of 384 and a single transformer layer, so on a CPU its dense head costs
several times its body, as the head of a large-vocabulary model does on a GPU.

To stay small in the repository the tied embedding is stored factorised, ``E = low @ proj`` with
``low [V, r]`` and ``proj [r, H]`` (rank ``r`` = 48), and trained that way (which also makes training
fast: the logits are ``(hidden @ proj.T) @ low.T``). :func:`expand_demo_model` multiplies the factors
out and writes an ordinary ``LlamaForCausalLM`` checkpoint, which vLLM serves like any other: its
head is a full ``[V, H]`` matrix.

Training text: the docstrings of the Python standard library (the training split of
:mod:`tests.support.trained_fixture`) and the standard library's code (every top-level statement
outside that module's code calibration / held-out splits). ``heldout.txt`` holds the held-out
docstrings: the model never trained on them; the demo measures FlashHead's fidelity there.

Regenerate (one thread; ``nice`` on a shared machine)::

    python -m tests.support.demo_model --out tests/assets/demo_lm --steps 300 --threads 1

Files: ``weights.safetensors`` (float16: ``embed_low``, ``embed_proj`` and the body's tensors under their
``LlamaForCausalLM`` names), ``tokenizer.json``, ``heldout.txt``, ``meta.json`` (model config, spec,
training log, command).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["DemoSpec", "DEMO_MODEL_DIR", "expand_demo_model", "train_demo_model"]

DEMO_MODEL_DIR = Path(__file__).resolve().parents[1] / "assets" / "demo_lm"


@dataclass(frozen=True)
class DemoSpec:
    """Shape and training settings of the demo model."""

    vocab_size: int = 32768
    hidden_size: int = 384
    rank: int = 48
    num_hidden_layers: int = 1
    num_attention_heads: int = 6
    intermediate_size: int = 768
    max_position_embeddings: int = 256
    context: int = 128
    batch_size: int = 8
    learning_rate: float = 3e-3
    min_learning_rate: float = 1e-4
    weight_decay: float = 0.05
    warmup_steps: int = 40
    seed: int = 0
    heldout_chars: int = 120_000


def _llama_config(spec: DemoSpec) -> Any:
    from transformers import LlamaConfig

    from tests.support.trained_fixture import SPECIAL_TOKENS

    special = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    return LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=special["[PAD]"],
        bos_token_id=special["[BOS]"],
        eos_token_id=special["[EOS]"],
    )


class _FactorisedLM(torch.nn.Module):
    """A Llama body with a tied, factorised embedding ``low @ proj`` (training only)."""

    def __init__(self, spec: DemoSpec) -> None:
        super().__init__()
        from transformers import LlamaModel

        torch.manual_seed(spec.seed)
        config = _llama_config(spec)
        config.vocab_size = 1  # the body's own embedding is never used: inputs come as embeddings
        self.body = LlamaModel(config)
        self.low = torch.nn.Parameter(torch.randn(spec.vocab_size, spec.rank) * 0.02 * math.sqrt(spec.hidden_size))
        self.proj = torch.nn.Parameter(
            torch.randn(spec.rank, spec.hidden_size) / math.sqrt(spec.rank * spec.hidden_size)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        embeds = torch.nn.functional.embedding(ids, self.low) @ self.proj
        hidden = self.body(inputs_embeds=embeds).last_hidden_state
        return (hidden @ self.proj.t()) @ self.low.t()


def _corpus(spec: DemoSpec) -> tuple[list[str], list[str]]:
    """``(training documents, held-out docstrings)``."""
    from tests.support.trained_fixture import (
        FixtureSpec,
        collect_code_documents,
        collect_corpus,
        split_code_documents,
    )

    fixture_spec = FixtureSpec()
    corpus = collect_corpus(fixture_spec)
    code = collect_code_documents()
    held_code = {doc for docs in split_code_documents(code, fixture_spec).values() for doc in docs}
    train = corpus.train + [doc for doc in code if doc not in held_code]
    return train, corpus.heldout


def _loss(model: _FactorisedLM, windows: torch.Tensor) -> torch.Tensor:
    logits = model(windows[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


def train_demo_model(out: Path, spec: DemoSpec, *, steps: int, command: str = "", log: Any = print) -> dict[str, Any]:
    """Collect the text, train the tokenizer and the model for exactly ``steps`` steps, write the files."""
    from safetensors.torch import save_file

    from tests.support.trained_fixture import _windows, token_stream, train_tokenizer

    t0 = time.perf_counter()
    train_docs, heldout_docs = _corpus(spec)
    tokenizer = train_tokenizer(train_docs, spec.vocab_size)
    stream = token_stream(tokenizer, train_docs)
    held = _windows(token_stream(tokenizer, heldout_docs), spec.context)[:16]
    log(
        f"documents: train {len(train_docs)}, held-out {len(heldout_docs)}; tokens {stream.numel():,} "
        f"({time.perf_counter() - t0:.0f} s)"
    )
    model = _FactorisedLM(spec)
    params = [p for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": spec.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=spec.learning_rate,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(spec.seed)
    history: list[dict[str, float]] = []
    start, running = time.perf_counter(), []
    for step in range(steps):
        if step < spec.warmup_steps:
            lr = spec.learning_rate * (step + 1) / spec.warmup_steps
        else:
            progress = (step - spec.warmup_steps) / max(1, steps - spec.warmup_steps)
            lr = spec.min_learning_rate + 0.5 * (spec.learning_rate - spec.min_learning_rate) * (
                1 + math.cos(math.pi * progress)
            )
        for group in opt.param_groups:
            group["lr"] = lr
        offsets = torch.randint(0, stream.numel() - spec.context - 1, (spec.batch_size,), generator=gen)
        batch = torch.stack([stream[o : o + spec.context + 1] for o in offsets.tolist()])
        loss = _loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        running.append(loss.item())
        if (step + 1) % 50 == 0 or step + 1 == steps:
            with torch.no_grad():
                heldout = float(_loss(model.eval(), held))
            model.train()
            entry = {
                "step": step + 1,
                "seconds": round(time.perf_counter() - start, 1),
                "train_loss": round(sum(running) / len(running), 4),
                "heldout_loss": round(heldout, 4),
            }
            history.append(entry)
            log(json.dumps(entry))
            running = []
    out.mkdir(parents=True, exist_ok=True)
    tensors = {"embed_low": model.low.detach(), "embed_proj": model.proj.detach()}
    for name, tensor in model.body.state_dict().items():
        if not name.startswith("embed_tokens") and "rotary" not in name:
            tensors[f"model.{name}"] = tensor
    save_file({k: v.to(torch.float16).contiguous() for k, v in tensors.items()}, str(out / "weights.safetensors"))
    tokenizer.save(str(out / "tokenizer.json"), pretty=False)
    text, size = [], 0
    for doc in heldout_docs:
        if size >= spec.heldout_chars:
            break
        text.append(doc)
        size += len(doc) + 2
    (out / "heldout.txt").write_text("\n\n".join(text) + "\n")
    meta = {
        "description": "Demo model: 1-layer Llama, 32,768-token byte-level BPE, tied factorised embedding, trained "
        "on Python standard-library docstrings and code.",
        "spec": asdict(spec),
        "steps": steps,
        "tokens_trained_on": steps * spec.batch_size * spec.context,
        "training_seconds": round(time.perf_counter() - start, 1),
        "history": history,
        "versions": {"torch": torch.__version__},
        "command": command,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def expand_demo_model(out: Path, source: Path = DEMO_MODEL_DIR) -> Path:
    """Write the committed demo model to ``out`` as an ordinary ``LlamaForCausalLM`` checkpoint (float32).

    The tied embedding is the product of the stored factors. Returns ``out``; a complete ``out`` is kept.
    """
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    meta = json.loads((source / "meta.json").read_text())
    spec = DemoSpec(**meta["spec"])
    stored = load_file(str(source / "weights.safetensors"))
    tensors = {k: v.float() for k, v in stored.items() if k.startswith("model.")}
    tensors["model.embed_tokens.weight"] = stored["embed_low"].float() @ stored["embed_proj"].float()
    out.mkdir(parents=True, exist_ok=True)
    config = _llama_config(spec)
    config.architectures = ["LlamaForCausalLM"]
    (out / "config.json").write_text(config.to_json_string(use_diff=False))
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(source / "tokenizer.json")),
        pad_token="[PAD]",
        unk_token="[UNK]",
        bos_token="[BOS]",
        eos_token="[EOS]",
        model_max_length=spec.max_position_embeddings,
    ).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.demo_model", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    command = (
        f"python -m tests.support.demo_model --out tests/assets/demo_lm --steps {args.steps} --threads {args.threads}"
    )
    train_demo_model(args.out, DemoSpec(), steps=args.steps, command=command, log=lambda s: print(s, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
