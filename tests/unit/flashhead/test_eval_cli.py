import pytest
import torch
from safetensors.torch import save_file

from my_pkg.cli import main
from my_pkg.flashhead.hf import capture_hidden_states

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

VOCAB = 96
HIDDEN = 32


def _tiny_llama(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # a non-trivial final norm, so a missing norm would be detected
        model.model.norm.weight.uniform_(0.5, 2.0)
    model.save_pretrained(str(path))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(VOCAB - 3):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(
        str(path)
    )
    return model


@pytest.fixture(scope="module")
def built_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    model = _tiny_llama(path)
    assert main(["flashhead", "build", str(path), "--no-progress", "--iterations", "3", "--n-probes", "2"]) == 0
    return path, model


def test_capture_matches_model_logits(built_llama):
    path, model = built_llama
    text = " ".join(f"w{i % 90}" for i in range(40))
    hs = capture_hidden_states(path, text)
    assert hs.shape == (40, HIDDEN)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(path))(text, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0]
    torch.testing.assert_close(hs @ model.lm_head.weight.t(), logits, rtol=1e-4, atol=1e-4)


def test_eval_cli_text_path(built_llama, tmp_path, capsys):
    path, _ = built_llama
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"w{(i * 7) % 90}" for i in range(60)))
    assert main(["flashhead", "eval", str(path), "--text", str(text), "--probes", "1,3,6"]) == 0
    out = capsys.readouterr().out
    assert "captured by running the model" in out
    lines = [ln for ln in out.splitlines() if ln.startswith("| 6 |")]
    assert lines and "100.00%" in lines[0]  # 6 probes = every cluster: exact


def test_eval_cli_hidden_states_file_and_synthetic(built_llama, tmp_path, capsys):
    path, _ = built_llama
    f = tmp_path / "hs.safetensors"
    save_file({"hidden_states": torch.randn(50, HIDDEN)}, str(f))
    assert main(["flashhead", "eval", str(path), "--hidden-states", str(f), "--probes", "2,6"]) == 0
    out = capsys.readouterr().out
    assert "50 samples" in out and "| 2 |" in out
    assert main(["flashhead", "eval", str(path), "--samples", "30", "--probes", "6"]) == 0
    assert "SYNTHETIC" in capsys.readouterr().out


