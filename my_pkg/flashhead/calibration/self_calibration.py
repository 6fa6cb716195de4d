"""Self-calibration: hidden states of the dense model's own samples, for a build without calibration text.

:func:`generate_calibration_states` samples a loaded causal LM (``generate`` with hidden states, as
Hugging Face models offer it; :func:`~my_pkg.flashhead.hf.load_causal_lm` loads one) from short prompts
and keeps the LM head's input at every generated position, float32 on the CPU.  Seeded and bounded by a
state count and a time budget; :meth:`SelfCalibration.record` is what the build records about it.
The model and tokenizer are typed ``Any``: ``transformers`` is imported by :mod:`my_pkg.flashhead.hf` alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

__all__ = ["SELF_CALIBRATION_PROMPTS", "SelfCalibration", "generate_calibration_states"]

#: Short, varied openings the dense model continues when a build has no calibration text ("" is BOS alone):
#: prose, code, lists, dialogue, markup and numbers, so the sampled text covers more than one style.
SELF_CALIBRATION_PROMPTS: tuple[str, ...] = (
    "",
    "The",
    "In this",
    "Once upon a time",
    "Hello",
    "We",
    "It is",
    "A",
    "Why",
    "How to",
    "Note:",
    "Example:",
    "Summary:",
    "Q:",
    "1.",
    "-",
    "#",
    "def ",
    "import ",
    "class ",
    "for i in",
    "if ",
    "return",
    "This function",
    "The following",
    '{"',
    "<p>",
    "$ ",
    "2024",
    "Table",
)


@dataclass
class SelfCalibration:
    """Hidden states of the dense model's own samples (:func:`generate_calibration_states`) and how they were made."""

    hidden: torch.Tensor
    sequences: int
    rounds: int
    seconds: float
    stopped_by_time: bool
    settings: dict[str, Any]

    def record(self) -> dict[str, Any]:
        return {
            **self.settings,
            "states": int(self.hidden.shape[0]),
            "sequences": self.sequences,
            "rounds": self.rounds,
            "seconds": round(self.seconds, 1),
            "stopped_by_time": self.stopped_by_time,
        }


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for value in (
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
        getattr(model.config, "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def _final_norm_needed(model: Any, device: torch.device) -> bool:
    """Whether the last element of ``output_hidden_states`` still needs the final norm to give the logits."""
    ids = torch.tensor([[1, 2, 3, 4]], device=device) % model.config.vocab_size
    out = model(input_ids=ids, output_hidden_states=True)
    hs, head = out.hidden_states[-1][0], model.get_output_embeddings()
    if torch.allclose(head(hs).float(), out.logits[0].float(), rtol=1e-3, atol=1e-3):
        return False
    norm = getattr(getattr(model, "model", None), "norm", None)
    if norm is not None and torch.allclose(head(norm(hs)).float(), out.logits[0].float(), rtol=1e-3, atol=1e-3):
        return True
    raise RuntimeError("cannot reproduce the model's logits from its last hidden state")


@torch.no_grad()
def generate_calibration_states(
    model: Any,
    tokenizer: Any,
    *,
    max_states: int = 16384,
    new_tokens: int = 96,
    temperature: float = 1.0,
    top_p: float = 0.95,
    seed: int = 0,
    time_budget_s: float = 600.0,
    prompts: tuple[str, ...] = SELF_CALIBRATION_PROMPTS,
    progress: bool = False,
) -> SelfCalibration:
    """Sample the dense model from ``prompts`` and keep the LM head's input at every generated position.

    A decode step sees the hidden state of the model's own previous outputs, so these states are what a
    served model's head sees.  Each round samples one continuation of every prompt (BOS, when the
    tokenizer has one, then the prompt; batch of ``len(prompts)``, left-padded) for up to ``new_tokens``
    tokens (fewer when the context is shorter), with ``temperature`` / ``top_p``, seeded by
    ``seed + round``; rounds repeat until ``max_states`` states or ``time_budget_s`` seconds.  A
    sequence's states end at its first EOS.  States are float32 on the CPU, round by round.
    """
    if max_states < 1 or new_tokens < 1 or time_budget_s <= 0 or temperature <= 0 or not 0 < top_p <= 1:
        raise ValueError("max_states, new_tokens, time_budget_s, temperature must be positive; top_p in (0, 1]")
    device = next(model.parameters()).device
    norm = getattr(getattr(model, "model", None), "norm", None) if _final_norm_needed(model, device) else None
    eos = _eos_ids(model, tokenizer)
    start_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (min(eos) if eos else 0)
    encoded = [
        ([] if start_id is None else [int(start_id)])
        + list(tokenizer(p, add_special_tokens=False).input_ids if p else [])
        for p in prompts
    ]
    encoded = [e if e else [pad_id] for e in encoded]
    width = max(len(e) for e in encoded)
    context = getattr(model.config, "max_position_embeddings", None)
    steps = min(new_tokens, context - width) if isinstance(context, int) and context > width else new_tokens
    input_ids = torch.tensor([[pad_id] * (width - len(e)) + e for e in encoded], device=device)
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded], device=device)
    eos_tensor = torch.tensor(sorted(eos), dtype=torch.int64, device=device)
    states: list[torch.Tensor] = []
    count, rounds, t0 = 0, 0, time.perf_counter()
    stopped_by_time = False
    bar = tqdm(total=max_states, desc="self-calibration", unit="state", disable=not progress)
    devices = [device] if device.type == "cuda" else []
    while count < max_states:
        remaining = time_budget_s - (time.perf_counter() - t0)
        if remaining <= 0:
            stopped_by_time = True
            break
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed + rounds)
            out = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                do_sample=True,
                temperature=temperature,
                top_p=top_p,
                top_k=0,
                max_new_tokens=steps,
                min_new_tokens=0,
                pad_token_id=pad_id,
                eos_token_id=sorted(eos) or None,
                output_hidden_states=True,
                return_dict_in_generate=True,
                max_time=remaining,
            )
        rounds += 1
        generated = out.sequences[:, width:]
        last = [step[-1][:, -1, :] for step in out.hidden_states]  # [B, H] per step, the head's input
        hs = torch.stack(last[: generated.shape[1]], dim=1)  # [B, T, H]
        if norm is not None:
            hs = norm(hs)
        is_eos = (
            torch.isin(generated, eos_tensor) if eos_tensor.numel() else torch.zeros_like(generated, dtype=torch.bool)
        )
        before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()  # EOS strictly before this position
        keep = hs[before == 0].float().cpu()[: max_states - count]
        states.append(keep)
        count += keep.shape[0]
        bar.update(keep.shape[0])
        if time.perf_counter() - t0 >= time_budget_s and count < max_states:
            stopped_by_time = True
            break
    bar.close()
    hidden = torch.cat(states) if states else torch.empty(0, model.config.hidden_size)
    settings = {
        "prompts": len(prompts),
        "new_tokens": steps,
        "temperature": temperature,
        "top_p": top_p,
        "seed": seed,
        "max_states": max_states,
        "time_budget_s": time_budget_s,
    }
    return SelfCalibration(
        hidden=hidden,
        sequences=rounds * len(prompts),
        rounds=rounds,
        seconds=time.perf_counter() - t0,
        stopped_by_time=stopped_by_time,
        settings=settings,
    )
