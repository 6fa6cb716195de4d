"""FlashHead inside a real vLLM server: same answers as dense where it must, live control, counters."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from e2e_support import ADMIN_TOKEN, DEFAULT_PROBES, MODEL_SPEC, NUM_CLUSTERS, auth, client

from my_pkg.flashhead.spec import SAMPLED_ROW_BUDGET, default_sampled_rank
from my_pkg.flashhead.tail_estimate import default_tail_rank

pytestmark = pytest.mark.e2e

PROMPTS = [
    "the world and the sun",
    "hello world",
    "what is the name of the city",
    '{ " name " :',
    "water food and fire",
    "one two three four",
]
FLASHHEAD = "/plugins/my_pkg/flashhead"


def _status(http) -> dict:
    response = http.get(FLASHHEAD, headers=auth())
    assert response.status_code == 200, response.text
    return response.json()["workers"][0]


def _put(http, body: dict, headers: dict | None = None):
    return http.put(FLASHHEAD, json=body, headers=auth(ADMIN_TOKEN) if headers is None else headers)


def _complete(http, model: str, prompt: str, **params) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0, **params}
    response = http.post("/v1/completions", json=body, headers=auth())
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def _complete_all(http, model: str, prompts: list[str], **params) -> list[dict]:
    """Send every prompt at once, so the server batches them (batch > 1)."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: _complete(http, model, p, **params), prompts))


@pytest.fixture
def fh(flashhead_server):
    """An HTTP client on the FlashHead server; settings are restored after the test."""
    with client(flashhead_server) as http:
        defaults = _status(http)
        yield http
        restore = {k: defaults[k] for k in ("enabled", "n_probes", "dense_batch_threshold")}
        assert _put(http, restore).status_code == 200


def test_every_cluster_probed_gives_the_dense_servers_tokens(fh, flashhead_server, plain_vllm_server):
    assert _put(fh, {"n_probes": NUM_CLUSTERS}).status_code == 200
    before = _status(fh)["counters"]
    ours = _complete_all(fh, flashhead_server.model, PROMPTS, max_tokens=48, return_token_ids=True)
    with client(plain_vllm_server) as plain:
        reference = _complete_all(plain, plain_vllm_server.model, PROMPTS, max_tokens=48, return_token_ids=True)
    assert [c["token_ids"] for c in ours] == [c["token_ids"] for c in reference]
    assert all(len(c["token_ids"]) == 48 for c in ours)
    after = _status(fh)["counters"]
    # The prompts shared decode steps (more rows than steps) ...
    assert after["rows_flashhead"] - before["rows_flashhead"] > after["steps"] - before["steps"]
    # ... and every decode row went through FlashHead, none fell back to dense.
    assert after["rows_flashhead"] - before["rows_flashhead"] >= len(PROMPTS) * 47
    assert after["rows_dense"] == before["rows_dense"]
    assert after["fallbacks"] == 0
    # Live fidelity telemetry: about one row in 100 was also checked against the dense head.
    checked = after["fidelity_rows"] - before["fidelity_rows"]
    assert checked >= 2 and after["fidelity_agreed"] - before["fidelity_agreed"] == checked


