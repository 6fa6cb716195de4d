import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from my_pkg.cli import main
from my_pkg.flashhead.assets import (
    CACHE_DIR_NAME,
    CACHE_FILE_NAME,
    FlashHeadAssetError,
    load_assets,
    load_clustering_cache,
    load_lm_head,
    read_config,
)

from .conftest import write_checkpoint


def _build(model_dir, *extra):
    return main(["flashhead", "build", str(model_dir), "--no-progress", "--iterations", "4", *extra])


def _cache(model_dir):
    return load_file(str(model_dir / CACHE_DIR_NAME / CACHE_FILE_NAME))


@pytest.mark.parametrize("tied", [False, True])
def test_build_untied_and_tied(make_model, tied):
    model, head = make_model(tied=tied)
    assert _build(model, "--n-probes", "3") == 0
    cache = _cache(model)
    assert cache["centroids"].shape == (24, 200 // 16 + 1)  # hidden-major [H, C]
    assert cache["centroids"].dtype == torch.float32
    assert cache["cluster_assignments"].shape == (200,)
    assert not cache["cluster_assignments"].is_floating_point()
    cfg = read_config(model)
    assert cfg["flash_head_cache_dir"] == "flash_head_assets"
    assert cfg["n_probes"] == 3
    assert cfg["architectures"] == ["FlashHeadLlamaForCausalLM"]
    w, key = load_lm_head(model)
    assert key == ("model.embed_tokens.weight" if tied else "lm_head.weight")
    assert torch.equal(w, head)


def test_sharded_index_and_gemma_prefix(make_model):
    model, head = make_model(
        tied=True, shards=3, embed_key="model.language_model.embed_tokens.weight", arch="Gemma3ForConditionalGeneration"
    )
    assert (model / "model.safetensors.index.json").exists()
    w, key = load_lm_head(model)
    assert key == "model.language_model.embed_tokens.weight"
    assert torch.equal(w, head)
    assert _build(model) == 0
    assert read_config(model)["architectures"] == ["FlashHeadGemma3ForConditionalGeneration"]


def test_lm_head_absent_uses_embedding(tmp_path):
    head = torch.randn(64, 8)
    model = write_checkpoint(
        tmp_path / "m",
        {"model.embed_tokens.weight": head},
        {"architectures": ["X"], "hidden_size": 8, "vocab_size": 64},
    )
    w, key = load_lm_head(model)
    assert key == "model.embed_tokens.weight" and torch.equal(w, head)


def test_missing_key_and_non_2d_errors(tmp_path, capsys):
    m1 = write_checkpoint(
        tmp_path / "a",
        {"model.norm.weight": torch.ones(8)},
        {"architectures": ["X"], "hidden_size": 8, "vocab_size": 64},
    )
    with pytest.raises(FlashHeadAssetError, match="no LM head"):
        load_lm_head(m1)
    assert _build(m1) == 1
    err = capsys.readouterr().err
    assert "no LM head" in err and "Traceback" not in err
    m2 = write_checkpoint(
        tmp_path / "b",
        {"lm_head.weight": torch.ones(64, 8, 2)},
        {"architectures": ["X"], "hidden_size": 8, "vocab_size": 64},
    )
    with pytest.raises(FlashHeadAssetError, match="2-D"):
        load_lm_head(m2)
    m3 = tmp_path / "c"
    m3.mkdir()
    (m3 / "config.json").write_text("{}")
    (m3 / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(FlashHeadAssetError, match="cannot read"):
        load_lm_head(m3)
    assert main(["flashhead", "build", str(tmp_path / "nope")]) == 1


def test_non_multiple_vocab(make_model):
    model, head = make_model(vocab=203)
    assert _build(model) == 0
    cent, assign = load_assets(model, read_config(model))
    counts = torch.bincount(assign)
    assert cent.shape == (13, 24)
    assert counts.sum() == 203 and set(counts.tolist()) == {15, 16}


def test_deterministic_rerun_safe_and_output_copy(make_model, tmp_path):
    model, _ = make_model()
    orig_cfg = read_config(model)
    out = tmp_path / "converted"
    assert _build(model, "--output", str(out), "--seed", "3") == 0
    assert read_config(model) == orig_cfg  # source untouched
    assert not (model / CACHE_DIR_NAME).exists()
    assert (out / "model.safetensors").exists()
    first = _cache(out)
    # Re-run on the output itself (already converted): no double prefix, same result.
    assert _build(out, "--seed", "3") == 0
    second = _cache(out)
    assert torch.equal(first["cluster_assignments"], second["cluster_assignments"])
    assert torch.equal(first["centroids"], second["centroids"])
    assert read_config(out)["architectures"] == ["FlashHeadLlamaForCausalLM"]
    # Re-running with --output onto an existing copy also works.
    assert _build(model, "--output", str(out), "--seed", "3") == 0
    assert torch.equal(_cache(out)["cluster_assignments"], first["cluster_assignments"])
    # A different seed gives a different (still balanced) clustering.
    assert _build(model, "--output", str(tmp_path / "other"), "--seed", "4") == 0
    assert not torch.equal(_cache(tmp_path / "other")["cluster_assignments"], first["cluster_assignments"])


def test_loader_accepts_leading_singleton_dims_and_validates(make_model):
    model, _ = make_model(vocab=64, hidden=8)
    assert _build(model) == 0
    path = model / CACHE_DIR_NAME / CACHE_FILE_NAME
    cache = load_file(str(path))
    cent0, assign0 = load_assets(model, read_config(model))
    save_file(
        {
            "centroids": cache["centroids"][None, None].contiguous(),
            "cluster_assignments": cache["cluster_assignments"].to(torch.int32),
        },
        str(path),
    )
    cent, assign = load_assets(model, read_config(model))
    assert cent.shape == (4, 8) and torch.equal(cent, cent0)
    assert assign.dtype == torch.int64 and torch.equal(assign, assign0)
    cfg = read_config(model)
    with pytest.raises(FlashHeadAssetError, match="hidden"):
        load_assets(model, {**cfg, "hidden_size": 9})
    with pytest.raises(FlashHeadAssetError, match="vocab"):
        load_assets(model, {**cfg, "vocab_size": 65})
    bad = cache["cluster_assignments"].clone()
    bad[0] = 4
    save_file({"centroids": cache["centroids"], "cluster_assignments": bad}, str(path))
    with pytest.raises(FlashHeadAssetError, match="cluster ids"):
        load_assets(model, cfg)
    save_file({"centroids": cache["centroids"]}, str(path))
    with pytest.raises(FlashHeadAssetError, match="missing"):
        load_clustering_cache(path)


def test_config_rewrite_keeps_other_keys(make_model):
    model, _ = make_model(extra_config={"rope_theta": 10000.0, "architectures": ["MistralForCausalLM"]})
    assert _build(model, "--n-probes", "2") == 0
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["rope_theta"] == 10000.0
    assert cfg["architectures"] == ["FlashHeadMistralForCausalLM"]
    assert _build(model, "--n-probes", "99") == 1  # more probes than clusters
