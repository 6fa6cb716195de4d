"""Shared pieces of the serving benchmarks (``serve.py``, ``admin_load.py``).

* :func:`prepare_flashhead_model` builds a random Llama checkpoint once into a cache folder
  and converts it with the package's own builder CLI (``python -m my_pkg flashhead build``).
* :func:`flashhead_server` starts one vLLM server with both plugin halves and an admin token.
* :func:`run_load` is a closed-loop completion load: C clients, each sending one request at
  a time, until a duration has passed; output tokens/s = completion tokens / wall time.
  Requests are greedy or sampled (``TRAFFIC``).
* :class:`Admin` wraps the admin routes the benchmarks use.

Everything talks to 127.0.0.1 only, and every loop ends by itself.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support.admin_client import AdminClient, bearer
from tests.support.server import VllmServer
from tests.support.tiny_model import TinyLlamaSpec, build_tiny_llama

DEFAULT_WORK_DIR = Path(tempfile.gettempdir()) / "my_pkg-bench"
BOTH_HALVES = "my_pkg_engine,my_pkg_admin"
ADMIN_TOKEN = "bench-admin-token-of-thirty-two-chars"
FLASHHEAD_ROUTE = "/plugins/my_pkg/flashhead"

#: Prompts of common words (about 10-16 tokens each with the tiny word-level tokenizer).
PROMPTS = [
    "the world and the sun were there when the people came to the city",
    "what is the name of the father of the boy who found the water",
    "one two three four five six seven eight nine",
    "hello world this is a long story about a small house near the sea",
    "they said that the man would go back to the farm after the night",
    '{ " name " : " hello " , " age " : 7 }',
    "some people think the animal can live in the tree by the river",
    "my mother made food for every boy and girl at the school",
]


# ---- models and servers ----------------------------------------------------------------------


#: Benchmark builds are weight-only with the builder's default ``n_probes``: a step's cost does not depend on
#: how well stage 1 is calibrated, and calibrating a random checkpoint chooses a probe count for a model that
#: has nothing to learn (half of the clusters on the head-heavy shape), which no real model needs.  The sampled
#: rows' estimate is then fitted as a default build fits it (`_write_fitted_tail`).
BUILD_FLAGS = ("--no-calibration",)


def prepare_flashhead_model(
    work_dir: Path,
    name: str,
    spec: TinyLlamaSpec,
    *,
    iterations: int,
    n_probes: int | None = None,
    cluster_size: int = 16,
) -> Path:
    """Random checkpoint ``work_dir/name`` converted into ``work_dir/name-flashhead`` (cached)."""
    base = build_tiny_llama(work_dir / name, spec)
    out = work_dir / f"{name}-flashhead"
    wanted = json.dumps(
        {
            "spec": asdict(spec),
            "iterations": iterations,
            "n_probes": n_probes,
            "cluster_size": cluster_size,
            "flags": BUILD_FLAGS,
            "tail_estimate": "fitted to random states",
        },
        sort_keys=True,
    )
    marker = out / "bench_build.json"
    if marker.is_file() and marker.read_text() == wanted:
        return out
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "my_pkg",
        "flashhead",
        "build",
        str(base),
        "--output",
        str(out),
        "--cluster-size",
        str(cluster_size),
        "--seed",
        "0",
        "--iterations",
        str(iterations),
        "--no-progress",
        *BUILD_FLAGS,
    ]
    if n_probes is not None:
        cmd += ["--n-probes", str(n_probes)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    _write_fitted_tail(out)
    print(f"  converted {name} in {time.perf_counter() - t0:.0f} s", flush=True)
    marker.write_text(wanted)
    return out


def _write_fitted_tail(model_dir: Path) -> None:
    """Give the weight-only build the sampled rows' estimate a default build fits (fitted to random states here:
    its cost does not depend on them), so that sampled rows cost what they cost after a default build."""
    from bench._report import fitted_tail_factors
    from my_pkg.flashhead.assets import load_lm_head, read_config, save_tail_factors

    weight, _ = load_lm_head(model_dir, read_config(model_dir))
    save_tail_factors(model_dir, fitted_tail_factors(weight, weight.shape[0]))


def flashhead_server(
    model: Path,
    log_path: Path,
    *,
    max_model_len: int,
    max_num_seqs: int,
    extra_args: list[str] | None = None,
    tensor_parallel_size: int = 1,
) -> VllmServer:
    """A float32 server with both halves allowlisted and ``ADMIN_TOKEN`` as the admin token; under tensor
    parallelism (``extra_args`` names the size) each rank bound to one core of its own."""
    env: dict[str, str | None] = {
        "VLLM_PLUGINS": BOTH_HALVES,
        "MY_PKG_ADMIN_TOKEN": ADMIN_TOKEN,
        "VLLM_API_KEY": None,
        "MY_PKG_DISABLE": None,
        "MY_PKG_FLASHHEAD": None,
        "MY_PKG_FLASHHEAD_N_PROBES": None,
        "MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD": None,
        "MY_PKG_RPC_TIMEOUT": None,
        "MY_PKG_STATUS_MAX_AGE": None,
    }
    if tensor_parallel_size > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(core) for core in range(tensor_parallel_size))
    args = ["--max-num-seqs", str(max_num_seqs), *(extra_args or [])]
    return VllmServer(
        model=str(model), args=args, env=env, log_path=log_path, dtype="float32", max_model_len=max_model_len
    )


def auth_headers(token: str = ADMIN_TOKEN) -> dict[str, str]:
    return bearer(token)


class Admin(AdminClient):
    """The FlashHead admin route of one server (worker 0 is reported; all workers are set)."""

    def __init__(self, url: str, token: str = ADMIN_TOKEN) -> None:
        super().__init__(url, token)

    def status(self) -> dict[str, Any]:
        return self.flashhead()


@dataclass(frozen=True)
class RowCounts:
    """Decode rows served by FlashHead and by the dense head (by reason), from the status route; under
    speculative decoding also the verify rows and the drafter's rows FlashHead served."""

    flashhead: int
    dense: dict[str, int]
    verify: int = 0
    draft: int = 0

    @classmethod
    def of(cls, status: dict[str, Any]) -> RowCounts:
        counters = status["counters"]
        return cls(
            int(counters["rows_flashhead"]),
            {k: int(v) for k, v in counters["rows_dense"].items()},
            int(counters.get("rows_flashhead_verify", 0)),
            int(counters.get("rows_flashhead_draft", 0)),
        )

    def __sub__(self, other: RowCounts) -> RowCounts:
        keys = set(self.dense) | set(other.dense)
        dense = {k: self.dense.get(k, 0) - other.dense.get(k, 0) for k in sorted(keys)}
        return RowCounts(
            self.flashhead - other.flashhead,
            {k: v for k, v in dense.items() if v},
            self.verify - other.verify,
            self.draft - other.draft,
        )

    @property
    def total(self) -> int:
        return self.flashhead + sum(self.dense.values())

    @property
    def flashhead_share(self) -> float:
        return self.flashhead / self.total if self.total else 0.0