def test_default_probes_serve_greedy_and_sampled_requests(fh, flashhead_server):
    status = _status(fh)
    assert status["active"] and status["n_probes"] == DEFAULT_PROBES
    assert status["num_clusters"] == NUM_CLUSTERS and status["cluster_size"] == 16
    # The build calibrated on the model's own samples, so sampled rows get the estimate it fitted to them.
    record = json.loads((Path(flashhead_server.model) / "config.json").read_text())["flash_head_calibration"]
    assert status["sampled_estimate"] == ("weight_only" if record["source"] == "none" else "fitted"), record
    # Sampled rows run no stage 1: the estimate chooses their exact tokens, V / 32 of them with a fitted estimate.
    assert status["sampled_n_probes"] == 0
    fitted = status["sampled_estimate"] == "fitted"
    assert status["sampled_rescore"] == -(-status["vocab_size"] // (32 if fitted else 16)), status
    # A fitted estimate's rank is lowered to keep a sampled row within 15 % of the head's rows (14 of 16 here).
    hidden, vocab = MODEL_SPEC.hidden_size, status["vocab_size"]
    fitted_rank = default_tail_rank(hidden) if fitted else 0
    assert status["sampled_rank"] == default_sampled_rank(vocab, hidden, fitted_rank=fitted_rank), status
    if fitted:
        estimate_rows = status["sampled_rank"] * (hidden + vocab) / hidden
        assert estimate_rows + status["sampled_rescore"] <= SAMPLED_ROW_BUDGET * vocab, status
    # A CPU head holds a copy of its token rows in cluster order (float32 here), counted in its memory.
    assert status["backend"] == "torch" and status["extra_memory_bytes"] >= vocab * hidden * 4, status
    before = status["counters"]["rows_flashhead"]
    greedy = _complete_all(fh, flashhead_server.model, PROMPTS[:3])
    sampled = _complete_all(
        fh,
        flashhead_server.model,
        PROMPTS[:3],
        temperature=0.9,
        top_p=0.9,
        top_k=50,
        min_p=0.01,
        repetition_penalty=1.1,
        frequency_penalty=0.2,
        presence_penalty=0.2,
        seed=7,
    )
    assert all(c["text"].strip() for c in greedy + sampled)
    seeded = [
        _complete(fh, flashhead_server.model, PROMPTS[0], temperature=0.9, top_p=0.9, seed=7)["text"] for _ in range(2)
    ]
    assert seeded[0] == seeded[1]  # a seed reproduces the same text
    assert _status(fh)["counters"]["rows_flashhead"] >= before + 6 * 23


@pytest.mark.parametrize(
    "params",
    [{"logprobs": 3}, {"logprobs": 1, "logprob_token_ids": [7, 11, 300, 4000]}],
    ids=["top_logprobs", "logprob_token_ids"],
)
def test_logprobs_requests_get_the_dense_servers_logprobs(fh, flashhead_server, plain_vllm_server, params):
    before = _status(fh)["counters"]["rows_dense"].get("logprobs", 0)
    params = {"max_tokens": 8, **params}
    ours = _complete(fh, flashhead_server.model, PROMPTS[2], **params)
    with client(plain_vllm_server) as plain:
        reference = _complete(plain, plain_vllm_server.model, PROMPTS[2], **params)
    assert ours["logprobs"]["tokens"] == reference["logprobs"]["tokens"]
    assert ours["logprobs"]["token_logprobs"] == pytest.approx(reference["logprobs"]["token_logprobs"], abs=1e-4)
    for mine, theirs in zip(ours["logprobs"]["top_logprobs"], reference["logprobs"]["top_logprobs"]):
        assert mine.keys() == theirs.keys()
        assert list(mine.values()) == pytest.approx(list(theirs.values()), abs=1e-4)
    assert _status(fh)["counters"]["rows_dense"]["logprobs"] >= before + 8


def test_a_request_can_opt_out_of_flashhead(fh, flashhead_server, plain_vllm_server):
    assert _put(fh, {"n_probes": 1}).status_code == 200  # FlashHead alone would differ from dense here
    before = _status(fh)["counters"]["rows_dense"].get("opt_out", 0)
    opt_out = {"max_tokens": 24, "return_token_ids": True, "vllm_xargs": {"flashhead": False}}
    ours = [_complete(fh, flashhead_server.model, p, **opt_out)["token_ids"] for p in PROMPTS[:3]]
    with client(plain_vllm_server) as plain:
        reference = [
            _complete(plain, plain_vllm_server.model, p, max_tokens=24, return_token_ids=True)["token_ids"]
            for p in PROMPTS[:3]
        ]
    assert ours == reference
    assert _status(fh)["counters"]["rows_dense"]["opt_out"] >= before + 3 * 23


def test_greedy_requests_with_penalties_are_served_dense(fh, flashhead_server, plain_vllm_server):
    """Penalties change which token wins after the probes were chosen, so a penalised greedy row is dense
    (`penalized_greedy`) and its text is the dense server's, even at one probe."""
    assert _put(fh, {"n_probes": 1}).status_code == 200  # FlashHead alone would differ from dense here
    before = _status(fh)["counters"]["rows_dense"].get("penalized_greedy", 0)
    params = {"max_tokens": 24, "return_token_ids": True, "repetition_penalty": 1.3, "presence_penalty": 0.5}
    ours = [_complete(fh, flashhead_server.model, p, **params)["token_ids"] for p in PROMPTS[:3]]
    with client(plain_vllm_server) as plain:
        reference = [_complete(plain, plain_vllm_server.model, p, **params)["token_ids"] for p in PROMPTS[:3]]
    assert ours == reference
    assert _status(fh)["counters"]["rows_dense"]["penalized_greedy"] >= before + 3 * 23


def test_stop_tokens_are_always_candidates(fh, flashhead_server, plain_vllm_server):
    """At one probe, a request's stop token that the dense head picks first ends the reply
    at once, as on the dense server, though its cluster is rarely the one probed."""
    status = _status(fh)
    assert 2 in status["pinned_token_ids"]  # the model's EOS
    assert _put(fh, {"n_probes": 1}).status_code == 200
    with client(plain_vllm_server) as plain:
        for prompt in PROMPTS:
            first = _complete(plain, plain_vllm_server.model, prompt, max_tokens=1, return_token_ids=True)
            stop = {"max_tokens": 16, "stop_token_ids": first["token_ids"], "return_token_ids": True}
            reference = _complete(plain, plain_vllm_server.model, prompt, **stop)
            ours = _complete(fh, flashhead_server.model, prompt, **stop)
            assert reference["finish_reason"] == "stop" and reference["token_ids"] == first["token_ids"]
            assert (ours["finish_reason"], ours["token_ids"]) == (reference["finish_reason"], reference["token_ids"])


def test_prompt_logprobs_equal_the_dense_servers(fh, flashhead_server, plain_vllm_server):
    params = {"max_tokens": 4, "prompt_logprobs": 1}
    before = _status(fh)["counters"]
    ours = _complete(fh, flashhead_server.model, PROMPTS[0], **params)["prompt_logprobs"]
    after = _status(fh)["counters"]
    # Dense only while the prompt logprobs are computed: the generated tokens use FlashHead.
    assert after["rows_flashhead"] >= before["rows_flashhead"] + 3
    assert after["rows_dense"].get("prompt_logprobs", 0) == before["rows_dense"].get("prompt_logprobs", 0)
    with client(plain_vllm_server) as plain:
        theirs = _complete(plain, plain_vllm_server.model, PROMPTS[0], **params)["prompt_logprobs"]
    assert ours[0] is None and theirs[0] is None
    for mine, ref in zip(ours[1:], theirs[1:]):
        assert mine.keys() == ref.keys()
        for token in mine:
            assert mine[token]["logprob"] == pytest.approx(ref[token]["logprob"], abs=1e-4)


def test_guided_json_returns_valid_json(fh, flashhead_server):
    before = _status(fh)["counters"]["rows_dense"].get("structured_output", 0)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "boolean"}},
        "required": ["name"],
        "additionalProperties": False,
    }
    choice = _complete(fh, flashhead_server.model, "json", max_tokens=40, structured_outputs={"json": schema})
    value = json.loads(choice["text"])
    assert isinstance(value, dict) and len(value) == 1 and isinstance(next(iter(value.values())), bool)
    assert _status(fh)["counters"]["rows_dense"]["structured_output"] > before


