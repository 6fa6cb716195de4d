"""Real vLLM OpenAI servers on CPU, one per configuration.

Servers several test modules use live for the whole session; a server only one
module uses lives for that module, so that the machine never holds more servers
than it has memory for.

Every server serves a tiny random Llama built locally (no hub); the FlashHead
variant is converted by this package's own builder CLI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_support import (
    ADMIN_TOKEN,
    API_KEY,
    BOTH_HALVES,
    CLUSTER_SIZE,
    DEFAULT_PROBES,
    LORA_NAME,
    MODEL_SPEC,
    NGRAM_SPEC,
    READ_TOKEN,
    RPC_TIMEOUT,
    draft_model_spec,
)

from tests.support.server import VllmServer
from tests.support.tiny_model import build_tiny_llama, build_tiny_lora


def _server(model: Path, logs: Path, name: str, env: dict[str, str | None], args: list[str] = ()) -> VllmServer:
    base_env: dict[str, str | None] = {
        "MY_PKG_ADMIN_TOKEN": None,
        "VLLM_API_KEY": None,
        "MY_PKG_DISABLE": None,
        "MY_PKG_FLASHHEAD": None,
        # Every read asks the workers: the tests compare counters across steps shorter than the
        # default snapshot age and expect a paused worker to be noticed at once.
        "MY_PKG_STATUS_MAX_AGE": "0",
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
        [
            sys.executable,
            "-m",
            "my_pkg",
            "flashhead",
            "build",
            str(base_model),
            "--output",
            str(out),
            "--cluster-size",
            str(CLUSTER_SIZE),
            "--n-probes",
            str(DEFAULT_PROBES),
            "--seed",
            "0",
        ],
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
    """Both halves allowlisted, `--api-key` and a read token (read role), an admin token; FlashHead model in float32."""
    with _server(
        flashhead_model,
        logs_dir,
        "flashhead",
        {
            "VLLM_PLUGINS": BOTH_HALVES,
            "MY_PKG_RPC_TIMEOUT": RPC_TIMEOUT,
            "MY_PKG_ADMIN_TOKEN": ADMIN_TOKEN,
            "MY_PKG_READ_TOKEN": READ_TOKEN,
        },
        ["--api-key", API_KEY],
    ) as server:
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
        flashhead_model,
        logs_dir,
        "tp2",
        {
            "VLLM_PLUGINS": BOTH_HALVES,
            "VLLM_CPU_OMP_THREADS_BIND": "0|1",
            "MY_PKG_ADMIN_TOKEN": "tp2-token",
            "MY_PKG_RPC_TIMEOUT": RPC_TIMEOUT,
        },
        ["--tensor-parallel-size", "2"],
    ) as server:
        yield server


@pytest.fixture(scope="session")
def lora_adapter(base_model: Path, e2e_dir: Path) -> Path:
    return build_tiny_lora(e2e_dir / "tiny-lora", base_model)


def _lora_server(model: Path, adapter: Path, logs: Path, name: str) -> VllmServer:
    """`--enable-lora` with the adapter served as LORA_NAME, both halves loaded."""
    return _server(
        model,
        logs,
        name,
        {"VLLM_PLUGINS": BOTH_HALVES, "MY_PKG_ADMIN_TOKEN": ADMIN_TOKEN},
        ["--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"{LORA_NAME}={adapter}"],
    )


@pytest.fixture(scope="module")
def lora_plain_server(base_model: Path, lora_adapter: Path, logs_dir: Path) -> Iterator[VllmServer]:
    with _lora_server(base_model, lora_adapter, logs_dir, "lora-plain") as server:
        yield server


@pytest.fixture(scope="module")
def lora_flashhead_server(flashhead_model: Path, lora_adapter: Path, logs_dir: Path) -> Iterator[VllmServer]:
    """The FlashHead model: same weights as the plain one, plus FlashHead assets."""
    with _lora_server(flashhead_model, lora_adapter, logs_dir, "lora-flashhead") as server:
        yield server


@pytest.fixture(scope="module")
def ngram_server(flashhead_model: Path, logs_dir: Path) -> Iterator[VllmServer]:
    """The FlashHead model with n-gram speculative decoding (`NGRAM_SPEC`), both halves."""
    with _server(
        flashhead_model,
        logs_dir,
        "ngram",
        {"VLLM_PLUGINS": BOTH_HALVES, "MY_PKG_ADMIN_TOKEN": ADMIN_TOKEN, "MY_PKG_RPC_TIMEOUT": RPC_TIMEOUT},
        ["--speculative-config", json.dumps(NGRAM_SPEC)],
    ) as server:
        yield server


@pytest.fixture(scope="module")
def flashhead_drafter_server(flashhead_model: Path, logs_dir: Path) -> Iterator[VllmServer]:
    """The FlashHead model drafting for itself (`draft_model_spec`): the drafter's head is FlashHead too."""
    with _server(
        flashhead_model,
        logs_dir,
        "draft-flashhead",
        {"VLLM_PLUGINS": BOTH_HALVES, "MY_PKG_ADMIN_TOKEN": ADMIN_TOKEN, "MY_PKG_RPC_TIMEOUT": RPC_TIMEOUT},
        ["--speculative-config", json.dumps(draft_model_spec(flashhead_model))],
    ) as server:
        yield server


