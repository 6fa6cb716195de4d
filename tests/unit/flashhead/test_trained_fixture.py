"""The committed trained-LM fixture is what it claims: a real LM's head and held-out hidden states."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from tests.support.trained_fixture import (
    DEFAULT_FIXTURE_DIR,
    SPECIAL_TOKENS,
    STATE_FILES,
    FixtureSpec,
    collect_code_documents,
    load_trained_fixture,
    split_code_documents,
    split_documents,
)

UNIFORM_LOSS = math.log(8192)


@pytest.fixture(scope="module")
def fixture():
    return load_trained_fixture()


def test_files_have_the_documented_keys_shapes_and_dtypes():
    with safe_open(str(DEFAULT_FIXTURE_DIR / "head.safetensors"), framework="pt") as f:
        assert list(f.keys()) == ["weight"]
        weight = f.get_tensor("weight")
    assert weight.shape == (8192, 256) and weight.dtype == torch.float16
    for name in STATE_FILES:
        with safe_open(str(DEFAULT_FIXTURE_DIR / f"{name}.safetensors"), framework="pt") as f:
            assert sorted(f.keys()) == ["hidden_states", "next_token_ids"]
            states, targets = f.get_tensor("hidden_states"), f.get_tensor("next_token_ids")
        assert states.dtype == torch.float16 and states.shape == (4096, 256)
        assert targets.dtype == torch.int32 and targets.shape == (states.shape[0],)
        assert 0 <= int(targets.min()) and int(targets.max()) < 8192
        assert torch.isfinite(states.float()).all()
    with safe_open(str(DEFAULT_FIXTURE_DIR / "generated.safetensors"), framework="pt") as f:
        assert list(f.keys()) == ["hidden_states"]
        assert f.get_tensor("hidden_states").shape == (4096, 256)
    total = sum(p.stat().st_size for p in DEFAULT_FIXTURE_DIR.iterdir())
    assert total <= 15_500_000, total


def test_loader_returns_float32_tensors_and_the_special_ids(fixture):
    assert fixture.weight.dtype == fixture.calibration.dtype == fixture.heldout.dtype == torch.float32
    assert fixture.calibration.shape[0] >= 4096 and fixture.heldout.shape[0] >= 4096
    assert fixture.calibration_next.dtype == fixture.heldout_next.dtype == torch.int64
    assert fixture.special_ids == {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    assert fixture.eos_id == fixture.special_ids["[EOS]"] == fixture.meta["eos_id"]
    assert fixture.meta["vocab_size"] == fixture.weight.shape[0]
    assert fixture.meta["hidden_size"] == fixture.weight.shape[1]


def test_tokenizer_matches_the_head():
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(DEFAULT_FIXTURE_DIR / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 8192
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    text = "Return a new list containing all items from the iterable in ascending order."
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.split()) * 2  # a trained BPE: common English words are single tokens


def test_heldout_loss_is_far_below_uniform_and_matches_the_stored_states(fixture):
    recorded = fixture.meta["final_heldout_loss"]
    assert recorded < UNIFORM_LOSS - 3.0, recorded
    assert fixture.meta["final_train_loss"] < UNIFORM_LOSS - 3.0
    # The stored states and head reproduce the recorded loss (a subsample, float16-rounded: close, not equal).
    logits = fixture.heldout @ fixture.weight.t()
    measured = float(torch.nn.functional.cross_entropy(logits, fixture.heldout_next))
    assert abs(measured - recorded) < 0.3, (measured, recorded)


def test_code_is_a_shifted_source(fixture):
    """The second source is text the model never trained on and predicts much worse: a real distribution shift."""
    losses = fixture.meta["split_losses"]
    assert losses["code_heldout"] > losses["heldout"] + 0.5, losses
    for states, targets in (
        (fixture.code_heldout, fixture.code_heldout_next),
        (fixture.code_calibration, fixture.code_calibration_next),
    ):
        measured = float(torch.nn.functional.cross_entropy(states @ fixture.weight.t(), targets))
        assert abs(measured - losses["code_heldout"]) < 0.4, measured
        assert measured < UNIFORM_LOSS - 1.5  # byte-level BPE still reads code: far from uniform

    # The dense argmax lands on other tokens: the two sources' argmax histograms are far apart (the
    # model's own samples are docstring-like).
    def argmax_histogram(states):
        top = (states @ fixture.weight.t()).argmax(1)
        return torch.bincount(top, minlength=8192).double() / top.numel()

    doc, code, generated = (argmax_histogram(s) for s in (fixture.heldout, fixture.code_heldout, fixture.generated))
    assert 0.5 * float((doc - code).abs().sum()) > 0.3
    assert 0.5 * float((generated - code).abs().sum()) > 0.3


def test_generated_states_are_the_models_own_samples(fixture):
    """Self-calibration states: recorded settings, and a confident model (its own samples are likely under it)."""
    record = fixture.meta["generated"]
    assert record["states"] == fixture.generated.shape[0] == 4096 and record["seed"] == fixture.meta["spec"]["seed"]
    assert record["temperature"] == 1.0 and record["prompts"] >= 20
    log_p = torch.log_softmax(fixture.generated @ fixture.weight.t(), dim=1)
    entropy = float(-(log_p.exp() * log_p).sum(1).mean())
    assert 0.5 < entropy < UNIFORM_LOSS - 2.0, entropy


@pytest.mark.slow
def test_code_documents_have_no_docstrings_and_split_by_text():
    documents = collect_code_documents()
    assert len(documents) > 2000
    assert not any(doc.lstrip().startswith(('"""', "'''")) for doc in documents)
    assert any(doc.lstrip().startswith("def ") for doc in documents)
    spec = FixtureSpec()
    forward, backward = split_code_documents(documents, spec), split_code_documents(list(reversed(documents)), spec)
    assert all(sorted(forward[k]) == sorted(backward[k]) for k in forward)
    assert not set(forward["calibration"]) & set(forward["heldout"])


