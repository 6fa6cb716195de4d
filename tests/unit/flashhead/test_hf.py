"""Hugging Face I/O (``my_pkg.flashhead.hf``): the one module of my_pkg that imports ``transformers``."""

import ast
from pathlib import Path

import pytest
import torch

from my_pkg.flashhead.hf import load_causal_lm

ROOT = Path(__file__).resolve().parents[3]


def test_transformers_is_imported_by_hf_alone():
    importers = set()
    for path in (ROOT / "my_pkg").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            if any(name.split(".")[0] == "transformers" for name in names):
                importers.add(path.relative_to(ROOT).as_posix())
    assert importers == {"my_pkg/flashhead/hf.py"}


def test_load_causal_lm_runs_in_float32_and_pads_on_the_left(tiny_llama):
    model, tokenizer = load_causal_lm(tiny_llama)
    assert not model.training and {p.dtype for p in model.parameters()} == {torch.float32}
    assert tokenizer.padding_side == "left"


def test_load_causal_lm_refuses_a_checkpoint_it_cannot_run(make_model):
    pytest.importorskip("transformers")
    path, _ = make_model(256, 32)  # an LM head alone, no tokenizer
    with pytest.raises(RuntimeError, match="cannot load the model with transformers"):
        load_causal_lm(path)