@pytest.fixture(scope="module")
def features_server(flashhead_model: Path, logs_dir: Path) -> Iterator[VllmServer]:
    """FlashHead with prefix caching and a small chunked-prefill budget; killed by its last test."""
    with _server(
        flashhead_model,
        logs_dir,
        "features",
        {"VLLM_PLUGINS": BOTH_HALVES, "MY_PKG_ADMIN_TOKEN": ADMIN_TOKEN, "MY_PKG_RPC_TIMEOUT": RPC_TIMEOUT},
        [
            "--enable-prefix-caching",
            "--enable-chunked-prefill",
            "--max-num-batched-tokens",
            "32",
            "--max-num-seqs",
            "8",
        ],
    ) as server:
        yield server


@pytest.fixture(scope="module")
def pooling_server(base_model: Path, logs_dir: Path) -> Iterator[VllmServer]:
    """The model served as an embedding model, with both halves loaded."""
    with _server(
        base_model,
        logs_dir,
        "pooling",
        {"VLLM_PLUGINS": BOTH_HALVES, "MY_PKG_ADMIN_TOKEN": ADMIN_TOKEN},
        ["--runner", "pooling", "--convert", "embed"],
    ) as server:
        yield server


OTHER_PLUGIN = '''"""A general plugin that also replaces vLLM's LogitsProcessor, loaded after my_pkg."""

from vllm.model_executor.layers.logits_processor import LogitsProcessor


class OtherPluginLogitsProcessor(LogitsProcessor):
    pass


def register():
    import my_pkg.engine

    my_pkg.engine.register()  # my_pkg first: the order in which a duplicate used to kill start-up
    LogitsProcessor.register_oot(OtherPluginLogitsProcessor)
'''


@pytest.fixture(scope="session")
def other_plugin_path(e2e_dir: Path) -> Path:
    """A second installed distribution with a `vllm.general_plugins` entry point (via PYTHONPATH)."""
    root = e2e_dir / "other-plugin"
    info = root / "other_logits_plugin-0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (root / "other_logits_plugin.py").write_text(OTHER_PLUGIN)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: other-logits-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\nother_logits = other_logits_plugin:register\n")
    return root


@pytest.fixture(scope="module")
def other_plugin_server(flashhead_model: Path, other_plugin_path: Path, logs_dir: Path) -> Iterator[VllmServer]:
    """The FlashHead model with both halves and another plugin that owns LogitsProcessor."""
    pythonpath = os.pathsep.join(filter(None, [str(other_plugin_path), os.environ.get("PYTHONPATH")]))
    with _server(
        flashhead_model,
        logs_dir,
        "other-plugin",
        {"VLLM_PLUGINS": f"other_logits,{BOTH_HALVES}", "MY_PKG_ADMIN_TOKEN": ADMIN_TOKEN, "PYTHONPATH": pythonpath},
    ) as server:
        yield server


@pytest.fixture(scope="module")
def dp2_server(flashhead_model: Path, logs_dir: Path) -> Iterator[VllmServer]:
    """Data parallel 2 on CPU: two engine cores (one worker each) behind one API server."""
    with _server(
        flashhead_model,
        logs_dir,
        "dp2",
        {"VLLM_PLUGINS": BOTH_HALVES, "VLLM_CPU_OMP_THREADS_BIND": "0|1", "MY_PKG_ADMIN_TOKEN": ADMIN_TOKEN},
        ["--data-parallel-size", "2"],
    ) as server:
        yield server