# ---- completion load -------------------------------------------------------------------------

#: How the requests of a load sample: greedy, or the common sampling default (T = 0.7, top_p = 0.9).
TRAFFIC: dict[str, dict[str, float]] = {
    "greedy": {"temperature": 0.0},
    "sampled": {"temperature": 0.7, "top_p": 0.9},
}


@dataclass
class LoadResult:
    concurrency: int
    requests: int = 0
    errors: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0


def completion_body(model: str, prompt: str, max_tokens: int, traffic: str = "greedy") -> dict[str, Any]:
    """A completion of exactly ``max_tokens`` tokens (``ignore_eos``), greedy or sampled (``TRAFFIC``)."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **TRAFFIC[traffic]}


def _client_loop(
    url: str,
    model: str,
    index: int,
    max_tokens: int,
    seconds: float,
    min_requests: int,
    start: threading.Barrier,
    t0: list[float],
    result: LoadResult,
    lock: threading.Lock,
    request_timeout: float,
    traffic: str,
) -> None:
    with httpx.Client(base_url=url, timeout=request_timeout) as http:
        start.wait()
        done = 0
        while done < min_requests or time.perf_counter() - t0[0] < seconds:
            prompt = PROMPTS[(index + done) % len(PROMPTS)]
            sent = time.perf_counter()
            tokens, ok = 0, False
            try:
                response = http.post("/v1/completions", json=completion_body(model, prompt, max_tokens, traffic))
                ok = response.status_code == 200
                if ok:
                    tokens = int(response.json()["usage"]["completion_tokens"])
            except (httpx.HTTPError, ValueError, KeyError):
                ok = False
            elapsed = time.perf_counter() - sent
            done += 1
            with lock:
                result.requests += 1
                result.completion_tokens += tokens
                if ok:
                    result.latencies_s.append(elapsed)
                else:
                    result.errors += 1
            if not ok:
                time.sleep(0.2)  # do not spin on a failing server


def run_load(
    url: str,
    model: str,
    *,
    concurrency: int,
    max_tokens: int,
    seconds: float,
    min_requests: int = 1,
    request_timeout: float = 600.0,
    traffic: str = "greedy",
) -> LoadResult:
    """``concurrency`` clients start together; each sends completions (``traffic``: greedy or
    sampled) one after the other until ``seconds`` have passed (at least ``min_requests`` each).
    Wall time runs until the last answer, so every counted token lies inside it."""
    if traffic not in TRAFFIC:
        raise ValueError(f"traffic {traffic!r}: not one of {sorted(TRAFFIC)}")
    result = LoadResult(concurrency)
    lock = threading.Lock()
    t0 = [0.0]
    start = threading.Barrier(concurrency + 1)
    threads = [
        threading.Thread(
            target=_client_loop,
            daemon=True,
            args=(url, model, i, max_tokens, seconds, min_requests, start, t0, result, lock, request_timeout, traffic),
        )
        for i in range(concurrency)
    ]
    for thread in threads:
        thread.start()
    t0[0] = time.perf_counter()
    start.wait()
    for thread in threads:
        thread.join()
    result.wall_s = time.perf_counter() - t0[0]
    return result


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]