def test_eval_cli_errors(built_llama, tmp_path, capsys):
    path, _ = built_llama
    f = tmp_path / "bad.safetensors"
    save_file({"hidden_states": torch.randn(5, HIDDEN + 1)}, str(f))
    assert main(["flashhead", "eval", str(path), "--hidden-states", str(f)]) == 1
    assert "hidden states must be" in capsys.readouterr().err
    assert main(["flashhead", "eval", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "config.json" in err and "Traceback" not in err


def _table_top1(out: str, n_probes: int) -> float:
    line = next(ln for ln in out.splitlines() if ln.startswith(f"| {n_probes} |"))
    return float(line.split("|")[4].strip().rstrip("%"))


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    """A bf16 checkpoint with FlashHead assets (6 clusters of 16)."""
    path = tmp_path_factory.mktemp("llama-bf16")
    _tiny_llama(path).to(torch.bfloat16).save_pretrained(str(path))
    assert main(["flashhead", "build", str(path), "--no-progress", "--iterations", "3", "--n-probes", "2"]) == 0
    return path


def test_eval_on_a_bf16_checkpoint_uses_a_float32_reference(bf16_llama, tmp_path, capsys):
    from my_pkg.flashhead import FlashHead
    from my_pkg.flashhead.assets import load_assets, load_lm_head, read_config
    from my_pkg.flashhead.synthetic import synthetic_hidden_states

    config = read_config(bf16_llama)
    weight, _ = load_lm_head(bf16_llama, config)
    assert weight.dtype == torch.bfloat16
    centroids, assignments = load_assets(bf16_llama, config)
    hidden = synthetic_hidden_states(weight.float(), 3000, noise=3.0, seed=1, vocab_size=VOCAB)
    f = tmp_path / "hs.safetensors"
    save_file({"hidden_states": hidden}, str(f))

    assert (
        main(["flashhead", "eval", str(bf16_llama), "--hidden-states", str(f), "--samples", "3000", "--probes", "2,6"])
        == 0
    )
    out = capsys.readouterr().out
    assert "reference: dense head in float32" in out and "clusters in bfloat16" in out
    assert "the dense head in bfloat16 picks a float32 argmax" in out
    assert _table_top1(out, 6) == 100.0  # every cluster probed: exactly the dense head

    # Independently, all in float32: FlashHead's pick at 2 probes against the dense argmax.
    exact = FlashHead(weight.float(), centroids.float(), assignments, vocab_size=VOCAB, n_probes=2)
    picks = exact.step_logits(hidden).argmax(1)  # n_probes=2
    expected = 100.0 * float((picks == (hidden @ weight.float().T).argmax(1)).float().mean())
    assert expected < 100.0  # the check below compares something
    assert abs(_table_top1(out, 2) - expected) <= 0.1, (out, expected)


def _eos_heavy_hidden(model, n: int = 120) -> torch.Tensor:
    """States around the head's rows, a third of them pointing at EOS (id 2) so it is the dense argmax."""
    g = torch.Generator().manual_seed(3)
    weight = model.lm_head.weight.detach().float()
    targets = torch.randint(3, VOCAB, (n,), generator=g)
    targets[::3] = 2
    return 4.0 * weight[targets] + 0.5 * torch.randn(n, HIDDEN, generator=g)


def test_eval_json_reports_serving_fidelity_at_the_configured_probes(built_llama, tmp_path, capsys):
    import json

    from my_pkg.flashhead import FlashHead
    from my_pkg.flashhead.assets import (
        load_assets,
        load_lm_head,
        load_tail_factors,
        read_config,
        stop_and_special_token_ids,
    )
    from my_pkg.flashhead.fidelity import serving_fidelity

    path, model = built_llama
    hidden = _eos_heavy_hidden(model)
    f = tmp_path / "hs.safetensors"
    save_file({"hidden_states": hidden}, str(f))
    assert main(["flashhead", "eval", str(path), "--hidden", str(f), "--samples", "500", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == str(path) and report["hidden_states"] == 120 and report["dtype"] == "float32"
    # How stage 1 was built (the default build self-calibrates): config.json's record, as written.
    assert report["calibration"] == read_config(path)["flash_head_calibration"]
    assert report["calibration"]["source"] == "self" and report["calibration"]["n_probes"] == 2
    assert report["tail_estimate"] == "fitted"  # the self-calibrated build fits sampled rows' estimate
    (result,) = report["results"]
    assert result["n_probes"] == 2  # config.json's, as serving uses
    config = read_config(path)
    pinned = stop_and_special_token_ids(path, config)
    assert 2 in pinned
    assert result["scored_fraction"] == pytest.approx((6 + 2 * 16 + len(pinned)) / VOCAB)
    assert result["stop_token_recall"] == 1.0  # EOS is pinned: FlashHead stops where dense stops
    assert [(s["temperature"], s["top_p"]) for s in result["sampling"]] == [(0.7, 0.9), (1.0, 1.0), (1.0, 0.95)]
    assert set(result["sampling"][0]) == {"temperature", "top_p", "tv_distance", "tv_p90", "tv_max", "scored_fraction"}

    # The same numbers as the library computes on the served head, with the model's pinned ids.
    centroids, assignments = load_assets(path, config)
    weight, _ = load_lm_head(path, config)
    head = FlashHead(weight, centroids, assignments, n_probes=2, tail_factors=load_tail_factors(path, config))
    assert head.tail_fitted
    (expected,) = serving_fidelity(head, hidden, [2], pinned=pinned)
    assert result["top1_agreement"] == pytest.approx(expected.top1_agreement)
    assert result["top5_agreement"] == pytest.approx(expected.top5_agreement)
    for got, want in zip(result["sampling"], expected.sampling):
        assert got["tv_distance"] == pytest.approx(want.tv_distance, rel=1e-5)
        assert got["scored_fraction"] == pytest.approx(want.scored_fraction)
    assert result["top1_agreement"] < 1.0 and result["sampling"][1]["tv_distance"] > 1e-3  # 2 of 6 clusters


def test_eval_json_with_every_cluster_probed_is_exact_and_text_mode_prints_fidelity(built_llama, tmp_path, capsys):
    import json

    path, model = built_llama
    f = tmp_path / "hs.safetensors"
    save_file({"hidden_states": _eos_heavy_hidden(model)}, str(f))
    assert main(["flashhead", "eval", str(path), "--hidden-states", str(f), "--probes", "1,6", "--json"]) == 0
    one, every = json.loads(capsys.readouterr().out)["results"]
    assert (one["n_probes"], every["n_probes"]) == (1, 6)
    assert every["top1_agreement"] == every["top5_agreement"] == 1.0
    assert all(s["tv_distance"] < 1e-5 for s in every["sampling"])
    assert all(a["tv_distance"] > b["tv_distance"] for a, b in zip(one["sampling"], every["sampling"]))
    assert main(["flashhead", "eval", str(path), "--hidden", str(f), "--probes", "1,6"]) == 0
    out = capsys.readouterr().out
    assert "serving fidelity" in out and "TV T=0.7 top_p=0.9" in out
    assert "stage 1: calibrated on" in out and "the model's own samples (self-calibration)" in out


def test_eval_uses_the_servers_sampled_row_settings(built_llama, tmp_path, capsys, monkeypatch):
    import json

    path, model = built_llama
    f = tmp_path / "hs.safetensors"
    save_file({"hidden_states": _eos_heavy_hidden(model)}, str(f))
    runs = {}
    for rank in ("0", "32"):  # no estimate (-inf outside the probes) / the exact head (rank = hidden size)
        monkeypatch.setenv("MY_PKG_FLASHHEAD_SAMPLED_RANK", rank)
        monkeypatch.setenv("MY_PKG_FLASHHEAD_SAMPLED_N_PROBES", "3")
        assert main(["flashhead", "eval", str(path), "--hidden", str(f), "--json"]) == 0
        (runs[rank],) = json.loads(capsys.readouterr().out)["results"]
    assert runs["0"]["sampled_n_probes"] == runs["32"]["sampled_n_probes"] == 3
    assert runs["32"]["sampling"][0]["scored_fraction"] > runs["0"]["sampling"][0]["scored_fraction"]
    assert all(s["tv_distance"] < 1e-4 for s in runs["32"]["sampling"])
    assert all(s["tv_distance"] > 1e-3 for s in runs["0"]["sampling"])
