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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from e2e_support import (
    ADMIN_TOKEN,
    API_KEY,
    BOTH_HALVES,
    CLUSTER_SIZE,
    DEFAULT_PROBES,
    EAGER,
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
    """A server of `model` (not started) with the environment every e2e server shares, then `env` over it."""
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
def lora_adapter(base_model: Path, e2e_dir: Path) -> Path:
    return build_tiny_lora(e2e_dir / "tiny-lora", base_model)


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


# ---- the servers: one table, one factory ------------------------------------------------------------------------

Derived = Callable[[pytest.FixtureRequest], Any]


@dataclass(frozen=True)
class ServerSpec:
    """One server configuration: the model fixture it serves, its log name, environment over `_server`'s and
    arguments. `env` and `args` may be functions of the fixture request (for paths other fixtures build).
    Session scope for servers several modules use, module scope for the others (memory)."""

    doc: str
    model: str
    log_name: str
    env: dict[str, str | None] | Derived
    args: tuple[str, ...] | Derived = ()
    scope: str = "module"


def _lora_args(request: pytest.FixtureRequest) -> tuple[str, ...]:
    adapter = request.getfixturevalue("lora_adapter")
    return ("--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"{LORA_NAME}={adapter}")


def _drafter_args(request: pytest.FixtureRequest) -> tuple[str, ...]:
    return ("--speculative-config", json.dumps(draft_model_spec(request.getfixturevalue("flashhead_model"))))


def _other_plugin_env(request: pytest.FixtureRequest) -> dict[str, str | None]:
    path = request.getfixturevalue("other_plugin_path")
    pythonpath = os.pathsep.join(filter(None, [str(path), os.environ.get("PYTHONPATH")]))
    return {"VLLM_PLUGINS": f"other_logits,{BOTH_HALVES}", "MY_PKG_ADMIN_TOKEN": ADMIN_TOKEN, "PYTHONPATH": pythonpath}


_ADMIN = {"VLLM_PLUGINS": BOTH_HALVES, "MY_PKG_ADMIN_TOKEN": ADMIN_TOKEN}
_ADMIN_TIMED = {**_ADMIN, "MY_PKG_RPC_TIMEOUT": RPC_TIMEOUT}

SERVERS: dict[str, ServerSpec] = {
    "flashhead_server": ServerSpec(
        "Both halves allowlisted, `--api-key` and a read token (read role), an admin token; FlashHead model in "
        "float32.",
        "flashhead_model",
        "flashhead",
        {**_ADMIN_TIMED, "MY_PKG_READ_TOKEN": READ_TOKEN},
        ("--api-key", API_KEY),
        scope="session",
    ),
    "plain_vllm_server": ServerSpec(
        "The same weights, standard architecture, nothing allowlisted: vLLM as shipped.",
        "base_model",
        "plain",
        {"VLLM_PLUGINS": ""},
        scope="session",
    ),
    "endpoint_only_server": ServerSpec(
        "Endpoint half allowlisted, engine half not.",
        "base_model",
        "endpoint-only",
        {"VLLM_PLUGINS": "my_pkg_admin"},
        EAGER,
        scope="session",
    ),
    "tp2_server": ServerSpec(
        "Tensor parallel 2 on CPU (two worker processes), both halves, token via MY_PKG_ADMIN_TOKEN.",
        "flashhead_model",
        "tp2",
        {
            "VLLM_PLUGINS": BOTH_HALVES,
            "VLLM_CPU_OMP_THREADS_BIND": "0|1",
            "MY_PKG_ADMIN_TOKEN": "tp2-token",
            "MY_PKG_RPC_TIMEOUT": RPC_TIMEOUT,
        },
        ("--tensor-parallel-size", "2"),
        scope="session",
    ),
    "lora_plain_server": ServerSpec(
        "`--enable-lora` with the adapter served as LORA_NAME, both halves loaded; the base model.",
        "base_model",
        "lora-plain",
        _ADMIN,
        _lora_args,
    ),
    "lora_flashhead_server": ServerSpec(
        "The same with the FlashHead model: same weights as the plain one, plus FlashHead assets.",
        "flashhead_model",
        "lora-flashhead",
        _ADMIN,
        _lora_args,
    ),
    "ngram_server": ServerSpec(
        "The FlashHead model with n-gram speculative decoding (`NGRAM_SPEC`), both halves.",
        "flashhead_model",
        "ngram",
        _ADMIN_TIMED,
        ("--speculative-config", json.dumps(NGRAM_SPEC)),
    ),
    "flashhead_drafter_server": ServerSpec(
        "The FlashHead model drafting for itself (`draft_model_spec`): the drafter's head is FlashHead too.",
        "flashhead_model",
        "draft-flashhead",
        _ADMIN_TIMED,
        _drafter_args,
    ),
    "features_server": ServerSpec(
        "FlashHead with prefix caching and a small chunked-prefill budget; killed by its last test.",
        "flashhead_model",
        "features",
        _ADMIN_TIMED,
        (
            "--enable-prefix-caching",
            "--enable-chunked-prefill",
            "--max-num-batched-tokens",
            "32",
            "--max-num-seqs",
            "8",
        ),
    ),
    "pooling_server": ServerSpec(
        "The model served as an embedding model, with both halves loaded.",
        "base_model",
        "pooling",
        _ADMIN,
        ("--runner", "pooling", "--convert", "embed", *EAGER),
    ),
    "other_plugin_server": ServerSpec(
        "The FlashHead model with both halves and another plugin that owns LogitsProcessor.",
        "flashhead_model",
        "other-plugin",
        _other_plugin_env,
    ),
    "dp2_server": ServerSpec(
        "Data parallel 2 on CPU: two engine cores (one worker each) behind one API server.",
        "flashhead_model",
        "dp2",
        {"VLLM_PLUGINS": BOTH_HALVES, "VLLM_CPU_OMP_THREADS_BIND": "0|1", "MY_PKG_ADMIN_TOKEN": ADMIN_TOKEN},
        ("--data-parallel-size", "2", *EAGER),
    ),
}


def _server_fixture(name: str, spec: ServerSpec) -> Callable[..., Iterator[VllmServer]]:
    def serve(request: pytest.FixtureRequest, logs_dir: Path) -> Iterator[VllmServer]:
        env = spec.env(request) if callable(spec.env) else spec.env
        args = spec.args(request) if callable(spec.args) else spec.args
        with _server(request.getfixturevalue(spec.model), logs_dir, spec.log_name, env, list(args)) as server:
            yield server

    serve.__doc__ = spec.doc
    return pytest.fixture(scope=spec.scope, name=name)(serve)


for _name, _spec in SERVERS.items():
    globals()[_name] = _server_fixture(_name, _spec)
