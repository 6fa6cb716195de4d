"""FlashHead verifying n-gram speculative decoding in a real vLLM server (V1 runner on CPU), with the default
settings: greedy answers at concurrency 8 equal FlashHead without speculation token for token (and the dense
head's at full probes), the status route reports each part, verify rows are counted and served as without
speculation; prints acceptance with FlashHead verify next to the dense head on the same server (`PUT enabled`)."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from e2e_support import ADMIN_TOKEN, NUM_CLUSTERS, auth, client

from tests.support.server import VllmServer

pytestmark = pytest.mark.e2e

#: Prompts that repeat n-grams, so that the n-gram proposer finds drafts in them (16, as the issue's equality
#: check asks; a prompt's answer costs well under a second next to a server's start-up).
PROMPTS = [
    "one two three one two three one two three one two",
    "the cat sat on the mat . the cat sat on the mat . the cat",
    "a b c d a b c d a b c d a b",
    "red green blue red green blue red green",
    "hello world hello world hello world hello",
    "to be or not to be , to be or not to be",
    "1 2 3 4 5 1 2 3 4 5 1 2 3",
    "x y x y x y x y x y",
    "up down up down up down up down up",
    "water air earth water air earth water air",
    "sun sea sun sea sun sea sun sea",
    "north 1 2 north 1 2 north 1 2 north",
    "good day good day good day good",
    "home school home school home school home",
    "true false null true false null true false",
    "{ name : age } { name : age } { name :",
]
FLASHHEAD = "/plugins/my_pkg/flashhead"


def _model(http) -> str:
    return http.get("/v1/models", headers=auth()).json()["data"][0]["id"]


def _tokens(http, prompt: str, **params) -> list[int]:
    body = {
        "model": _model(http),
        "prompt": prompt,
        "max_tokens": 32,
        "temperature": 0,
        "return_token_ids": True,
        **params,
    }
    response = http.post("/v1/completions", json=body, headers=auth())
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def _status(http) -> dict:
    response = http.get(FLASHHEAD, headers=auth(ADMIN_TOKEN))
    assert response.status_code == 200, response.text
    return response.json()["workers"][0]


def _total(http, name: str) -> float:
    """The sum of one of vLLM's own counters over its label sets."""
    text = http.get("/metrics").text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _spec_counts(http) -> tuple[float, float]:
    """vLLM's own (accepted, drafted) token counters."""
    return _total(http, "vllm:spec_decode_num_accepted_tokens_total"), _total(
        http, "vllm:spec_decode_num_draft_tokens_total"
    )


@pytest.fixture(scope="module")
def reference(flashhead_server: VllmServer) -> list[list[int]]:
    """FlashHead without speculation: the answers speculation must not change."""
    with client(flashhead_server) as http:
        return [_tokens(http, prompt) for prompt in PROMPTS]


def test_greedy_answers_equal_flashhead_without_speculation_and_verify_rows_are_flashhead(
    ngram_server: VllmServer, reference: list[list[int]]
):
    with client(ngram_server) as http:
        status = _status(http)
        assert status["active"] and status["reason_code"] is None
        spec = status["spec"]
        assert spec["method"] == "ngram" and "pin_drafts" not in spec
        assert spec["verify"] == {"active": True, "reason": None, "reason_code": None}
        assert not spec["draft"]["active"] and spec["draft"]["reason_code"] == "no_draft_head"
        before, (accepted0, drafted0) = status["counters"], _spec_counts(http)

        with ThreadPoolExecutor(8) as pool:  # concurrency 8: steps of several requests' verify and bonus rows
            answers = list(pool.map(lambda prompt: _tokens(http, prompt), PROMPTS))
        for prompt, got, expected in zip(PROMPTS, answers, reference):
            assert got == expected, prompt

        after, (accepted1, drafted1) = _status(http)["counters"], _spec_counts(http)
        assert drafted1 > drafted0, "the prompts gave the n-gram proposer no drafts"
        assert after["rows_flashhead_verify"] > before["rows_flashhead_verify"]
        assert after["rows_flashhead"] - before["rows_flashhead"] >= after["rows_flashhead_verify"]
        assert not set(after["rows_dense"]) - {"unexpected_rows"} - set(before["rows_dense"])
        assert after["rows_dense"].get("unexpected_rows", 0) == before["rows_dense"].get("unexpected_rows", 0)
        assert after["fallbacks"] == before["fallbacks"]
        print(
            f"\nFlashHead verify: acceptance {(accepted1 - accepted0) / (drafted1 - drafted0):.3f} "
            f"({accepted1 - accepted0:.0f}/{drafted1 - drafted0:.0f} drafts)"
        )


