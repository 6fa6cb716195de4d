"""FlashHead as the drafter's head in a real vLLM server (V1 runner on CPU, `method: draft_model`): the
FlashHead model drafting for itself. Greedy answers equal FlashHead without speculation token for token,
the status route shows the draft part and its probe count, draft rows are counted apart, `draft_n_probes`
is PUT like the other settings (and refused, all or none, where no FlashHead drafter runs); prints vLLM's
acceptance with the FlashHead drafter next to the dense drafter's.

The dense drafter is the same server with `draft_n_probes` at every cluster: FlashHead then scores every
token exactly, so its draft is the dense head's argmax. The draft model is the target's own checkpoint (the
e2e models are random; a smaller random model would agree with nothing): the FlashHead drafter proposes what
the FlashHead target picks, the dense drafter what the dense head picks, which this random model's FlashHead
agrees with on about 65 % of tokens. The comparison says that drafting through FlashHead works end to end,
not what it costs a trained draft model."""

from __future__ import annotations

import pytest
from e2e_support import ADMIN_TOKEN, DEFAULT_PROBES, NUM_CLUSTERS, assert_drafts_through_flashhead, auth, client
from test_speculative_serving import FLASHHEAD, PROMPTS, _spec_counts, _status, _tokens

from tests.support.server import VllmServer

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def reference(flashhead_server: VllmServer) -> list[list[int]]:
    """FlashHead without speculation: the answers speculation must not change."""
    with client(flashhead_server) as http:
        return [_tokens(http, prompt) for prompt in PROMPTS]


def _put(http, update: dict):
    return http.put(FLASHHEAD, json=update, headers=auth(ADMIN_TOKEN))


def _serve_prompts(http) -> tuple[list[list[int]], float, float, dict, dict]:
    """The greedy answers, vLLM's (accepted, drafted) over them, and the FlashHead status before and after."""
    before, (accepted0, drafted0) = _status(http), _spec_counts(http)
    answers = [_tokens(http, prompt) for prompt in PROMPTS]
    after, (accepted1, drafted1) = _status(http), _spec_counts(http)
    return answers, accepted1 - accepted0, drafted1 - drafted0, before, after


def serve_with_the_dense_drafter(http, reference: list[list[int]]) -> tuple[float, float]:
    """The prompts again with `draft_n_probes` at every cluster (the drafter's FlashHead head then drafts the
    dense argmax), restored after: the same answers, the target's `n_probes` untouched, the drafts still
    FlashHead draft rows. vLLM's (accepted, drafted) over them."""
    response = _put(http, {"draft_n_probes": NUM_CLUSTERS})
    assert response.status_code == 200, response.text
    try:
        answers, accepted, drafted, before, after = _serve_prompts(http)
    finally:
        assert _put(http, {"draft_n_probes": DEFAULT_PROBES}).status_code == 200
    assert after["spec"]["draft_n_probes"] == NUM_CLUSTERS and after["n_probes"] == DEFAULT_PROBES
    assert answers == reference
    assert after["counters"]["rows_flashhead_draft"] - before["counters"]["rows_flashhead_draft"] >= drafted
    assert _status(http)["spec"]["draft_n_probes"] == DEFAULT_PROBES
    return accepted, drafted


def report_acceptance(drafter: str, flashhead: tuple[float, float], dense: tuple[float, float]) -> tuple[float, float]:
    """Print vLLM's acceptance with the FlashHead drafter head next to the dense one's, each `(accepted, drafted)`
    over the prompts; return the two rates."""
    (accepted, drafted), (dense_accepted, dense_drafted) = flashhead, dense
    flash_rate, dense_rate = accepted / drafted, dense_accepted / max(dense_drafted, 1)
    print(
        f"\n{drafter}, greedy, {len(PROMPTS)} prompts, FlashHead verify: acceptance {flash_rate:.3f} "
        f"({accepted:.0f}/{drafted:.0f}) with the FlashHead drafter (draft_n_probes {DEFAULT_PROBES}), "
        f"{dense_rate:.3f} ({dense_accepted:.0f}/{dense_drafted:.0f}) with the dense drafter "
        f"(draft_n_probes {NUM_CLUSTERS}: every cluster)"
    )
    return flash_rate, dense_rate


def test_both_heads_are_built_when_the_models_load_before_any_request(flashhead_drafter_server: VllmServer):
    """vLLM sizes the KV cache right after loading: the target's FlashHead head and the drafter's exist by then,
    not at the first request (the server is fresh: no completion has reached it yet)."""
    with client(flashhead_drafter_server) as http:
        status = _status(http)
    assert status["counters"]["steps"] == 0
    assert status["active"] and status["reason_code"] is None and status["extra_memory_bytes"] > 0
    assert status["spec"]["draft"]["active"]


def test_the_flashhead_drafter_serves_the_drafts_and_answers_stay_flashheads(
    flashhead_drafter_server: VllmServer, reference
):
    with client(flashhead_drafter_server) as http:
        answers, accepted, drafted, before, after = _serve_prompts(http)
        spec = after["spec"]
        assert after["active"] and spec["method"] == "draft_model" and spec["verify"]["active"]
        assert spec["draft"] == {"active": True, "reason": None, "reason_code": None}
        assert spec["draft_n_probes"] == DEFAULT_PROBES  # the draft checkpoint's own n_probes
        for prompt, got, expected in zip(PROMPTS, answers, reference):
            assert got == expected, prompt
        assert_drafts_through_flashhead(before["counters"], after["counters"], drafted)

        dense = serve_with_the_dense_drafter(http, reference)

    flash_rate, dense_rate = report_acceptance("draft_model (the target's own checkpoint)", (accepted, drafted), dense)
    assert flash_rate >= 0.97 * dense_rate


def test_draft_n_probes_is_refused_all_or_none_without_a_flashhead_drafter(flashhead_server: VllmServer):
    with client(flashhead_server) as http:
        before = _status(http)
        response = _put(http, {"draft_n_probes": 4, "n_probes": 4})
        assert response.status_code == 409, response.text
        assert response.json()["error"]["type"] == "invalid_update" and "drafter" in response.text
        after = _status(http)
        assert after["n_probes"] == before["n_probes"] and after["spec"] is None
