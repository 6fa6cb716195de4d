"""Helpers for the FlashHead tests: tiny checkpoints written on the fly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from my_pkg.flashhead import FlashHead
from my_pkg.flashhead.clustering import balanced_kmeans
from my_pkg.flashhead.synthetic import synthetic_head, synthetic_hidden_states


def write_checkpoint(path: Path, tensors: dict, config: dict, shards: int = 1) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (or ``shards`` files plus an index)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
        return path
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, str(path / fname))
        weight_map.update({k: fname for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def clustered_head(vocab: int, hidden: int, seed: int = 0) -> torch.Tensor:
    """A small head with cluster structure (so clustering has something to find)."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(max(2, vocab // 16), hidden, generator=g)
    topic = torch.randint(0, centers.shape[0], (vocab,), generator=g)
    return centers[topic] + 0.5 * torch.randn(vocab, hidden, generator=g)


@pytest.fixture
def make_model(tmp_path):
    """Factory: ``make_model(vocab, hidden, tied=False, shards=1, arch="LlamaForCausalLM")``."""

    def _make(
        vocab=200,
        hidden=24,
        *,
        tied=False,
        shards=1,
        arch="LlamaForCausalLM",
        name="model",
        embed_key="model.embed_tokens.weight",
        extra_config=None,
    ):
        head = clustered_head(vocab, hidden)
        tensors = {embed_key: head if tied else torch.randn(vocab, hidden), "model.norm.weight": torch.ones(hidden)}
        if not tied:
            tensors["lm_head.weight"] = head
        config = {
            "architectures": [arch],
            "hidden_size": hidden,
            "vocab_size": vocab,
            "tie_word_embeddings": tied,
            **(extra_config or {}),
        }
        return write_checkpoint(tmp_path / name, tensors, config, shards), head

    return _make


@pytest.fixture(scope="module")
def head_and_states():
    """A head of 512 x 32 (32 clusters of 16, n_probes 4, sampled_rank 8) and 300 synthetic states."""
    weight = synthetic_head(512, 32, seed=1)
    res = balanced_kmeans(weight, 16, iterations=4, progress=False)
    head = FlashHead(weight, res.centroids, res.assignments, n_probes=4, sampled_rank=8)
    return head, synthetic_hidden_states(weight, 300, seed=2)
