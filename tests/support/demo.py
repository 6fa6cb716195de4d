"""`make demo`: FlashHead serving a model trained on real text, measured by the server itself.

1. Writes the committed demo model (`tests/assets/demo_lm`: a 1-layer Llama with a 32,768-token vocabulary,
   trained on Python standard-library docstrings and code) as a Hugging Face checkpoint, and converts it with
   the default builder (`my-pkg flashhead build`: self-calibrated on the model's own samples).
2. Starts vLLM's OpenAI server with both plugin halves and an admin token, with the defaults users get;
   meanwhile `my-pkg flashhead eval --json --plot` measures top-1 agreement and sampled TV on held-out
   text the model never trained on, and draws them.
3. Shows, in this order: a completion; FlashHead's share of the head's rows from the server's `/metrics`
   counters; tokens/s with FlashHead and with the dense head on the same server (`PUT {"enabled": false}`
   between, then back), greedy and sampled; the fidelity at the served probes; a `PUT` of `n_probes` and its
   effect. Then stops the server.
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.admin_client import AdminClient
from tests.support.demo_model import DEMO_MODEL_DIR, expand_demo_model
from tests.support.server import ServerStartError, VllmServer

PROMPT = "Return the number of"
#: The completion shown: sampled (a small model trained for minutes repeats itself under greedy decoding).
COMPLETION = {"temperature": 0.8, "top_p": 0.95, "seed": 0}
#: Tokens per timed request (EOS ignored, so every request decodes exactly this many).
TIMED_TOKENS = 64
ROUNDS = 3
SAMPLED = {"temperature": 1.0, "top_p": 0.95}
#: The default build, sized for a demo: a smaller self-calibration sample (the default is 8,192 states) and fewer
#: k-means iterations (the default is 20), so that a fresh clone's `make demo` builds in about a minute.
BUILD_ARGS = ("--self-calibration-states", "2048", "--iterations", "8")
_ROWS = re.compile(r"^my_pkg_flashhead_rows_total\{(?P<labels>[^}]*)\}\s+(?P<value>[0-9.eE+-]+)$")


def _title(text: str) -> None:
    print(f"\n=== {text} " + "=" * max(0, 70 - len(text)), flush=True)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "my_pkg", "flashhead", *args]


def _shown(command: list[str]) -> str:
    return " ".join(["my-pkg", *command[3:]])


def prepare_model(work: Path, assets: Path = DEMO_MODEL_DIR) -> Path:
    """The demo model as a checkpoint, converted by the default builder (both kept in `work` for reruns)."""
    base = expand_demo_model(work / "demo-lm", assets)
    flash = work / "demo-lm-flashhead"
    if not (flash / "flash_head_assets" / "clustering_cache.safetensors").exists():
        command = _cli("build", str(base), "--output", str(flash), *BUILD_ARGS, "--no-progress")
        print(f"$ {_shown(command)}", flush=True)
        subprocess.run(command, check=True)
    else:
        print(f"(reusing {flash}; delete it to build again)")
    return flash


def start_eval(model: Path, work: Path, assets: Path = DEMO_MODEL_DIR) -> tuple[subprocess.Popen, list[str], Path, int]:
    """Start `eval --json --plot` on the held-out text's hidden states; returns (process, command, png, probes)."""
    from my_pkg.flashhead.hf import capture_hidden_states

    states = work / "heldout_states.safetensors"
    if not states.exists():
        from safetensors.torch import save_file
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # the text is longer than the context: it is read in pieces
        hidden = capture_hidden_states(model, (assets / "heldout.txt").read_text(), max_tokens=4096)
        save_file({"hidden_states": hidden.contiguous()}, str(states))
    served = int(json.loads((model / "config.json").read_text())["n_probes"])
    fewer = max(1, served // 2)
    png = work / "flashhead-fidelity.png"
    command = _cli(
        "eval", str(model), "--hidden", str(states), "--samples", "1024", "--json",
        "--probes", f"{fewer},{served}", "--plot", str(png),
    )  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True), command, png, fewer


