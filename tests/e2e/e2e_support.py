"""Constants and small HTTP helpers shared by the end-to-end tests."""

from __future__ import annotations

import httpx

from tests.support.admin_client import bearer
from tests.support.server import VllmServer
from tests.support.tiny_model import TinyLlamaSpec

API_KEY = "e2e-api-key"
ADMIN_TOKEN = "e2e-admin-token"
READ_TOKEN = "e2e-read-token"
LORA_NAME = "tiny-lora"
#: How long the API server waits for the workers (MY_PKG_RPC_TIMEOUT) on the servers that stall tests pause.
RPC_TIMEOUT = "4"
BOTH_HALVES = "my_pkg_engine,my_pkg_admin"
#: Servers whose tests check neither text nor logprobs (the endpoint half alone, a pooling model, process topologies)
#: start eager: half the start-up (no torch.compile warm-up). Every server whose answers a test compares keeps vLLM's
#: defaults.
EAGER = ("--enforce-eager",)
MODEL_SPEC = TinyLlamaSpec(vocab_size=4096, hidden_size=128, num_hidden_layers=2)
CLUSTER_SIZE = 16
NUM_CLUSTERS = MODEL_SPEC.vocab_size // CLUSTER_SIZE
DEFAULT_PROBES = 32
#: The n-gram speculative decoding the speculative-serving tests run.
NGRAM_SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}


def draft_model_spec(draft: object) -> dict:
    """The draft-model speculative decoding the drafter tests run, drafting with the model at `draft`."""
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}


def auth(token: str = API_KEY) -> dict[str, str]:
    return bearer(token)


def client(server: VllmServer) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=120.0)


def assert_drafts_through_flashhead(before: dict, after: dict, drafted: float) -> None:
    """Between two status counters snapshots: vLLM drafted, every draft row went through the FlashHead drafter
    head (none dense, no fallback), and FlashHead verified them."""
    assert drafted > 0
    assert after["rows_flashhead_draft"] - before["rows_flashhead_draft"] >= drafted  # a row per draft
    assert after["rows_dense_draft"] == before["rows_dense_draft"]
    assert after["fallbacks"] == before["fallbacks"]
    assert after["rows_flashhead_verify"] > before["rows_flashhead_verify"]
