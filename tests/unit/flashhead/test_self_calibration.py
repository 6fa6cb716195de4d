"""Self-calibration (``my_pkg.flashhead.calibration.self_calibration``): the dense model's own samples."""

import pytest
import torch

from my_pkg.flashhead.calibration import SELF_CALIBRATION_PROMPTS, generate_calibration_states
from my_pkg.flashhead.hf import load_causal_lm


@pytest.fixture(scope="module")
def tiny_lm(tiny_llama):
    return load_causal_lm(tiny_llama)


def test_self_calibration_states_are_seeded_and_reproduce_the_logits(tiny_lm):
    model, tokenizer = tiny_lm
    first, again, other = (
        generate_calibration_states(model, tokenizer, max_states=150, new_tokens=8, seed=seed) for seed in (0, 0, 1)
    )
    assert first.hidden.shape == (150, 64) and torch.equal(first.hidden, again.hidden)
    assert not torch.equal(first.hidden, other.hidden)
    assert first.rounds == -(-150 // (len(SELF_CALIBRATION_PROMPTS) * 8)) and not first.stopped_by_time
    record = first.record()
    assert record["states"] == 150 and record["seed"] == 0 and record["new_tokens"] == 8
    # BOS alone: the first state is the model's final hidden state after BOS.
    bos = torch.tensor([[tokenizer.bos_token_id]])
    with torch.no_grad():
        expected = model(bos, output_hidden_states=True).hidden_states[-1][0, -1]
    torch.testing.assert_close(first.hidden[0], expected, rtol=1e-4, atol=1e-4)


def test_self_calibration_stops_at_eos_and_at_the_time_budget(tiny_lm):
    model, tokenizer = tiny_lm
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = list(range(model.config.vocab_size))  # every token ends a sequence
    try:
        ended = generate_calibration_states(model, tokenizer, max_states=70, new_tokens=8, prompts=("", "the", "of"))
    finally:
        model.generation_config.eos_token_id = saved
    assert ended.hidden.shape[0] == 70 and ended.rounds == 24  # one state per sequence: 3 per round
    quick = generate_calibration_states(model, tokenizer, max_states=10**6, new_tokens=8, time_budget_s=0.05)
    assert quick.stopped_by_time and 0 < quick.hidden.shape[0] < 10**6
