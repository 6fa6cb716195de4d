"""FlashHead as an EAGLE drafter's head in a real vLLM server (V1 runner on CPU, `method: eagle` and `eagle3`).

The EAGLE-1 and EAGLE-3 heads (`tests/support/tiny_eagle.py`) have no LM head of their own, so vLLM computes
their draft logits with the target's; FlashHead then serves them over the target's assets at the drafter's
own probe count (`draft_n_probes`). One server per method, one after the other. Greedy answers equal
FlashHead without speculation token for token, draft rows are counted apart, and the acceptance rate with the
FlashHead drafter is printed next to the dense drafter's (the same server with `draft_n_probes` at every
cluster: FlashHead then scores every token exactly).

The heads are random (no training here): they pass a target hidden state through nearly unchanged (EAGLE-1:
the last one, so its draft at a position is close to the target's own pick one position earlier). Their
acceptance says that EAGLE drafting through FlashHead works end to end, not what it costs a trained head.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_support import (
    ADMIN_TOKEN,
    BOTH_HALVES,
    DEFAULT_PROBES,
    RPC_TIMEOUT,
    assert_drafts_through_flashhead,
    client,
)
from test_speculative_drafter import _serve_prompts, report_acceptance, serve_with_the_dense_drafter
from test_speculative_serving import PROMPTS, _status, _tokens

from tests.support.server import VllmServer
from tests.support.tiny_eagle import build_tiny_eagle, build_tiny_eagle3

pytestmark = pytest.mark.e2e

NUM_SPECULATIVE_TOKENS = 2


@pytest.fixture(scope="module", params=["eagle", "eagle3"])
def eagle_server(request, flashhead_model: Path, e2e_dir: Path, logs_dir: Path) -> Iterator[VllmServer]:
    """The FlashHead model with an EAGLE head of the parameter's method drafting for it, both halves."""
    method = request.param
    build = build_tiny_eagle if method == "eagle" else build_tiny_eagle3
    head = build(e2e_dir / f"tiny-{method}", flashhead_model)
    spec = {"method": method, "model": str(head), "num_speculative_tokens": NUM_SPECULATIVE_TOKENS}
    env: dict[str, str | None] = {
        "VLLM_API_KEY": None,
        "MY_PKG_DISABLE": None,
        "MY_PKG_FLASHHEAD": None,
        "MY_PKG_FLASHHEAD_DRAFT_N_PROBES": None,
        "MY_PKG_STATUS_MAX_AGE": "0",  # every read asks the worker: counters are compared across requests
        "VLLM_PLUGINS": BOTH_HALVES,
        "MY_PKG_ADMIN_TOKEN": ADMIN_TOKEN,
        "MY_PKG_RPC_TIMEOUT": RPC_TIMEOUT,
    }
    with VllmServer(
        model=str(flashhead_model),
        args=["--speculative-config", json.dumps(spec)],
        env=env,
        log_path=logs_dir / f"{method}.log",
    ) as server:
        yield server


@pytest.fixture(scope="module")
def reference(flashhead_server: VllmServer) -> list[list[int]]:
    """FlashHead without speculation: the answers speculation must not change."""
    with client(flashhead_server) as http:
        return [_tokens(http, prompt) for prompt in PROMPTS]


def test_the_eagle_heads_drafts_go_through_flashhead_and_answers_stay_flashheads(eagle_server: VllmServer, reference):
    with client(eagle_server) as http:
        fresh = _status(http)
        assert fresh["active"] and fresh["counters"]["steps"] == 0
        spec = fresh["spec"]
        method = spec["method"]
        assert method in ("eagle", "eagle3") and spec["num_speculative_tokens"] == NUM_SPECULATIVE_TOKENS
        assert spec["verify"]["active"] and spec["draft"] == {"active": True, "reason": None, "reason_code": None}
        assert spec["draft_n_probes"] == DEFAULT_PROBES  # the target's checkpoint's n_probes: its assets

        answers, accepted, drafted, before, after = _serve_prompts(http)
        for prompt, got, expected in zip(PROMPTS, answers, reference):
            assert got == expected, prompt
        assert_drafts_through_flashhead(before["counters"], after["counters"], drafted)

        # The dense drafter: every cluster probed. Answers unchanged, the target's n_probes untouched.
        dense = serve_with_the_dense_drafter(http, reference)

    report_acceptance(f"{method} (a random head over the target's LM head)", (accepted, drafted), dense)
