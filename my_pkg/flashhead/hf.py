"""Hugging Face ``transformers`` I/O: the one module of my_pkg that imports it.

* :func:`load_causal_lm`: a local checkpoint as ``(model, tokenizer)`` in float32, for sampling
  (:func:`~my_pkg.flashhead.calibration.generate_calibration_states`).
* :func:`capture_hidden_states`: the LM head's input at every position of a text, for calibration and eval.

``transformers`` is imported inside the functions: it is a test/extra dependency, and the rest of the
FlashHead core (and anything importing this module) stands without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["load_causal_lm", "capture_hidden_states"]


def load_causal_lm(model_dir: str | Path, device: str = "cpu") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)`` of a local Hugging Face checkpoint in float32, or a ``RuntimeError`` saying why not.

    Refuses a checkpoint whose weights do not cover the model (e.g. a head-only file): ``transformers``
    would initialise the missing layers at random and sample noise.  The tokenizer pads on the left.
    """
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise RuntimeError(f"transformers is not installed ({e})") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        model, info = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32, output_loading_info=True
        )
    except Exception as e:  # noqa: BLE001 - any loading failure means: cannot run this checkpoint
        raise RuntimeError(
            f"cannot load the model with transformers: {str(e).splitlines()[0] if str(e) else e!r}"
        ) from None
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = [k for k in info.get("missing_keys", []) if k not in tied]
    if missing:
        raise RuntimeError(f"the checkpoint lacks {len(missing)} of the model's weights (e.g. {sorted(missing)[0]})")
    tokenizer.padding_side = "left"
    return model.to(device).eval(), tokenizer


def capture_hidden_states(
    model_dir: str | Path,
    text: str,
    *,
    max_tokens: int = 2048,
    device: str = "cpu",
    chunk: int = 512,
    progress: bool = False,
) -> torch.Tensor:
    """Run the local HF model on ``text`` and return the final (normed) hidden state of every position.

    ``output_hidden_states`` ends with the state after the model's final norm for Llama-style models;
    this is verified against the model's own logits, and the final norm is applied when it is not.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    context = getattr(model.config, "max_position_embeddings", None)
    if isinstance(context, int) and context > 0:  # positions past the trained context give states serving never sees
        chunk = min(chunk, context)
    ids = tok(text, return_tensors="pt").input_ids[0][:max_tokens]
    if ids.numel() == 0:
        raise ValueError("the text produced no tokens")
    outs = []
    head = model.get_output_embeddings()
    with torch.no_grad():
        for s in tqdm(range(0, ids.numel(), chunk), desc="hidden states", unit="chunk", disable=not progress):
            piece = ids[s : s + chunk].unsqueeze(0).to(device)
            out = model(piece, output_hidden_states=True)
            hs = out.hidden_states[-1][0]
            if not torch.allclose(head(hs).float(), out.logits[0].float(), rtol=1e-3, atol=1e-3):
                norm = getattr(getattr(model, "model", None), "norm", None)
                if norm is None or not torch.allclose(
                    head(norm(hs)).float(), out.logits[0].float(), rtol=1e-3, atol=1e-3
                ):
                    raise RuntimeError("cannot reproduce the model's logits from its last hidden state")
                hs = norm(hs)
            outs.append(hs.float().cpu())
    return torch.cat(outs)