def test_every_cluster_probed_verifies_as_the_dense_head_does(ngram_server: VllmServer):
    """At full probes FlashHead's verify rows score every token exactly: the greedy answers under speculation
    are the dense head's on the same server (FlashHead switched off), token for token."""
    with client(ngram_server) as http:
        restore = {"enabled": True, "n_probes": _status(http)["n_probes"]}
        try:
            assert http.put(FLASHHEAD, json={"enabled": False}, headers=auth(ADMIN_TOKEN)).status_code == 200
            dense = [_tokens(http, prompt) for prompt in PROMPTS]
            wide = {"enabled": True, "n_probes": NUM_CLUSTERS}
            assert http.put(FLASHHEAD, json=wide, headers=auth(ADMIN_TOKEN)).status_code == 200
            before = _status(http)["counters"]
            answers = [_tokens(http, prompt) for prompt in PROMPTS]
            after = _status(http)["counters"]
        finally:
            assert http.put(FLASHHEAD, json=restore, headers=auth(ADMIN_TOKEN)).status_code == 200
    for prompt, got, expected in zip(PROMPTS, answers, dense):
        assert got == expected, prompt
    assert after["rows_flashhead_verify"] > before["rows_flashhead_verify"]  # the verify rows were FlashHead's
    assert after["fallbacks"] == before["fallbacks"]


def test_sampled_verify_rows_are_served_by_flashhead(ngram_server: VllmServer):
    """Sampled requests: verify rows served by FlashHead as without speculation, no fallback. (A seeded
    request does not reproduce its text under n-gram speculation on vLLM 0.32's CPU build, with the
    dense head either, so no reproduction is asserted here.)"""
    with client(ngram_server) as http:
        before = _status(http)["counters"]
        for prompt in PROMPTS[:4]:
            assert len(_tokens(http, prompt, temperature=0.3, seed=1234)) == 32
        after = _status(http)["counters"]
        assert after["rows_flashhead_verify"] > before["rows_flashhead_verify"]
        assert after["fallbacks"] == before["fallbacks"]


def test_acceptance_with_the_dense_head_on_the_same_server(ngram_server: VllmServer):
    """Not a target, a figure: vLLM's acceptance with FlashHead off, then on, on the same prompts."""
    with client(ngram_server) as http:
        for enabled in (False, True):
            response = http.put(FLASHHEAD, json={"enabled": enabled}, headers=auth(ADMIN_TOKEN))
            assert response.status_code == 200, response.text
            accepted0, drafted0 = _spec_counts(http)
            steps0 = _total(http, "vllm:spec_decode_num_drafts_total")
            for prompt in PROMPTS:
                _tokens(http, prompt)
            accepted1, drafted1 = _spec_counts(http)
            steps = _total(http, "vllm:spec_decode_num_drafts_total") - steps0
            accepted, drafted = accepted1 - accepted0, drafted1 - drafted0
            print(
                f"\nn-gram, greedy, {len(PROMPTS)} prompts, {'FlashHead verify' if enabled else 'dense head'}: "
                f"acceptance {accepted / max(drafted, 1):.3f} ({accepted:.0f}/{drafted:.0f}), "
                f"tokens per drafted step {1 + accepted / max(steps, 1):.2f} ({steps:.0f} steps)"
            )
        assert _status(http)["active"]
