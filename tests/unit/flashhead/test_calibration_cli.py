"""``my-pkg flashhead build``'s calibration sources: ``--calibration`` text, ``--calibration-hidden`` states,
the default self-calibration on the model's own samples, ``--no-calibration``, and what config.json records."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from my_pkg.cli import main
from my_pkg.flashhead.assets import (
    CACHE_DIR_NAME,
    CACHE_FILE_NAME,
    CALIBRATION_KEY,
    load_assets,
    load_tail_factors,
    read_config,
)
from my_pkg.flashhead.synthetic import synthetic_hidden_states


@pytest.fixture(scope="module")
def calibration_text(tmp_path_factory):
    import random

    words = (
        "the of and to a in is it you that he was for on are with as his they be at one have this from or had "
        "by hot word but what some we can out other were all there when up use your how said an each she"
    ).split()
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("text") / "calibration.txt"
    path.write_text(" ".join(rng.choice(words) for _ in range(1500)))
    return path


def _build(model, *extra):
    return main(["flashhead", "build", str(model), "--no-progress", "--iterations", "4", *extra])


def test_cli_calibration_text_writes_fitted_vectors_and_chosen_probes(tiny_llama, calibration_text, tmp_path, capsys):
    weight_only, calibrated = tmp_path / "weight-only", tmp_path / "calibrated"
    assert _build(tiny_llama, "--output", str(weight_only), "--no-calibration") == 0
    assert read_config(weight_only)[CALIBRATION_KEY]["source"] == "none"
    capsys.readouterr()
    assert (
        _build(
            tiny_llama,
            "--output",
            str(calibrated),
            "--calibration",
            str(calibration_text),
            "--target-agreement",
            "0.99",
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "calibrated stage 1 on 1,500 hidden states (text)" in out

    config = read_config(calibrated)
    record = config[CALIBRATION_KEY]
    assert record["rows"] == 1500 and record["heldout_rows"] == 300 and record["source"] == "text"
    assert record["target_agreement"] == 0.99 and record["n_probes"] == config["n_probes"]
    assert record["heldout_agreement_lower_bound"] >= 0.99 and record["target_certified"] and record["target_reached"]
    assert config["architectures"] == ["FlashHeadLlamaForCausalLM"] and config["flash_head_cache_dir"] == CACHE_DIR_NAME
    # Published layout: [hidden, clusters]; same clusters as the weight-only build. The builder writes the
    # stage 1 that meets the target with fewer probes (test_calibration_calibrate.py): the fitted vectors, or the
    # weight-only build's own.
    cache, base = (load_file(str(d / CACHE_DIR_NAME / CACHE_FILE_NAME)) for d in (calibrated, weight_only))
    assert cache["centroids"].shape == base["centroids"].shape == (64, 32)
    assert torch.equal(cache["cluster_assignments"], base["cluster_assignments"])
    variants = record["stage1_variants"]
    kept, other = variants[record["stage1"]], variants[({"calibrated", "weight_only"} - {record["stage1"]}).pop()]
    assert kept["n_probes_needed"] == record["n_probes"] and kept["meets_target"]
    assert kept["n_probes_needed"] <= other["n_probes_needed"] or not other["meets_target"]
    if record["stage1"] == "weight_only":
        assert torch.equal(cache["centroids"], base["centroids"])
    else:
        assert not torch.allclose(cache["centroids"], base["centroids"])
    centroids, _ = load_assets(calibrated, config)
    assert torch.equal(centroids, cache["centroids"].t())
    # Sampled rows' tail estimate is fitted to the same states; a weight-only build has none.
    assert "fitted the rank-8 tail estimate of sampled rows" in out
    assert record["tail_estimate"] == {"rank": 8, "states": 1500}
    factors = load_tail_factors(calibrated, config)
    assert factors is not None and factors.rank == 8 and factors.left.shape == (64, 8)
    assert load_tail_factors(weight_only, read_config(weight_only)) is None

    # Rebuilding weight-only in place replaces the record and removes the fitted estimate.
    assert _build(calibrated, "--no-calibration") == 0
    assert read_config(calibrated)[CALIBRATION_KEY] == {"source": "none", "reason": "--no-calibration"}
    assert load_tail_factors(calibrated, read_config(calibrated)) is None


def test_cli_calibration_hidden_file_and_explicit_probes(tiny_llama, tmp_path, capsys):
    from my_pkg.flashhead.assets import load_lm_head

    weight, _ = load_lm_head(tiny_llama)
    states = tmp_path / "states.safetensors"
    save_file({"hidden_states": synthetic_hidden_states(weight, 400, noise=1.0, seed=2)}, str(states))
    out_dir = tmp_path / "out"
    assert _build(tiny_llama, "--output", str(out_dir), "--calibration-hidden", str(states), "--n-probes", "5") == 0
    config = read_config(out_dir)
    assert config["n_probes"] == 5
    record = config[CALIBRATION_KEY]
    assert record["n_probes"] == 5 and record["rows"] == 400 and record["source"] == "hidden_states"
    assert "held-out top-1 agreement at n_probes=5" in capsys.readouterr().out


@pytest.mark.parametrize(
    "case", ["missing text", "empty text", "missing states", "wrong hidden size", "too few states", "not safetensors"]
)
def test_cli_calibration_bad_input_writes_nothing(tiny_llama, tmp_path, capsys, case):
    states = tmp_path / "states.safetensors"
    if case == "empty text":
        (tmp_path / "empty.txt").write_text("  \n")
        extra = ["--calibration", str(tmp_path / "empty.txt")]
    elif case == "missing text":
        extra = ["--calibration", str(tmp_path / "nope.txt")]
    elif case == "missing states":
        extra = ["--calibration-hidden", str(tmp_path / "nope.safetensors")]
    elif case == "not safetensors":
        states.write_bytes(b"garbage")
        extra = ["--calibration-hidden", str(states)]
    else:
        rows, width = (100, 63) if case == "wrong hidden size" else (5, 64)
        save_file({"hidden_states": torch.randn(rows, width)}, str(states))
        extra = ["--calibration-hidden", str(states)]
    expected = {
        "missing text": "cannot read calibration text",
        "empty text": "is empty",
        "missing states": "not found",
        "not safetensors": "cannot read calibration hidden states",
        "wrong hidden size": "must be [N, 64]",
        "too few states": "at least 20",
    }[case]
    out_dir = tmp_path / "out"
    before = (tiny_llama / "config.json").read_text()
    assert _build(tiny_llama, "--output", str(out_dir), *extra) == 1
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
    assert not out_dir.exists()
    assert (tiny_llama / "config.json").read_text() == before and not (tiny_llama / CACHE_DIR_NAME).exists()


def test_cli_calibration_sources_are_exclusive_and_target_validated(tiny_llama, calibration_text, capsys):
    with pytest.raises(SystemExit) as exc:
        _build(tiny_llama, "--calibration", str(calibration_text), "--calibration-hidden", "x.safetensors")
    assert exc.value.code == 2 and "not allowed with" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _build(tiny_llama, "--calibration", str(calibration_text), "--target-agreement", "1.2")
    assert "must lie in (0, 1]" in capsys.readouterr().err
    assert json.loads((tiny_llama / "config.json").read_text()).get("n_probes") is None


def test_cli_default_build_self_calibrates_and_records_it(tiny_llama, tmp_path, capsys):
    out_dir = tmp_path / "default"
    assert _build(tiny_llama, "--output", str(out_dir), "--self-calibration-states", "600") == 0
    out = capsys.readouterr().out
    assert "self-calibration: sampling the model" in out and "calibrated stage 1 on 600 hidden states (self)" in out
    record = read_config(out_dir)[CALIBRATION_KEY]
    assert record["source"] == "self" and record["rows"] == 600
    assert record["self_calibration"]["states"] == 600 and record["self_calibration"]["seed"] == 0
    assert _build(tiny_llama, "--output", str(tmp_path / "none"), "--no-calibration") == 0
    assert read_config(tmp_path / "none")[CALIBRATION_KEY] == {"source": "none", "reason": "--no-calibration"}
    with pytest.raises(SystemExit):
        _build(tiny_llama, "--no-calibration", "--calibration", "x.txt")


def test_cli_default_build_of_a_head_only_checkpoint_is_weight_only_with_a_warning(make_model, capsys):
    path, _ = make_model(256, 32)
    assert _build(path) == 0
    out = capsys.readouterr().out
    assert "warning: no self-calibration, cannot run the model" in out
    record = read_config(path)[CALIBRATION_KEY]
    assert record["source"] == "none" and record["reason"].startswith("cannot run the model")