def test_put_changes_probes_and_enabled_live(fh, flashhead_server):
    wide = _put(fh, {"n_probes": NUM_CLUSTERS})
    assert wide.status_code == 200 and wide.json()["workers"][0]["n_probes"] == NUM_CLUSTERS
    exact = _complete(fh, flashhead_server.model, PROMPTS[2], max_tokens=40)["text"]
    assert _put(fh, {"n_probes": 1}).json()["workers"][0]["n_probes"] == 1
    narrow = _complete(fh, flashhead_server.model, PROMPTS[2], max_tokens=40)["text"]
    assert narrow != exact  # one cluster per step cannot reproduce the dense answer
    assert _status(fh)["n_probes"] == 1

    assert _put(fh, {"enabled": False}).status_code == 200
    status = _status(fh)
    assert status["enabled"] is False and status["active"] is False
    disabled_before = status["counters"]["rows_dense"].get("disabled", 0)
    flash_before = status["counters"]["rows_flashhead"]
    dense_answer = _complete(fh, flashhead_server.model, PROMPTS[2], max_tokens=40)["text"]
    counters = _status(fh)["counters"]
    assert counters["rows_dense"]["disabled"] >= disabled_before + 39
    assert counters["rows_flashhead"] == flash_before
    assert dense_answer == exact

    assert _put(fh, {"enabled": True}).json()["workers"][0]["active"] is True
    _complete(fh, flashhead_server.model, PROMPTS[2], max_tokens=8)
    assert _status(fh)["counters"]["rows_flashhead"] > flash_before


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"n_probes": 0}, "n_probes"),
        ({"dense_batch_threshold": -3}, "dense_batch_threshold"),
        ({"enabled": "sometimes"}, "enabled"),
        ({"probes": 4}, "probes"),
        ({}, "at least one"),
    ],
)
def test_invalid_put_is_422_and_changes_nothing(fh, body, fragment):
    before = _status(fh)
    response = _put(fh, body)
    assert response.status_code == 422, response.text
    assert fragment in response.text
    after = _status(fh)
    assert {k: after[k] for k in ("enabled", "n_probes", "dense_batch_threshold")} == {
        k: before[k] for k in ("enabled", "n_probes", "dense_batch_threshold")
    }


def test_a_valid_put_the_model_cannot_take_is_409_and_changes_nothing(fh):
    before = _status(fh)
    response = _put(fh, {"n_probes": NUM_CLUSTERS + 1})
    assert response.status_code == 409, response.text
    assert response.json()["error"]["type"] == "invalid_update" and "clusters" in response.text
    assert _status(fh)["n_probes"] == before["n_probes"]


