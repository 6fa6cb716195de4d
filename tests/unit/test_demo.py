"""`make demo`'s pieces that run without a server: the stored model and reading the server's counters."""

import json

import pytest
import torch

from tests.support.demo import _share, rows_counters
from tests.support.demo_model import DEMO_MODEL_DIR, DemoSpec, expand_demo_model

transformers = pytest.importorskip("transformers")


class _Metrics:
    """Stands in for the admin client: `get("metrics")` answers this Prometheus text."""

    def __init__(self, text: str) -> None:
        self.text = text

    def get(self, route: str):
        assert route == "metrics"
        return self

    def raise_for_status(self) -> None:
        return None


METRICS = """# HELP my_pkg_flashhead_rows_total Rows (tokens) through the LM head.
# TYPE my_pkg_flashhead_rows_total counter
my_pkg_flashhead_rows_total{dp_rank="0",rank="0",path="flashhead"} 120.0
my_pkg_flashhead_rows_total{dp_rank="0",rank="1",path="flashhead"} 30.0
my_pkg_flashhead_rows_total{dp_rank="0",rank="0",path="dense",reason="logprobs"} 4.0
my_pkg_flashhead_rows_total{dp_rank="0",rank="0",path="dense",reason="disabled"} 6.0
my_pkg_flashhead_steps_total{dp_rank="0",rank="0"} 99.0
"""


def test_rows_counters_sum_workers_and_keep_dense_reasons():
    counters = rows_counters(_Metrics(METRICS))
    assert counters == {"flashhead": 150.0, "dense:logprobs": 4.0, "dense:disabled": 6.0}
    before = {"flashhead": 100.0, "dense:disabled": 6.0}
    flash, dense, reasons = _share(before, counters)
    assert flash == 50.0 and dense == 4.0 and reasons == {"logprobs": 4.0}


def test_stored_demo_model_has_a_head_large_against_its_body():
    meta = json.loads((DEMO_MODEL_DIR / "meta.json").read_text())
    spec = DemoSpec(**meta["spec"])
    head = spec.vocab_size * spec.hidden_size
    layer = 4 * spec.hidden_size**2 + 3 * spec.hidden_size * spec.intermediate_size
    assert spec.vocab_size >= 32768 and head > 4 * layer * spec.num_hidden_layers
    assert (DEMO_MODEL_DIR / "heldout.txt").read_text().strip()
    # Trained: the held-out loss fell well below a uniform guess over the vocabulary.
    assert meta["history"][-1]["heldout_loss"] < 0.8 * torch.log(torch.tensor(float(spec.vocab_size))).item()


def test_expanded_checkpoint_is_an_ordinary_llama_whose_head_is_the_factor_product(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = expand_demo_model(tmp_path / "demo")
    stored = load_file(str(DEMO_MODEL_DIR / "weights.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    expected = stored["embed_low"].float() @ stored["embed_proj"].float()
    torch.testing.assert_close(model.get_output_embeddings().weight, expected)
    torch.testing.assert_close(model.get_input_embeddings().weight, expected)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    ids = tokenizer("Return the number of", return_tensors="pt").input_ids
    with torch.no_grad():
        out_ = model(ids, output_hidden_states=True)
    torch.testing.assert_close(out_.logits[0], out_.hidden_states[-1][0] @ expected.t(), rtol=1e-4, atol=1e-4)
    # A second call keeps the complete checkpoint.
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert expand_demo_model(out) == out and (out / "model.safetensors").stat().st_mtime_ns == stamp
