"""`make demo`: a real vLLM server with both halves of my_pkg, end to end.

Builds a small random Llama locally (no hub), converts it to a FlashHead model
with the builder, starts vLLM's OpenAI server with both plugin halves
allowlisted and an admin token, runs completions, calls every admin route,
prints what they return, and stops the server.
"""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.support.admin_client import AdminClient
from tests.support.server import ServerStartError, VllmServer
from tests.support.tiny_model import TinyLlamaSpec, build_tiny_llama

SPEC = TinyLlamaSpec(vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=2)


def _title(text: str) -> None:
    print(f"\n=== {text} " + "=" * max(0, 70 - len(text)))


def _show(response: httpx.Response, keep: int = 1200) -> None:
    print(f"{response.request.method} {response.request.url.path} -> HTTP {response.status_code}")
    if response.headers.get("content-type", "").startswith("application/json"):
        text = json.dumps(response.json(), indent=2)
    else:
        text = response.text
    print(text if len(text) <= keep else text[:keep] + "\n  ...")


def _prepare_model(work: Path) -> Path:
    base = build_tiny_llama(work / "tiny-llama", SPEC)
    flash = work / "tiny-llama-flashhead"
    if not (flash / "flash_head_assets" / "clustering_cache.safetensors").exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "my_pkg",
                "flashhead",
                "build",
                str(base),
                "--output",
                str(flash),
                "--cluster-size",
                "16",
                "--n-probes",
                "32",
            ],
            check=True,
        )
    return flash


def run(work: Path) -> int:
    _title("1. Build a small model locally and convert it to FlashHead")
    model = _prepare_model(work)
    print(f"model: {model}")

    token = secrets.token_urlsafe(32)  # the admin half warns about tokens under 32 characters
    server = VllmServer(
        model=str(model),
        env={"VLLM_PLUGINS": "my_pkg_engine,my_pkg_admin", "MY_PKG_ADMIN_TOKEN": token},
        log_path=work / "vllm-server.log",
    )
    _title("2. Start vLLM's OpenAI server with both halves allowlisted")
    print("VLLM_PLUGINS=my_pkg_engine,my_pkg_admin MY_PKG_ADMIN_TOKEN=<random>")
    print(" ".join(server.command()))
    print(f"(log: {server.log_path}; the first start compiles for a minute or two)")
    started = time.monotonic()
    try:
        server.start()
        server.wait_ready()
    except ServerStartError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"ready in {time.monotonic() - started:.0f} s at {server.url}")
    try:
        with httpx.Client(base_url=server.url, timeout=120.0) as http, AdminClient(server.url, token) as admin:
            _title("3. A completion (served through FlashHead)")
            completion = http.post(
                "/v1/completions",
                json={
                    "model": str(model),
                    "prompt": "the world and the sun",
                    "max_tokens": 16,
                    "temperature": 0,
                },
            )
            print(f"POST /v1/completions -> HTTP {completion.status_code}")
            if completion.status_code == 200:
                body = completion.json()
                print(f"text (random weights, so gibberish): {body['choices'][0]['text']!r}")
                usage = body["usage"]
                print(f"usage: {usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion tokens")
            else:
                print(completion.text)

            _title("4. Admin routes (Authorization: Bearer <token>)")
            for path in (
                "/plugins/my_pkg/health",
                "/plugins/my_pkg/workers",
                "/plugins/my_pkg/config/scheduler",
                "/plugins/my_pkg/flashhead",
            ):
                _show(admin.get(path))
                print()
            _show(admin.put("flashhead", {"n_probes": 64}), keep=500)
            print()
            _show(admin.get("metrics"), keep=900)

            _title("5. Security: no token, and a bad request")
            _show(http.get("/plugins/my_pkg/workers"))
            _show(admin.put("flashhead", {"n_probes": 0}))
    finally:
        _title("6. Stop the server")
        server.stop()
        print("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path(".demo"), help="where the model and log go")
    args = parser.parse_args(argv)
    return run(args.work_dir)


if __name__ == "__main__":
    sys.exit(main())