def test_put_needs_the_right_token(fh):
    assert _put(fh, {"n_probes": 3}, headers={}).status_code == 401
    assert _put(fh, {"n_probes": 3}, headers=auth("nope")).status_code == 401
    assert _status(fh)["n_probes"] == DEFAULT_PROBES


def test_put_is_forbidden_when_no_token_is_configured(endpoint_only_server):
    with client(endpoint_only_server) as http:
        response = http.put(FLASHHEAD, json={"n_probes": 3})
        assert response.status_code == 403
        assert "MY_PKG_ADMIN_TOKEN" in response.text


def test_batch_threshold_sends_big_batches_dense(fh, flashhead_server):
    assert _put(fh, {"dense_batch_threshold": 1}).status_code == 200
    before = _status(fh)["counters"]["rows_dense"].get("batch_threshold", 0)
    # n=4 decodes four sequences in the same steps: every decode step has 4 rows.
    _complete(fh, flashhead_server.model, PROMPTS[0], max_tokens=16, n=4, temperature=0.8)
    assert _status(fh)["counters"]["rows_dense"].get("batch_threshold", 0) >= before + 4 * 15


def test_a_greedy_requests_text_does_not_depend_on_the_load(fh, flashhead_server):
    assert _status(fh)["dense_batch_threshold"] is None  # the default: the path is decided per request
    assert _put(fh, {"n_probes": 1}).status_code == 200  # so few probes that FlashHead's text differs from dense
    alone = _complete(fh, flashhead_server.model, PROMPTS[2], max_tokens=40)["text"]
    before = _status(fh)["counters"]
    prompts = [PROMPTS[2]] * 4 + PROMPTS * 4  # 28 requests at once: decode steps of far more than 16 rows
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: _complete(fh, flashhead_server.model, p, max_tokens=40), prompts))
    assert [a["text"] for a, p in zip(answers, prompts) if p == PROMPTS[2]] == [alone] * 8
    after = _status(fh)["counters"]
    assert after["rows_dense"].get("batch_threshold", 0) == before["rows_dense"].get("batch_threshold", 0)
    assert after["rows_flashhead"] >= before["rows_flashhead"] + len(prompts)  # the batched rows were FlashHead's


def _top_p_rows(text: str) -> int:
    match = re.search(r'^my_pkg_top_p_rows_total\{dp_rank="0",rank="0"\} (\d+)', text, re.M)
    assert match, "the sort-free top-p is in place on vLLM's CPU build by default"
    return int(float(match.group(1)))


def _compact_rows(text: str) -> int:
    match = re.search(r'^my_pkg_flashhead_compact_rows_total\{dp_rank="0",rank="0"\} (\d+)', text, re.M)
    assert match, "compact sampled rows are counted on vLLM's CPU build by default"
    return int(float(match.group(1)))


def test_metrics_expose_the_counters_by_rank(fh, flashhead_server):
    before = fh.get("/plugins/my_pkg/metrics", headers=auth()).text
    top_p_before, compact_before = _top_p_rows(before), _compact_rows(before)
    sampled = {"max_tokens": 4, "temperature": 0.8, "top_p": 0.9, "seed": 3}
    _complete(fh, flashhead_server.model, PROMPTS[0], max_tokens=4)
    _complete(fh, flashhead_server.model, PROMPTS[1], **sampled)  # drawn by the plugin (compact rows)
    _complete(fh, flashhead_server.model, PROMPTS[1], **sampled, presence_penalty=0.5)  # a full row: vLLM's sampler
    counters = _status(fh)["counters"]
    text = fh.get("/plugins/my_pkg/metrics", headers=auth()).text
    match = re.search(r'^my_pkg_flashhead_rows_total\{dp_rank="0",path="flashhead",rank="0"\} (\d+)', text, re.M)
    assert match and int(match.group(1)) == counters["rows_flashhead"]
    assert re.search(r'^my_pkg_flashhead_active\{dp_rank="0",rank="0"\} 1', text, re.M)
    assert _compact_rows(text) == counters["compact"]["rows"] >= compact_before + 4
    assert _top_p_rows(text) >= top_p_before + 4  # the penalised request's rows, masked without a sort of every row


def test_flashhead_model_without_the_plugin_is_refused(flashhead_model, logs_dir):
    from tests.support.server import VllmServer

    server = VllmServer(model=str(flashhead_model), env={"VLLM_PLUGINS": ""}, log_path=logs_dir / "no-plugin.log")
    server.start()
    try:
        assert server.wait_exit(timeout=300) != 0
    finally:
        server.stop()
    log = server.log_tail(200)
    assert "FlashHeadLlamaForCausalLM" in log and "not supported" in log
