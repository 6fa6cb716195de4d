"""Worker methods with real vLLM config objects on a stand-in worker."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

import my_pkg
from my_pkg.engine import rpc
from my_pkg.engine.jsonable import REDACTED, to_jsonable


@pytest.fixture
def worker():
    from vllm.config import CacheConfig, ParallelConfig, SchedulerConfig

    model_config = SimpleNamespace(
        model="org/model", served_model_name="served-name", dtype=torch.bfloat16,
        max_model_len=256, hf_token="hf_secret_value",
    )
    kv = [torch.zeros(2, 4, 8), torch.zeros(2, 4, 8)]
    return SimpleNamespace(
        rank=1, local_rank=1, device=torch.device("cpu"),
        model_config=model_config,
        cache_config=CacheConfig(block_size=16),
        parallel_config=ParallelConfig(tensor_parallel_size=1),
        scheduler_config=SchedulerConfig(max_model_len=256, is_encoder_decoder=False),
        model_runner=SimpleNamespace(kv_caches=kv),
    )


def test_ping_identifies_plugin_rank_and_process(worker):
    assert rpc.my_pkg_ping(worker) == {
        "plugin": "my_pkg", "version": my_pkg.__version__, "rank": 1, "pid": os.getpid(),
    }


def test_worker_info_is_json_safe_and_complete(worker):
    info = rpc.my_pkg_worker_info(worker)
    json.dumps(info)
    assert info["rank"] == 1 and info["local_rank"] == 1
    assert info["device"] == "cpu"
    assert info["torch_version"] == torch.__version__
    assert info["model"] == {"name": "served-name", "path": "org/model", "dtype": "bfloat16", "max_model_len": 256}
    assert info["memory"]["kv_cache_bytes"] == 2 * 2 * 4 * 8 * 4
    assert info["memory"]["process_rss_bytes"] > 0
    assert info["memory"]["device_allocated_bytes"] is None
    assert info["kv_cache"]["block_size"] == 16


@pytest.mark.parametrize("section", ["scheduler", "cache", "parallel", "model"])
def test_config_sections_are_json_safe(worker, section):
    result = rpc.my_pkg_config(worker, section)
    assert result["section"] == section and result["rank"] == 1
    json.dumps(result)
    assert isinstance(result["config"], dict) and result["config"]


def test_config_values_and_secret_redaction(worker):
    assert rpc.my_pkg_config(worker, "cache")["config"]["block_size"] == 16
    scheduler = rpc.my_pkg_config(worker, "scheduler")["config"]
    assert scheduler["max_num_seqs"] >= 1
    assert isinstance(scheduler["max_num_batched_tokens"], int)  # "tokens" is not a secret
    model = rpc.my_pkg_config(worker, "model")["config"]
    assert model["hf_token"] == REDACTED
    assert "hf_secret_value" not in json.dumps(model)


def test_unknown_section_is_refused(worker):
    with pytest.raises(ValueError, match="scheduler, model, cache, parallel"):
        rpc.my_pkg_config(worker, "lora")


def test_flashhead_status_without_flashhead_model(worker):
    status = rpc.my_pkg_flashhead_status(worker)
    assert status["available"] is False and status["active"] is False
    assert "flash_head_cache_dir" in status["reason"]
    assert rpc.my_pkg_flashhead_validate(worker, {"n_probes": 4})["errors"]
    with pytest.raises(RuntimeError):
        rpc.my_pkg_flashhead_apply(worker, {"n_probes": 4})


def test_to_jsonable_handles_odd_values():
    import enum

    class Color(enum.Enum):
        RED = 1

    value = {"a": float("nan"), "b": {1, 2}, "c": Color.RED, "api_key": "k", "d": torch.float16, "e": (1, [2])}
    assert to_jsonable(value) == {"a": "nan", "b": [1, 2], "c": 1, "api_key": REDACTED, "d": "torch.float16", "e": [1, [2]]}


@pytest.mark.parametrize("name", sorted(rpc.WORKER_METHODS))
def test_every_result_survives_vllms_rpc_encoder(worker, name):
    """vLLM's engine core encodes RPC results with msgpack and refuses e.g. str subclasses;
    a refused result kills its output thread, so every result must be plain data."""
    from vllm.v1.serial_utils import MsgpackEncoder

    method = rpc.WORKER_METHODS[name]
    args = {"my_pkg_config": ("model",), "my_pkg_flashhead_validate": ({"n_probes": 2},),
            "my_pkg_flashhead_apply": ({"n_probes": 2},)}.get(name, ())
    try:
        result = method(worker, *args)
    except RuntimeError:
        assert name == "my_pkg_flashhead_apply"  # no FlashHead on this worker
        return
    MsgpackEncoder().encode(result)

    def walk(value):
        assert type(value) in (dict, list, str, int, float, bool, type(None)), type(value)
        if isinstance(value, dict):
            for key, item in value.items():
                assert type(key) is str
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(result)


def test_plain_turns_subclasses_into_builtins():
    from my_pkg.engine.jsonable import plain

    result = plain({"v": torch.__version__, "n": np_int(), "f": float("inf")})
    assert type(result["v"]) is str and type(result["n"]) is int and result["f"] == "inf"


def np_int():
    import numpy as np

    return np.int64(3)