def test_dense_head_predicts_the_next_token_from_heldout_states(fixture):
    for states, targets in ((fixture.heldout, fixture.heldout_next), (fixture.calibration, fixture.calibration_next)):
        top1 = (states @ fixture.weight.t()).argmax(1)
        accuracy = float((top1 == targets).float().mean())
        # Chance is 1/8192; always guessing the most frequent next token scores its frequency.
        most_frequent_rate = float(torch.bincount(targets, minlength=8192).max()) / targets.numel()
        assert accuracy > 0.12, accuracy
        assert accuracy > most_frequent_rate + 0.05, (accuracy, most_frequent_rate)
        # Not a collapsed model: the argmax varies with the context.
        assert top1.unique().numel() > 50


def test_eos_is_a_real_target_and_the_dense_argmax_on_some_rows(fixture):
    top1 = (fixture.heldout @ fixture.weight.t()).argmax(1)
    eos_rows = fixture.heldout_next == fixture.eos_id
    assert int(eos_rows.sum()) > 0
    assert int((top1 == fixture.eos_id).sum()) > 0
    assert int((top1[eos_rows] == fixture.eos_id).sum()) > 0


def test_meta_records_how_it_was_made(fixture):
    meta = fixture.meta
    assert meta["command"].startswith("python -m tests.support.trained_fixture")
    assert meta["training_command"].startswith("python -m tests.support.trained_fixture")
    assert "--steps" in meta["training_command"]
    assert meta["steps"] > 0 and meta["tokens_trained_on"] > 0
    assert meta["model_config"]["tie_word_embeddings"] is True
    assert meta["model_config"]["eos_token_id"] == fixture.eos_id
    json.dumps(meta)


def test_document_split_depends_only_on_the_text():
    spec = FixtureSpec()
    documents = [f"Return the {i}-th item of the sequence, or raise IndexError." for i in range(400)]
    forward = split_documents(documents, spec)
    backward = split_documents(list(reversed(documents)), spec)
    for name in ("train", "calibration", "heldout"):
        assert sorted(forward[name]) == sorted(backward[name])
    assert forward["calibration"] and forward["heldout"]
    assert not set(forward["train"]) & set(forward["heldout"])


def test_loading_a_directory_without_the_files_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing meta.json"):
        load_trained_fixture(tmp_path)
