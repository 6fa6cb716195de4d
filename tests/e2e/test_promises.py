"""FlashHead's promises in combination, on a real server with the default settings (on CPU the head is timed at
start-up and each step takes the cheaper way: FlashHead's kernels, or the dense product masked to FlashHead's
answer):

- a request's greedy and seeded sampled text does not depend on its neighbours: alone, among 24 other requests,
  beside a logprobs request and beside a structured-output request;
- an update of `n_probes` while requests stream answers at once and does not hold up decoding while in flight.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from e2e_support import ADMIN_TOKEN, auth, client

pytestmark = pytest.mark.e2e

FLASHHEAD = "/plugins/my_pkg/flashhead"
PROMPT = "what is the name of the city"
OTHERS = ["the world and the sun", "hello world", "water food and fire", "one two three four", '{ " name " :']
#: A greedy request and seeded sampled ones (vLLM's per-request generator): temperature and top-p (a threshold row of
#: the compact law), and top-k with top-p at a temperature high enough that the tiny model's rows keep several
#: tokens (a top-k row, drawn by rejection).
REQUESTS = {
    "greedy": {"temperature": 0},
    "seeded": {"temperature": 0.8, "top_p": 0.9, "seed": 1234},
    "seeded_top_k": {"temperature": 1.5, "top_k": 40, "top_p": 0.9, "seed": 4321},
}


def _status(http) -> dict:
    response = http.get(FLASHHEAD, headers=auth(ADMIN_TOKEN))
    assert response.status_code == 200, response.text
    return response.json()["workers"][0]


def _put(http, body: dict):
    return http.put(FLASHHEAD, json=body, headers=auth(ADMIN_TOKEN))


def _text(http, model: str, prompt: str = PROMPT, **params) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 32, "ignore_eos": True, **params}
    response = http.post("/v1/completions", json=body, headers=auth())
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _ours_beside(http, model: str, neighbours: list[dict]) -> dict[str, str]:
    """Our two requests' texts, sent at once with `neighbours` (other tenants' request bodies)."""
    with ThreadPoolExecutor(len(neighbours) + len(REQUESTS)) as pool:
        ours = {name: pool.submit(_text, http, model, **params) for name, params in REQUESTS.items()}
        for body in neighbours:
            pool.submit(_text, http, model, **body)
        return {name: future.result() for name, future in ours.items()}


@pytest.fixture
def fh(flashhead_server):
    with client(flashhead_server) as http:
        status = _status(http)
        assert status["dense_batch_threshold"] is None and status["step_costs"] is not None  # the defaults
        yield http
        assert _put(http, {"n_probes": status["n_probes"]}).status_code == 200


def test_a_requests_text_does_not_depend_on_its_neighbours(fh, flashhead_server):
    model = flashhead_server.model
    assert _put(fh, {"n_probes": 1}).status_code == 200  # so few probes that FlashHead's text is not the dense one
    before = _status(fh)["counters"]
    alone = {name: _text(fh, model, **params) for name, params in REQUESTS.items()}
    # The top-k request's text depends on its seed: were its draw not reproducible, the repeats below would differ.
    other_seed = {**REQUESTS["seeded_top_k"], "seed": REQUESTS["seeded_top_k"]["seed"] + 1}
    assert _text(fh, model, **other_seed) != alone["seeded_top_k"], alone
    # Alone twice more: a step of one row is served now and then the other way than its timing picks, to keep both
    # ways' times fresh, so the repeats cross ways too.
    for _ in range(2):
        assert {name: _text(fh, model, **params) for name, params in REQUESTS.items()} == alone
    load = [{"prompt": OTHERS[i % len(OTHERS)], "temperature": 0.7 * (i % 2), "seed": i} for i in range(24)]
    assert _ours_beside(fh, model, load) == alone, "under load"
    assert _ours_beside(fh, model, [{"prompt": OTHERS[0], "logprobs": 3}]) == alone, "beside a logprobs request"
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    structured = [{"prompt": "json", "max_tokens": 24, "ignore_eos": False, "structured_outputs": {"json": schema}}]
    assert _ours_beside(fh, model, structured) == alone, "beside a structured-output request"

    after = _status(fh)
    counters = after["counters"]
    served = counters["rows_flashhead"] - before["rows_flashhead"]
    masked = counters["rows_flashhead_masked"] - before["rows_flashhead_masked"]
    assert served > 0 and "slower_than_dense" not in counters["rows_dense"], counters
    assert counters["rows_dense"]["logprobs"] > before["rows_dense"].get("logprobs", 0)
    assert counters["rows_dense"]["structured_output"] > before["rows_dense"].get("structured_output", 0)
    assert 0 < masked < served, (masked, served, after["step_costs"]["served"])  # both ways served some steps
    assert after["recent"]["rows_flashhead_greedy"] > 0 and after["recent"]["rows_flashhead_sampled"] > 0
    assert counters["fallbacks"] == before["fallbacks"]
    # The seeded request's rows were drawn by the plugin from the compact law, every plan taken by vLLM's sampler.
    compact = counters["compact"]
    assert compact["rows"] > before["compact"]["rows"], compact
    assert compact["unmatched_rows"] == compact["failed_rows"] == 0, compact
    # Top-k rows among them (every compact row but the threshold rows: no top-k).
    top_k_rows = (compact["rows"] - compact["bound_rows"]) - (
        before["compact"]["rows"] - before["compact"]["bound_rows"]
    )
    assert top_k_rows >= 31 * 7, (top_k_rows, compact)  # 7 requests, each 31 decode steps after its first token


def _stream(http, body: dict, arrivals: list[float]) -> None:
    """Stream one completion, appending each chunk's arrival time to `arrivals` as it comes."""
    with http.stream("POST", "/v1/completions", json=body, headers=auth()) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                json.loads(line[len("data: ") :])
                arrivals.append(time.perf_counter())


