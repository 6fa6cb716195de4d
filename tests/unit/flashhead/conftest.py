"""Helpers for the FlashHead tests: tiny checkpoints written on the fly, and the calibration tests' head and states."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from my_pkg.flashhead import FlashHead
from my_pkg.flashhead.clustering import ClusteringResult, balanced_kmeans
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


@pytest.fixture(scope="package")
def calibration_clusters() -> tuple[torch.Tensor, ClusteringResult]:
    """The calibration tests' head ``[1024, 32]`` and its weight-only clusters of 16."""
    weight = synthetic_head(1024, 32, seed=3)
    return weight, balanced_kmeans(weight, 16, iterations=8, progress=False)


def lm_like_states(weight: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """LM-like states: aimed at a head row, plus a shared offset direction (as trained LMs have)."""
    hidden = synthetic_hidden_states(weight, n, noise=1.5, seed=seed)
    offset = torch.nn.functional.normalize(
        torch.randn(weight.shape[1], generator=torch.Generator().manual_seed(5)), dim=0
    )
    return hidden + 0.7 * offset * hidden.norm(dim=1, keepdim=True)


def greedy_agreement(
    weight: torch.Tensor,
    centroids: torch.Tensor,
    assignments: torch.Tensor,
    hidden: torch.Tensor,
    n_probes: int,
    pinned: list[int],
) -> float:
    """Independent reference: FlashHead's greedy pick over the candidates plus the pinned ids, judged in float32."""
    head = FlashHead(weight, centroids, assignments, n_probes=n_probes)
    ids, _ = head.candidate_logits(hidden)
    if pinned:
        ids = torch.cat([ids, torch.tensor(pinned).expand(ids.shape[0], -1)], dim=1)
    reference = hidden @ weight.t()
    return float((reference.gather(1, ids).max(1).values >= reference.max(1).values).double().mean())


@pytest.fixture(scope="package")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama checkpoint that ``transformers`` runs (vocabulary 512, hidden size 64)."""
    pytest.importorskip("transformers")
    from tests.support.tiny_model import TinyLlamaSpec, build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", TinyLlamaSpec(vocab_size=512, hidden_size=64))


@pytest.fixture(scope="module")
def head_and_states() -> tuple[FlashHead, torch.Tensor]:
    """A head of 512 x 32 (32 clusters of 16, n_probes 4, sampled_rank 8) and 300 synthetic states."""
    weight = synthetic_head(512, 32, seed=1)
    res = balanced_kmeans(weight, 16, iterations=4, progress=False)
    head = FlashHead(weight, res.centroids, res.assignments, n_probes=4, sampled_rank=8)
    return head, synthetic_hidden_states(weight, 300, seed=2)
