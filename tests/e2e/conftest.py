"""Real vLLM OpenAI servers on CPU, one per configuration, shared by the whole session.

Every server serves a tiny random Llama built locally (no hub); the FlashHead
variant is converted by this package's own builder CLI.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e_support import API_KEY, BOTH_HALVES, CLUSTER_SIZE, DEFAULT_PROBES, MODEL_SPEC
from my_pkg.devtools.server import VllmServer
from my_pkg.devtools.tiny_model import build_tiny_llama


def _server(model: Path, logs: Path, name: str, env: dict[str, str | None], args: list[str] = ()) -> VllmServer:
    base_env: dict[str, str | None] = {
        "MY_PKG_ADMIN_TOKEN": None,
        "VLLM_API_KEY": None,
        "MY_PKG_DISABLE": None,
        "MY_PKG_FLASHHEAD": None,
    }
    base_env.update(env)
    return VllmServer(model=str(model), args=list(args), env=base_env, log_path=logs / f"{name}.log")


@pytest.fixture(scope="session")
def e2e_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="session")
def base_model(e2e_dir: Path) -> Path:
    return build_tiny_llama(e2e_dir / "tiny-llama", MODEL_SPEC)


@pytest.fixture(scope="session")
def flashhead_model(base_model: Path, e2e_dir: Path) -> Path:
    """The base model converted by `python -m my_pkg flashhead build --output`."""
    out = e2e_dir / "tiny-llama-flashhead"
    subprocess.run(
        [sys.executable, "-m", "my_pkg", "flashhead", "build", str(base_model),
         "--output", str(out), "--cluster-size", str(CLUSTER_SIZE),
         "--n-probes", str(DEFAULT_PROBES), "--seed", "0"],
        check=True,
    )
    return out


@pytest.fixture(scope="session")
def logs_dir(e2e_dir: Path) -> Path:
    path = Path(os.environ.get("MY_PKG_E2E_LOGS", e2e_dir / "logs"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def flashhead_server(flashhead_model: Path, logs_dir: Path) -> Iterator[VllmServer]:
    """Both halves allowlisted, `--api-key` set, FlashHead model in float32."""
    with _server(flashhead_model, logs_dir, "flashhead", {"VLLM_PLUGINS": BOTH_HALVES},
                 ["--api-key", API_KEY]) as server:
        yield server


@pytest.fixture(scope="session")
def plain_vllm_server(base_model: Path, logs_dir: Path) -> Iterator[VllmServer]:
    """The same weights, standard architecture, nothing allowlisted: vLLM as shipped."""
    with _server(base_model, logs_dir, "plain", {"VLLM_PLUGINS": ""}) as server:
        yield server


@pytest.fixture(scope="session")
def endpoint_only_server(base_model: Path, logs_dir: Path) -> Iterator[VllmServer]:
    """Endpoint half allowlisted, engine half not."""
    with _server(base_model, logs_dir, "endpoint-only", {"VLLM_PLUGINS": "my_pkg_admin"}) as server:
        yield server


@pytest.fixture(scope="session")
def tp2_server(flashhead_model: Path, logs_dir: Path) -> Iterator[VllmServer]:
    """Tensor parallel 2 on CPU (two worker processes), both halves, token via MY_PKG_ADMIN_TOKEN."""
    with _server(
        flashhead_model, logs_dir, "tp2",
        {"VLLM_PLUGINS": BOTH_HALVES, "VLLM_CPU_OMP_THREADS_BIND": "0|1", "MY_PKG_ADMIN_TOKEN": "tp2-token"},
        ["--tensor-parallel-size", "2"],
    ) as server:
        yield server