def _update_while_streaming(http, model: str, n_probes: int) -> str | None:
    """8 requests stream 480 tokens each; once one has streamed 40 chunks, a PUT of `n_probes`. What went wrong, or
    None: the PUT answered 200 within 2 s while they still streamed, and no stream waited 1 s or more for a chunk
    while the update was in flight (an update answered only after every stream ended is one that held up)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True, "stream": True}
    arrivals: list[list[float]] = [[] for _ in range(8)]
    with ThreadPoolExecutor(8) as pool:
        streams = [pool.submit(_stream, http, body, times) for times in arrivals]
        deadline = time.perf_counter() + 120
        while len(arrivals[0]) < 40 and not streams[0].done():
            assert time.perf_counter() < deadline, "the first stream did not start"
            time.sleep(0.005)
        started = time.perf_counter()
        response = _put(http, {"n_probes": n_probes})
        answered = time.perf_counter()
        for stream in streams:
            stream.result()
    assert response.status_code == 200, response.text
    if not any(times[-1] > answered for times in arrivals):
        return f"the streams ended before the update answered, {answered - started:.2f} s after it was sent"
    if answered - started >= 2.0:
        return f"the update answered after {answered - started:.2f} s"
    # How long each stream waited for a chunk while the update was in flight (a wait that began before the PUT was
    # sent counts from the PUT on: the update cannot have caused what came before it).
    during = [
        (min(later, answered) - max(earlier, started), later - earlier, earlier - started)
        for times in arrivals
        for earlier, later in zip(times, times[1:])
        if later >= started and earlier <= answered
    ]
    assert during
    if max(during)[0] >= 1.0:
        return f"a stream waited {max(during)} (in flight, whole wait, began after the PUT) for a chunk"
    return None


def test_an_update_while_requests_stream_answers_at_once_and_never_holds_up_decoding(fh, flashhead_server):
    """An update while 8 requests stream answers within 2 s and no stream waits 1 s for a chunk meanwhile (re-timing
    the head inside the update, as before, held the update, answered 504 after the 10 s wait, and every stream, on
    every update).  Best of two updates: a shared 2-core host now and then stalls the engine for a second or two."""
    problems = []
    for n_probes in (3, 4):
        problem = _update_while_streaming(fh, flashhead_server.model, n_probes)
        assert _status(fh)["n_probes"] == n_probes
        if problem is None:
            break
        problems.append(problem)
    assert len(problems) < 2, problems
