"""Admin routes under load: their latency while completions stream, and what polling costs.

One vLLM server serves a small random Llama converted to FlashHead (both plugin halves,
admin token set, every admin setting at its default).  Three phases of ``--seconds`` each run
a steady completion load (``--clients`` closed-loop clients, greedy, ``--max-tokens`` tokens
each, ``ignore_eos``): without polling, with polling, without polling again.  During the
polling phase one poller sends GET requests at ``--hz`` on a fixed schedule, rotating through
every read route (health, workers, config/scheduler, flashhead, metrics, audit) and, in the same
rotation, vLLM's own ``/v1/models`` and ``/health`` (the baseline: what any route of this server
costs on this machine now), and records each answer's latency and status (any non-200 is an
error).  Reported: latency p50/p99 per route, for the plugin's routes and for vLLM's, errors,
the achieved polling rate, completion tokens/s per phase
(polling vs the mean of the two phases without), and whether the targets of issue #9 are met.

    python -m bench.admin_load --quick                 # 3 x 5 s, prints only
    python -m bench.admin_load --write-docs            # 10 Hz, 3 x 60 s, writes the admin section
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench._load import (
    ADMIN_TOKEN,
    DEFAULT_WORK_DIR,
    LoadResult,
    auth_headers,
    flashhead_server,
    percentile,
    prepare_flashhead_model,
    run_load,
)
from bench._report import command_line, machine_description, write_section
from tests.support.tiny_model import TinyLlamaSpec

SPEC = TinyLlamaSpec(
    vocab_size=32000,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)
PREFIX = "/plugins/my_pkg"
REQUEST_TIMEOUT_S = 60.0  # a completion of the small model takes well under a second
PLUGIN_ROUTES = tuple(
    f"{PREFIX}/{r}" for r in ("health", "workers", "config/scheduler", "flashhead", "metrics", "audit")
)
#: vLLM's own routes, polled in the same rotation: a slow machine slows them too, a slow plugin does not.
VLLM_ROUTES = ("/v1/models", "/health")
ROUTES = PLUGIN_ROUTES + VLLM_ROUTES
#: Issue #9: polling every read route at 10 Hz must leave generation alone and answer fast.
TARGET_THROUGHPUT_RATIO = 0.98
TARGET_P99_MS = 50.0
TARGET_RATE_HZ = 9.5


@dataclass
class PollResult:
    seconds: float = 0.0
    latencies_ms: dict[str, list[float]] = field(default_factory=lambda: {r: [] for r in ROUTES})
    errors: dict[str, int] = field(default_factory=lambda: {r: 0 for r in ROUTES})

    @property
    def requests(self) -> int:
        return sum(len(v) for v in self.latencies_ms.values()) + sum(self.errors.values())

    @property
    def all_latencies(self) -> list[float]:
        return self.latencies_of(PLUGIN_ROUTES)

    def latencies_of(self, routes: tuple[str, ...]) -> list[float]:
        return [x for r in routes for x in self.latencies_ms[r]]

    def errors_of(self, routes: tuple[str, ...]) -> int:
        return sum(self.errors[r] for r in routes)


def poll(url: str, token: str, hz: float, seconds: float, stop: threading.Event, result: PollResult) -> None:
    """GET the admin routes in turn on a fixed schedule (no catch-up bursts) until ``seconds``
    have passed or ``stop`` is set.  Latency is recorded for 200 answers; anything else counts
    as an error of that route."""
    period = 1.0 / hz
    with httpx.Client(base_url=url, headers=auth_headers(token), timeout=10.0) as http:
        t0 = time.perf_counter()
        next_at, i = t0, 0
        while not stop.is_set() and time.perf_counter() - t0 < seconds:
            route = ROUTES[i % len(ROUTES)]
            i += 1
            sent = time.perf_counter()
            try:
                ok = http.get(route).status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                result.latencies_ms[route].append((time.perf_counter() - sent) * 1e3)
            else:
                result.errors[route] += 1
            next_at = max(next_at + period, time.perf_counter())
            stop.wait(max(0.0, next_at - time.perf_counter()))
        result.seconds = time.perf_counter() - t0


@dataclass
class Phase:
    name: str
    load: LoadResult
    poll: PollResult | None = None


def run_phase(name: str, url: str, model: str, args: argparse.Namespace, polling: bool) -> Phase:
    phase = Phase(name, LoadResult(args.clients))
    stop = threading.Event()
    poller = None
    if polling:
        phase.poll = PollResult()
        poller = threading.Thread(
            target=poll, args=(url, ADMIN_TOKEN, args.hz, args.seconds, stop, phase.poll), daemon=True
        )
        poller.start()
    try:
        phase.load = run_load(
            url,
            model,
            concurrency=args.clients,
            max_tokens=args.max_tokens,
            seconds=args.seconds,
            request_timeout=REQUEST_TIMEOUT_S,
        )
    finally:
        stop.set()
        if poller is not None:
            poller.join()
    extra = ""
    if phase.poll is not None:
        lat, base = phase.poll.all_latencies, phase.poll.latencies_of(VLLM_ROUTES)
        extra = (
            f"; {phase.poll.requests} polls ({phase.poll.requests / phase.poll.seconds:.1f}/s), "
            f"plugin p50 {percentile(lat, 50):.1f} / p99 {percentile(lat, 99):.1f} ms, "
            f"vLLM's own p50 {percentile(base, 50):.1f} / p99 {percentile(base, 99):.1f} ms, "
            f"{sum(phase.poll.errors.values())} errors"
        )
    print(
        f"  {name:18s}: {phase.load.tokens_per_s:7.1f} tok/s ({phase.load.requests} completions, "
        f"{phase.load.errors} errors, {phase.load.wall_s:.1f} s){extra}",
        flush=True,
    )
    return phase


def scrape_vllm_metrics(url: str) -> str:
    """One scrape of vLLM's own /metrics after the run: does it carry the plugin's series?"""
    with httpx.Client(base_url=url, timeout=30.0) as http:
        sent = time.perf_counter()
        response = http.get("/metrics")
        elapsed_ms = (time.perf_counter() - sent) * 1e3
    ours = [line for line in response.text.splitlines() if line.startswith("my_pkg_")]
    return (
        f"vLLM's own `/metrics`, scraped once after the run: HTTP {response.status_code} in {elapsed_ms:.0f} ms, "
        f"{len(ours)} `my_pkg_*` samples (e.g. `{ours[0] if ours else 'none'}`)."
    )


def to_markdown(phases: list[Phase], args: argparse.Namespace) -> str:
    polled = next(p for p in phases if p.poll is not None)
    quiet = [p for p in phases if p.poll is None]
    quiet_tps = sum(p.load.tokens_per_s for p in quiet) / len(quiet)
    pr = polled.poll
    assert pr is not None
    out = [
        "### Admin routes under load",
        "",
        f"Machine: {args.machine}",
        "",
        f"Command: `{command_line()}`",
        "",
        f"One vLLM server (float32) serving a random Llama converted to FlashHead: V = {SPEC.vocab_size:,}, "
        f"H = {SPEC.hidden_size}, {SPEC.num_hidden_layers} layers; both plugin halves, admin token set, "
        "`MY_PKG_STATUS_MAX_AGE` at its default (1 s). "
        f"{_binding()}"
        f"Completion load in every phase: {args.clients} closed-loop clients, greedy, {args.max_tokens} tokens "
        f"each (`ignore_eos`). Phases of {args.seconds:g} s: without polling, with polling, without polling. "
        f"Polling: one client at {args.hz:g} Hz on a fixed schedule, rotating through "
        f"{', '.join(ROUTES)} (authenticated GETs; vLLM's own two routes are the baseline of the same run); "
        f"achieved {pr.requests / pr.seconds:.1f} requests/s. "
        "Latency = request to full answer, measured by the client; error = any answer other than 200.",
        "",
        "| route | requests | errors | p50 ms | p99 ms | max ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    rows = [(f"`{r}`", pr.latencies_ms[r], pr.errors[r]) for r in PLUGIN_ROUTES]
    rows.append(("**plugin, all**", pr.latencies_of(PLUGIN_ROUTES), pr.errors_of(PLUGIN_ROUTES)))
    rows += [(f"`{r}` (vLLM)", pr.latencies_ms[r], pr.errors[r]) for r in VLLM_ROUTES]
    rows.append(("**vLLM's own, all** (baseline)", pr.latencies_of(VLLM_ROUTES), pr.errors_of(VLLM_ROUTES)))
    for name, lat, errors in rows:
        out.append(
            f"| {name} | {len(lat) + errors} | {errors} | {percentile(lat, 50):.1f} | "
            f"{percentile(lat, 99):.1f} | {max(lat, default=float('nan')):.1f} |"
        )
    out += ["", "| phase | completion tok/s | completions | completion errors |", "|---|---:|---:|---:|"]
    for p in phases:
        out.append(f"| {p.name} | {p.load.tokens_per_s:.1f} | {p.load.requests} | {p.load.errors} |")
    ratio = polled.load.tokens_per_s / quiet_tps if quiet_tps else float("nan")
    p99 = percentile(pr.all_latencies, 99)
    rate = pr.requests / pr.seconds
    spread = abs(quiet[0].load.tokens_per_s - quiet[-1].load.tokens_per_s) / quiet_tps if quiet_tps else float("nan")
    out += [
        "",
        f"Throughput with polling / without (mean of the two phases without): {ratio:.3f}. "
        f"The two phases without polling differ by {spread:.1%} of their mean: a ratio nearer to 1 than "
        "that is within this run's noise.",
        "",
    ]
    if args.hz >= 10:
        out += [
            "| target (issue #9) | measured | met |",
            "|---|---:|:---:|",
            _target_row(
                f"throughput with / without polling >= {TARGET_THROUGHPUT_RATIO}",
                f"{ratio:.3f}",
                ratio >= TARGET_THROUGHPUT_RATIO,
            ),
            _target_row(f"admin p99 <= {TARGET_P99_MS:g} ms", f"{p99:.1f} ms", p99 <= TARGET_P99_MS),
            _target_row(f"achieved polling rate >= {TARGET_RATE_HZ} Hz", f"{rate:.1f} Hz", rate >= TARGET_RATE_HZ),
            "",
        ]
    if getattr(args, "vllm_metrics", None):
        out += [args.vllm_metrics, ""]
    out.append(f"Load average at the end: {_load_average()}.")
    return "\n".join(out)


def _target_row(target: str, measured: str, met: bool) -> str:
    return f"| {target} | {measured} | {'yes' if met else '**no**'} |"


def _load_average() -> str:
    if not hasattr(os, "getloadavg"):
        return "unknown"
    return " / ".join(f"{value:.1f}" for value in os.getloadavg()) + " (1 / 5 / 15 min)"


def _binding() -> str:
    """How the worker's OpenMP threads were placed (vLLM's CPU setting), as the docs should say."""
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if not bind:
        return "Worker threads placed by vLLM (no `VLLM_CPU_OMP_THREADS_BIND`). "
    return (
        f"`VLLM_CPU_OMP_THREADS_BIND={bind}`: the worker's compute threads on those cores, the other cores "
        "left to the API server and the clients. "
    )


def section_name(hz: float) -> str:
    """`admin` at the default 10 Hz, `admin-<hz>hz` at another polling rate."""
    return "admin" if hz == 10.0 else f"admin-{hz:g}hz"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hz", type=float, default=10.0, help="admin requests per second")
    ap.add_argument("--seconds", type=float, default=None, help="per phase (default 60; quick: 5)")
    ap.add_argument("--clients", type=int, default=4, help="concurrent completion clients")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--iterations", type=int, default=2, help="k-means iterations of the conversion")
    ap.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR, help="checkpoint cache and server logs")
    ap.add_argument("--quick", action="store_true", help="short phases (smoke test)")
    ap.add_argument(
        "--write-docs",
        action="store_true",
        help="write the admin section of docs/benchmarks.md (admin-<hz>hz at another --hz)",
    )
    args = ap.parse_args(argv)
    if args.hz <= 0 or args.clients < 1:
        ap.error("--hz must be > 0 and --clients >= 1")
    args.seconds = args.seconds if args.seconds is not None else (5.0 if args.quick else 60.0)
    args.work_dir.mkdir(parents=True, exist_ok=True)

    args.machine = machine_description()  # its load average is the one at the start
    print(args.machine)
    model = prepare_flashhead_model(args.work_dir, "admin-llama", SPEC, iterations=args.iterations)
    server = flashhead_server(
        model,
        args.work_dir / "logs" / "admin-load.log",
        max_model_len=args.max_tokens + 64,
        max_num_seqs=max(32, args.clients),
    )
    t0 = time.perf_counter()
    with server:
        print(f"  server ready in {time.perf_counter() - t0:.0f} s (log: {server.log_path})", flush=True)
        run_load(
            server.url,
            server.model,
            concurrency=args.clients,
            max_tokens=4,
            seconds=0,
            request_timeout=REQUEST_TIMEOUT_S,
        )  # warm-up
        phases = []
        for name, polling in (
            ("without polling", False),
            (f"polling {args.hz:g} Hz", True),
            ("without polling (2)", False),
        ):
            phases.append(run_phase(name, server.url, server.model, args, polling))
            if phases[-1].load.errors and phases[-1].load.errors == phases[-1].load.requests:
                print(f"every completion failed; stopping. Server log tail:\n{server.log_tail(30)}")
                return 1
        args.vllm_metrics = scrape_vllm_metrics(server.url)
    md = to_markdown(phases, args)
    print()
    print(md)
    if args.write_docs:
        print(f"wrote {write_section(section_name(args.hz), md)}")
    polled = phases[1].poll
    errors = sum(p.load.errors for p in phases) + (sum(polled.errors.values()) if polled else 0)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