def rows_counters(admin: AdminClient) -> dict[str, float]:
    """The server's `my_pkg_flashhead_rows_total` counters, summed over workers: `flashhead` and `dense:<reason>`."""
    response = admin.get("metrics")
    response.raise_for_status()
    totals: dict[str, float] = {}
    for line in response.text.splitlines():
        match = _ROWS.match(line.strip())
        if not match:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match["labels"]))
        key = "flashhead" if labels.get("path") == "flashhead" else f"dense:{labels.get('reason', '')}"
        totals[key] = totals.get(key, 0.0) + float(match["value"])
    return totals


def _complete(http: httpx.Client, model: str, max_tokens: int, **sampling: object) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0, **sampling}
    response = http.post("/v1/completions", json=body)
    response.raise_for_status()
    return response.json()


def tokens_per_second(http: httpx.Client, model: str, **sampling: object) -> float:
    """Decode speed of one request of exactly `TIMED_TOKENS` tokens."""
    started = time.perf_counter()
    body = _complete(http, model, TIMED_TOKENS, ignore_eos=True, min_tokens=TIMED_TOKENS, **sampling)
    elapsed = time.perf_counter() - started
    return body["usage"]["completion_tokens"] / elapsed


@dataclass
class Speeds:
    """Median tokens/s per (path, mode) over the rounds."""

    values: dict[tuple[str, str], list[float]]

    def median(self, path: str, mode: str) -> float:
        return statistics.median(self.values[(path, mode)])


def measure_speeds(http: httpx.Client, admin: AdminClient, model: str, rounds: int = ROUNDS) -> Speeds:
    """Alternate FlashHead and the dense head on the same server, round by round (load on the machine drifts)."""
    modes = {"greedy": {}, "sampled": {**SAMPLED, "seed": 0}}
    values: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for path, enabled in (("flashhead", True), ("dense", False)):
            admin.update(enabled=enabled)
            for mode, sampling in modes.items():
                values.setdefault((path, mode), []).append(tokens_per_second(http, model, **sampling))
    admin.update(enabled=True)
    return Speeds(values)


def _share(before: dict[str, float], after: dict[str, float]) -> tuple[float, float, dict[str, float]]:
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    flash = delta.get("flashhead", 0.0)
    dense = {k.split(":", 1)[1]: v for k, v in delta.items() if k.startswith("dense:") and v}
    return flash, sum(dense.values()), dense


def run(work: Path, assets: Path = DEMO_MODEL_DIR) -> int:
    demo_started = time.monotonic()
    _title("1. The model, and FlashHead assets from the default builder")
    model = prepare_model(work, assets)
    config = json.loads((model / "config.json").read_text())
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    record = config.get("flash_head_calibration", {})
    print(
        f"model: 1-layer Llama trained on Python docstrings and code; vocabulary {vocab:,} x hidden {hidden} "
        f"(the LM head is {vocab * hidden / 1e6:.1f} M of its parameters)"
    )
    print(
        f"assets: n_probes={config['n_probes']}; stage 1 kept: {record.get('stage1', 'calibrated')} "
        f"({record.get('stage1_reason', 'no record')})"
    )

    token = secrets.token_urlsafe(32)  # the admin half warns about tokens under 32 characters
    server = VllmServer(
        model=str(model),
        env={"VLLM_PLUGINS": "my_pkg_engine,my_pkg_admin", "MY_PKG_ADMIN_TOKEN": token},
        log_path=work / "vllm-server.log",
        max_model_len=256,
    )
    _title("2. Start vLLM's OpenAI server (defaults), and measure fidelity offline meanwhile")
    print("VLLM_PLUGINS=my_pkg_engine,my_pkg_admin MY_PKG_ADMIN_TOKEN=<random>")
    print(" ".join(server.command()))
    started = time.monotonic()
    try:
        server.start()
        evaluation, eval_command, png, fewer = start_eval(model, work, assets)
        server.wait_ready()
    except ServerStartError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"ready in {time.monotonic() - started:.0f} s at {server.url} (log: {server.log_path})")
    try:
        with httpx.Client(base_url=server.url, timeout=300.0) as http, AdminClient(server.url, token) as admin:
            name = str(model)
            before = rows_counters(admin)
            _title("3. A completion")
            body = _complete(http, name, 40, **COMPLETION)
            print(f"prompt: {PROMPT!r}\ncompletion (sampled, {COMPLETION}): {body['choices'][0]['text']!r}")

            _title("4. FlashHead's share of the head's rows (the server's /metrics)")
            for sampling in ({}, {**SAMPLED, "seed": 1}):  # one greedy and one sampled request more
                _complete(http, name, TIMED_TOKENS, ignore_eos=True, **sampling)
            flash, dense, reasons = _share(before, rows_counters(admin))
            share = flash / max(1.0, flash + dense)
            print(f"my_pkg_flashhead_rows_total: path=flashhead +{flash:.0f}, path=dense +{dense:.0f} {reasons or ''}")
            print(f"FlashHead served {share:.1%} of the rows of these 3 requests (greedy and sampled)")

            _title("5. Tokens/s, FlashHead vs the dense head on the same server")
            print(
                f'{ROUNDS} rounds of: PUT /plugins/my_pkg/flashhead {{"enabled": true}}, a greedy and a sampled '
                f'request of {TIMED_TOKENS} tokens, then the same with {{"enabled": false}}; medians'
            )
            speeds = measure_speeds(http, admin, name)
            ratios = {}
            for mode in ("greedy", "sampled"):
                fh, dn = speeds.median("flashhead", mode), speeds.median("dense", mode)
                ratios[mode] = fh / dn
                what = "temperature 0" if mode == "greedy" else "temperature 1.0, top_p 0.95"
                print(f"{mode:8s} ({what}): FlashHead {fh:6.1f} tok/s, dense {dn:6.1f} tok/s -> {fh / dn:.2f}x")

            _title("6. Fidelity on held-out text at the served probes")
            out, _ = evaluation.communicate(timeout=600)
            if evaluation.returncode != 0:
                print(f"eval failed (exit {evaluation.returncode})", file=sys.stderr)
                return 1
            report = json.loads(out)
            print(f"$ {_shown(eval_command)}")
            results = {r["n_probes"]: r for r in report["results"]}
            served = int(config["n_probes"])
            _print_fidelity(results[served], report["hidden_states"])
            print(f"plot: {png}")

            _title("7. PUT n_probes and its effect")
            status = admin.update(n_probes=fewer)
            greedy = statistics.median(tokens_per_second(http, name) for _ in range(ROUNDS))
            fewer_result = results[fewer]
            print(f'PUT /plugins/my_pkg/flashhead {{"n_probes": {fewer}}} -> n_probes {status["n_probes"]}')
            print(
                f"greedy {greedy:.1f} tok/s (was {speeds.median('flashhead', 'greedy'):.1f} at {served}); top-1 "
                f"agreement on held-out text {fewer_result['top1_agreement']:.2%} (was "
                f"{results[served]['top1_agreement']:.2%}), rows scored {fewer_result['scored_fraction']:.1%} "
                f"(was {results[served]['scored_fraction']:.1%})"
            )
            admin.update(n_probes=served)
            print(f'PUT {{"n_probes": {served}}}: back to the built value')

            _title("Summary")
            print(
                f"FlashHead share of rows {share:.1%}; tokens/s FlashHead / dense: greedy {ratios['greedy']:.2f}x, "
                f"sampled {ratios['sampled']:.2f}x; top-1 agreement {results[served]['top1_agreement']:.2%} at "
                f"n_probes={served}; demo took {time.monotonic() - demo_started:.0f} s"
            )
    finally:
        server.stop()
        print("server stopped")
    return 0


def _print_fidelity(result: dict, states: int) -> None:
    print(
        f"{states:,} hidden states of held-out docstrings; n_probes={result['n_probes']}: greedy rows score "
        f"{result['scored_fraction']:.1%} of the vocabulary, top-1 agreement with the dense head "
        f"{result['top1_agreement']:.2%}, dense top-5 scored {result['top5_agreement']:.2%}"
    )
    for s in result["sampling"]:
        print(
            f"  sampled rows, T={s['temperature']:g} top_p={s['top_p']:g}: total-variation distance "
            f"{s['tv_distance']:.4f} (p90 {s['tv_p90']:.3f}), {s['scored_fraction']:.1%} of the rows scored"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path(".demo"), help="where the model, plot and log go")
    parser.add_argument(
        "--assets", type=Path, default=DEMO_MODEL_DIR, help="the stored demo model (tests.support.demo_model)"
    )
    args = parser.parse_args(argv)
    return run(args.work_dir, args.assets)


if __name__ == "__main__":
    sys.exit(main())
