"""Worker methods with real vLLM config objects on a stand-in worker."""

from __future__ import annotations

import json
import os
import re
from types import SimpleNamespace

import pytest
import torch

import my_pkg
from my_pkg import contract
from my_pkg.engine import rpc
from my_pkg.engine.jsonable import REDACTED, to_jsonable


@pytest.fixture
def worker():
    from vllm.config import CacheConfig, ParallelConfig, SchedulerConfig

    model_config = SimpleNamespace(
        model="org/model",
        served_model_name="served-name",
        dtype=torch.bfloat16,
        max_model_len=256,
        hf_token="hf_secret_value",
    )
    kv = [torch.zeros(2, 4, 8), torch.zeros(2, 4, 8)]
    return SimpleNamespace(
        rank=1,
        local_rank=1,
        device=torch.device("cpu"),
        model_config=model_config,
        cache_config=CacheConfig(block_size=16),
        parallel_config=ParallelConfig(tensor_parallel_size=1),
        scheduler_config=SchedulerConfig(max_model_len=256, is_encoder_decoder=False),
        model_runner=SimpleNamespace(kv_caches=kv),
    )


def test_ping_identifies_plugin_rank_and_process(worker):
    assert rpc.my_pkg_ping(worker) == {
        "plugin": "my_pkg",
        "version": my_pkg.__version__,
        "rank": 1,
        "dp_rank": 0,
        "pid": os.getpid(),
    }


def test_worker_info_is_json_safe_and_complete(worker):
    info = rpc.my_pkg_worker_info(worker)
    json.dumps(info)
    assert info["rank"] == 1 and info["local_rank"] == 1
    assert info["device"] == "cpu"
    assert info["torch_version"] == torch.__version__
    assert info["model"] == {"name": "served-name", "path": "org/model", "dtype": "bfloat16", "max_model_len": 256}
    assert info["kv_cache"]["block_size"] == 16
    assert "memory" not in info  # it changes while the worker runs: part of my_pkg_status


def test_status_has_the_memory_and_the_flashhead_state(worker):
    status = rpc.my_pkg_status(worker)
    assert status["rank"] == 1 and status["pid"] == os.getpid()
    assert status["memory"]["kv_cache_bytes"] == 2 * 2 * 4 * 8 * 4
    assert status["memory"]["process_rss_bytes"] > 0
    assert status["memory"]["device_allocated_bytes"] is None
    assert status["flashhead"]["available"] is False and status["flashhead"]["reason_code"] == "no_assets"


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
    assert to_jsonable(value) == {
        "a": "nan",
        "b": [1, 2],
        "c": 1,
        "api_key": REDACTED,
        "d": "torch.float16",
        "e": [1, [2]],
    }


@pytest.mark.parametrize("name", sorted(rpc.WORKER_METHODS))
def test_every_result_survives_vllms_rpc_encoder(worker, name):
    """vLLM's engine core encodes RPC results with msgpack and refuses e.g. str subclasses;
    a refused result kills its output thread, so every result must be plain data."""
    from vllm.v1.serial_utils import MsgpackEncoder

    method = rpc.WORKER_METHODS[name]
    txn = {"id": "t", "holder": "h", "lease_s": 5}
    args = {
        "my_pkg_config": ("model",),
        "my_pkg_flashhead_validate": ({"n_probes": 2},),
        "my_pkg_flashhead_apply": ({"n_probes": 2},),
        "my_pkg_flashhead_prepare": ({"n_probes": 2}, txn),
        "my_pkg_flashhead_commit": ({"n_probes": 2}, txn),
        "my_pkg_flashhead_abort": (txn,),
    }.get(name, ())
    try:
        result = method(worker, *args)
    except RuntimeError:
        assert name in ("my_pkg_flashhead_apply", "my_pkg_flashhead_commit")  # no FlashHead on this worker
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


# ---- the contract: both halves use the same models --------------------------------------------------

#: Arguments to call each worker method with (the contract gives its reply model).
ARGUMENTS = {
    contract.PING: (),
    contract.WORKER_INFO: (),
    contract.CONFIG: ("cache",),
    contract.STATUS: (),
    contract.FLASHHEAD_STATUS: (),
    contract.FLASHHEAD_VALIDATE: ({"n_probes": 2},),
    contract.FLASHHEAD_APPLY: ({"n_probes": 2},),
    contract.FLASHHEAD_PREPARE: ({"n_probes": 2}, {"id": "t", "holder": "h", "lease_s": 5}),
    contract.FLASHHEAD_ABORT: ({"id": "t", "holder": "h", "lease_s": 5},),
    contract.FLASHHEAD_COMMIT: ({"n_probes": 2}, {"id": "t", "holder": "h", "lease_s": 5, "new_version": 1}),
    contract.AUDIT: (),
}
REPLY_MODELS = {name: (model, ARGUMENTS[name]) for name, model in contract.WORKER_METHOD_REPLIES.items()}


def test_the_worker_methods_are_the_contracts():
    assert set(rpc.WORKER_METHODS) == set(contract.WORKER_METHOD_NAMES) == set(ARGUMENTS)
    assert all(name.startswith(contract.RPC_PREFIX) for name in contract.WORKER_METHOD_NAMES)


@pytest.mark.parametrize("name", sorted(contract.WORKER_METHODS_CONTRACT))
def test_every_worker_method_takes_the_arguments_the_contract_declares(name):
    import inspect

    worker, *arguments = inspect.signature(inspect.unwrap(rpc.WORKER_METHODS[name])).parameters.values()
    assert worker.name == "self"
    assert tuple(p.name for p in arguments) == contract.WORKER_METHODS_CONTRACT[name].arguments
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in arguments)  # collective_rpc passes args
    assert len(ARGUMENTS[name]) <= len(arguments)


def test_the_endpoint_half_refuses_a_call_the_contract_does_not_declare():
    import asyncio

    from my_pkg.endpoints.client import WorkerClient

    client = WorkerClient(engine_client=None, rpc_timeout=1.0)
    with pytest.raises(ValueError, match="my_pkg_ping with 1 argument"):
        asyncio.run(client.call_unbounded(contract.PING, "extra"))
    with pytest.raises(ValueError, match="not in the contract"):
        asyncio.run(client.call_unbounded("my_pkg_undeclared"))


def test_the_endpoint_half_refuses_another_reply_model_than_the_contracts():
    from my_pkg.endpoints.client import parse_replies

    reply = {"rank": 0, "plugin": "my_pkg", "version": "1", "pid": 1}
    assert parse_replies(contract.PING, contract.PingReply, [reply])[0].rank == 0
    with pytest.raises(TypeError, match="my_pkg_ping replies with"):
        parse_replies(contract.PING, contract.AuditReply, [reply])


def test_the_update_fields_are_the_controllers():
    from dataclasses import fields

    from my_pkg.flashhead.settings import FlashHeadSettings

    assert set(contract.UPDATE_FIELDS) == set(contract.FlashHeadUpdate.model_fields)
    # `draft_n_probes` is the drafter's controller's `n_probes` (`FlashHeadController.apply`).
    assert set(contract.UPDATE_FIELDS) - {"draft_n_probes"} <= {f.name for f in fields(FlashHeadSettings)}


@pytest.fixture
def flashhead_worker(worker, monkeypatch):
    """The stand-in worker with a real FlashHead controller (32 clusters of 16 tokens) on its model."""
    from my_pkg.engine.flashhead import FlashHeadController

    for name in ("MY_PKG_FLASHHEAD", "MY_PKG_FLASHHEAD_N_PROBES", "MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD"):
        monkeypatch.delenv(name, raising=False)
    torch.manual_seed(0)
    weight = torch.randn(512, 32)
    assignments = torch.arange(512) % 32
    centroids = torch.stack([weight[assignments == c].mean(0) for c in range(32)])
    controller = FlashHeadController(
        centroids=centroids, assignments=assignments, config={"n_probes": 4}, vocab_size=512, pinned_ids=[2]
    )
    controller.bind(weight)
    monkeypatch.setattr(rpc, "_controller", lambda w: controller if w is worker else None)
    return worker


@pytest.mark.parametrize("method", sorted(REPLY_MODELS))
def test_every_reply_is_its_contract_model_with_nothing_undeclared(flashhead_worker, method):
    """Every key a worker sends is declared by the contract: a key the controller adds shows up here first."""
    model, args = REPLY_MODELS[method]
    if method == contract.FLASHHEAD_COMMIT:  # a commit needs the lease its prepare takes
        rpc.my_pkg_flashhead_prepare(flashhead_worker, {"n_probes": 2}, {"id": "t", "holder": "h", "lease_s": 5})
    reply = model.model_validate(rpc.WORKER_METHODS[method](flashhead_worker, *args))

    def undeclared(value):
        found = dict(value.model_extra or {})
        for name in type(value).model_fields:
            child = getattr(value, name)
            if isinstance(child, contract.WorkerReply):
                found.update({f"{name}.{k}": v for k, v in undeclared(child).items()})
        return found

    assert undeclared(reply) == {}


def test_a_real_controllers_status_through_the_contract(flashhead_worker):
    state = contract.WorkerStatus.model_validate(rpc.my_pkg_status(flashhead_worker)).flashhead
    assert state.available and state.active and state.num_clusters == 32 and state.n_probes == 4
    assert state.pinned_token_ids == [2] and state.counters.steps == 0
    flat = contract.FlashHeadStatus.model_validate(rpc.my_pkg_flashhead_status(flashhead_worker))
    assert flat.model_dump(exclude={"rank", "dp_rank", "pid"}) == state.model_dump()


@pytest.mark.parametrize(
    ("update", "expected"),
    [
        ({"n_probes": "4"}, "n_probes: Input should be a valid integer"),
        ({"n_probes": 0}, "n_probes: Input should be greater than or equal to 1"),
        ({"enabled": 1}, "enabled: Input should be a valid boolean"),
        ({"n_probes": 2, "bogus": 1}, "bogus: Extra inputs are not permitted"),
        ({}, "at least one of"),
        ({"enabled": None}, "'enabled' must not be null"),
        ({"n_probes": 33}, "32"),  # the controller's own check: no more than its 32 clusters
    ],
)
def test_a_worker_validates_an_update_with_the_contract_then_its_model(flashhead_worker, update, expected):
    errors = rpc.my_pkg_flashhead_validate(flashhead_worker, update)["errors"]
    assert len(errors) == 1 and expected in errors[0], errors
    with pytest.raises(ValueError, match=re.escape(expected)):
        rpc.my_pkg_flashhead_apply(flashhead_worker, update)
    assert rpc.my_pkg_flashhead_status(flashhead_worker)["n_probes"] == 4  # nothing applied


def test_an_update_is_applied_as_the_contract_reads_it(flashhead_worker):
    rpc.my_pkg_flashhead_apply(flashhead_worker, {"dense_batch_threshold": 3})
    update = {"n_probes": 8.0, "dense_batch_threshold": None}  # JSON's integral float; null: never switch
    assert rpc.my_pkg_flashhead_validate(flashhead_worker, update)["errors"] == []
    status = rpc.my_pkg_flashhead_apply(flashhead_worker, update)
    assert status["n_probes"] == 8 and status["enabled"] is True  # a field left out is left as it was
    assert status["dense_batch_threshold"] is None


# ---- versioned updates: lease, compare-and-set, audit ----------------------------------------------


def _txn(id_="t1", holder="host:1/api0", lease_s=30.0, **extra):
    return {"id": id_, "holder": holder, "lease_s": lease_s, **extra}


def test_prepare_takes_the_lease_and_a_second_transaction_finds_it_busy(flashhead_worker):
    first = rpc.my_pkg_flashhead_prepare(flashhead_worker, {"n_probes": 5}, _txn("a", "server-a"))
    assert first["granted"] and first["version"] == 0 and first["before"]["n_probes"] == 4
    second = rpc.my_pkg_flashhead_prepare(flashhead_worker, {"n_probes": 6}, _txn("b", "server-b"))
    assert not second["granted"] and second["conflict"] == "busy" and second["holder"] == "server-a"
    done = rpc.my_pkg_flashhead_commit(
        flashhead_worker, {"n_probes": 5}, _txn("a", new_version=1), {"request_id": "r1", "role": "admin"}
    )
    assert done["settings_version"] == 1 and done["n_probes"] == 5
    assert rpc.my_pkg_flashhead_prepare(flashhead_worker, {"n_probes": 6}, _txn("b"))["granted"]


def test_compare_and_set_on_the_version(flashhead_worker):
    stale = rpc.my_pkg_flashhead_prepare(flashhead_worker, {"n_probes": 5}, _txn(expected_version=3))
    assert not stale["granted"] and stale["conflict"] == "version" and stale["version"] == 0


def test_an_invalid_update_takes_no_lease(flashhead_worker):
    refused = rpc.my_pkg_flashhead_prepare(flashhead_worker, {"n_probes": 33}, _txn("a"))
    assert not refused["granted"] and "32" in refused["errors"][0]
    assert rpc.my_pkg_flashhead_prepare(flashhead_worker, {"n_probes": 5}, _txn("b"))["granted"]


def test_a_lapsed_lease_is_taken_over_and_its_late_commit_refused(flashhead_worker):
    import time

    assert rpc.my_pkg_flashhead_prepare(flashhead_worker, {"n_probes": 5}, _txn("crashed", lease_s=0.001))["granted"]
    time.sleep(0.01)
    assert rpc.my_pkg_flashhead_prepare(flashhead_worker, {"n_probes": 6}, _txn("next"))["granted"]
    with pytest.raises(RuntimeError, match="lapsed"):
        rpc.my_pkg_flashhead_commit(flashhead_worker, {"n_probes": 5}, _txn("crashed", new_version=1))
    assert rpc.my_pkg_flashhead_status(flashhead_worker)["n_probes"] == 4


def test_a_late_commit_after_the_taker_committed_and_released_is_refused(flashhead_worker):
    """Review 2 #1 (r2): the lease is gone (taken, committed, released), so the old transaction's commit must not
    apply on top of the newer version."""
    import time

    assert rpc.my_pkg_flashhead_prepare(flashhead_worker, {"n_probes": 8}, _txn("a", lease_s=0.001))["granted"]
    time.sleep(0.01)
    assert rpc.my_pkg_flashhead_prepare(flashhead_worker, {"n_probes": 5}, _txn("b"))["granted"]
    assert rpc.my_pkg_flashhead_commit(flashhead_worker, {"n_probes": 5}, _txn("b", new_version=1))["n_probes"] == 5
    with pytest.raises(RuntimeError, match="does not hold this worker's lease"):
        rpc.my_pkg_flashhead_commit(flashhead_worker, {"n_probes": 8}, _txn("a", new_version=1))
    with pytest.raises(RuntimeError, match="does not hold this worker's lease"):
        rpc.my_pkg_flashhead_commit(flashhead_worker, {"n_probes": 8}, _txn("a", new_version=2))
    status = contract.WorkerStatus.model_validate(rpc.my_pkg_status(flashhead_worker))
    assert status.settings_version == 1 and status.flashhead.n_probes == 5


def test_a_commit_without_a_prepare_or_after_an_abort_is_refused(flashhead_worker):
    with pytest.raises(RuntimeError, match="does not hold"):
        rpc.my_pkg_flashhead_commit(flashhead_worker, {"n_probes": 1}, _txn("never", new_version=1))
    rpc.my_pkg_flashhead_prepare(flashhead_worker, {"n_probes": 6}, _txn("a"))
    assert rpc.my_pkg_flashhead_abort(flashhead_worker, _txn("a"))["released"]
    with pytest.raises(RuntimeError, match="does not hold"):
        rpc.my_pkg_flashhead_commit(flashhead_worker, {"n_probes": 6}, _txn("a", new_version=1))
    assert rpc.my_pkg_flashhead_status(flashhead_worker)["n_probes"] == 4


def test_a_commit_refuses_a_version_that_does_not_increase_or_moved_since_the_prepare(flashhead_worker):
    rpc.my_pkg_flashhead_prepare(flashhead_worker, {"n_probes": 6}, _txn("a"))
    rpc.my_pkg_flashhead_commit(flashhead_worker, {"n_probes": 6}, _txn("a", new_version=3))
    rpc.my_pkg_flashhead_prepare(flashhead_worker, {"n_probes": 7}, _txn("b"))
    for version in (None, 2, 3):
        with pytest.raises(RuntimeError, match="not above"):
            rpc.my_pkg_flashhead_commit(flashhead_worker, {"n_probes": 7}, _txn("b", new_version=version))
    # A lapsed lease nobody took is still the transaction's, but not once the version moved under it.
    from my_pkg.engine.admin_ledger import ledger_of

    ledger_of(flashhead_worker).version = 4  # e.g. an in-process `my_pkg_flashhead_apply` in between
    with pytest.raises(RuntimeError, match="moved from 3 to 4"):
        rpc.my_pkg_flashhead_commit(flashhead_worker, {"n_probes": 7}, _txn("b", new_version=5))
    assert rpc.my_pkg_flashhead_status(flashhead_worker)["n_probes"] == 6


def test_a_repeated_commit_answers_the_same_and_applies_nothing_twice(flashhead_worker):
    rpc.my_pkg_flashhead_prepare(flashhead_worker, {"n_probes": 6}, _txn("a"))
    first = rpc.my_pkg_flashhead_commit(flashhead_worker, {"n_probes": 6}, _txn("a", new_version=1))
    again = rpc.my_pkg_flashhead_commit(flashhead_worker, {"n_probes": 6}, _txn("a", new_version=1))
    assert again == first and again["settings_version"] == 1


@pytest.mark.parametrize(
    ("txn", "expected"),
    [
        (_txn(lease_s=1e12), "lease_s"),  # r7: a lease until the restart
        (_txn(lease_s=0), "lease_s"),
        (_txn(new_version=10**15), "new_version"),  # beyond what If-Match accepts
        (_txn(new_version=-1), "new_version"),
        (_txn(id_="x" * 65), "id"),
        (_txn(id_="a b"), "id"),
        ({**_txn(), "extra": 1}, "extra"),
        ("not a dict", "invalid transaction"),
    ],
)
def test_worker_methods_check_the_transaction_against_the_contract(flashhead_worker, txn, expected):
    """Review 2 #8 (r7): whatever reaches `collective_rpc` (vLLM's dev-mode route included) is checked."""
    for call in (
        lambda: rpc.my_pkg_flashhead_prepare(flashhead_worker, {"n_probes": 5}, txn),
        lambda: rpc.my_pkg_flashhead_commit(flashhead_worker, {"n_probes": 5}, txn),
        lambda: rpc.my_pkg_flashhead_abort(flashhead_worker, txn),
    ):
        with pytest.raises(ValueError, match=expected):
            call()
    from my_pkg.engine.admin_ledger import ledger_of

    assert ledger_of(flashhead_worker).lease is None


@pytest.mark.parametrize(
    "entry",
    [
        {"result": "applied", "settings_version": 10**15},  # the worker writes these itself
        {"time": "2026-01-01T00:00:00Z"},
        {"role": "x" * 201},
        {"update": {"n_probes": 0}},
    ],
)
def test_an_audit_entry_must_be_the_contracts_and_is_stamped_by_the_worker(flashhead_worker, entry):
    flashhead_worker.rank = 0
    rpc.my_pkg_flashhead_prepare(flashhead_worker, {"n_probes": 5}, _txn("a"))
    with pytest.raises(ValueError, match="invalid audit entry"):
        rpc.my_pkg_flashhead_commit(flashhead_worker, {"n_probes": 5}, _txn("a", new_version=1), entry)
    assert (
        rpc.my_pkg_flashhead_status(flashhead_worker)["n_probes"] == 4
        and rpc.my_pkg_audit(flashhead_worker)["entries"] == []
    )


def test_commit_and_abort_keep_the_audit_on_rank_0_only(flashhead_worker):
    flashhead_worker.rank = 0
    rpc.my_pkg_flashhead_prepare(flashhead_worker, {"n_probes": 5}, _txn("a"))
    entry = {"request_id": "r1", "token_source": "MY_PKG_ADMIN_TOKEN", "update": {"n_probes": 5}}
    rpc.my_pkg_flashhead_commit(flashhead_worker, {"n_probes": 5}, _txn("a", new_version=1), entry)
    rpc.my_pkg_flashhead_abort(flashhead_worker, _txn("b"), {**entry, "status_code": 409, "error_type": "invalid"})
    entries = rpc.my_pkg_audit(flashhead_worker)["entries"]
    assert [(e["result"], e["settings_version"], e["transaction"]) for e in entries] == [
        ("applied", 1, "a"),
        ("rejected", 1, "b"),
    ]
    assert entries[0]["token_source"] == "MY_PKG_ADMIN_TOKEN"  # the plugin's own fields are not redacted
    assert entries[0]["settings"] == {"n_probes": 5} and entries[0]["status_code"] == 200
    flashhead_worker.rank = 1
    assert rpc.my_pkg_audit(flashhead_worker)["entries"] == []


def test_rejections_are_collapsed_per_caller_and_reason_and_never_evict_applied_updates(flashhead_worker, monkeypatch):
    """Review 2 #6 (r4 b): a flood of rejections costs one counted entry; the applied history stays."""
    monkeypatch.setenv("MY_PKG_AUDIT_SIZE", "4")
    flashhead_worker.rank = 0
    rpc.my_pkg_flashhead_prepare(flashhead_worker, {"n_probes": 5}, _txn("a"))
    rpc.my_pkg_flashhead_commit(flashhead_worker, {"n_probes": 5}, _txn("a", new_version=1), {"role": "admin"})
    rejection = {"api_server": "h:1/api0", "token_fingerprint": "f1", "status_code": 409, "error_type": "invalid"}
    for n in range(50):
        rpc.my_pkg_flashhead_abort(flashhead_worker, _txn(f"r{n}"), {**rejection, "reason": f"attempt {n}"})
    rpc.my_pkg_flashhead_abort(flashhead_worker, _txn("other"), {**rejection, "error_type": "busy"})
    entries = rpc.my_pkg_audit(flashhead_worker)["entries"]
    assert [(e["result"], e["count"]) for e in entries] == [("applied", 1), ("rejected", 50), ("rejected", 1)]
    assert entries[1]["reason"] == "attempt 49" and entries[1]["first_time"] <= entries[1]["time"]


def test_status_carries_the_settings_version(flashhead_worker):
    rpc.my_pkg_flashhead_apply(flashhead_worker, {"n_probes": 5})
    assert rpc.my_pkg_status(flashhead_worker)["settings_version"] == 1


# ---- redaction by allowlist ----------------------------------------------------------------------


def test_parallel_config_hides_addresses_ports_and_ray_env_values(worker):
    from vllm.config import ParallelConfig

    worker.parallel_config = ParallelConfig(tensor_parallel_size=1)
    worker.parallel_config.ray_runtime_env = {
        "env_vars": {"DATABASE_URL": "postgres://u:pw@db/x", "HF_TOKEN": "hf_x"},
        "pip": ["pkg"],
    }
    config = rpc.my_pkg_config(worker, "parallel")["config"]
    text = json.dumps(config)
    assert "pw@" not in text and "hf_x" not in text and "postgres" not in text
    assert config["ray_runtime_env"]["env_vars"] == {"DATABASE_URL": REDACTED, "HF_TOKEN": REDACTED}
    assert config["master_addr"] == REDACTED and config["master_port"] == REDACTED
    assert config["data_parallel_master_ip"] == REDACTED and config["tensor_parallel_size"] == 1


@pytest.mark.parametrize("key", ["private_key", "Authorization", "GITHUB_PAT", "client_secret", "db_password"])
def test_secret_names_are_redacted_at_any_depth(key):
    from my_pkg.engine.jsonable import redacted_section

    config = {"hf_overrides": {"nested": {key: "LEAKED"}}, "max_num_seqs": 8}
    assert "LEAKED" not in json.dumps(redacted_section(config, "model"))


def test_urls_lose_their_user_info_and_the_depth_cut_is_truncated():
    from my_pkg.engine.jsonable import TRUNCATED, redacted_section

    deep = {"a": {"b": {"c": {"d": {"e": {"f": {"g": {"api_key": "LEAKED"}}}}}}}}
    out = redacted_section({"hf_overrides": deep, "model": "https://user:pw@hub.example/m"}, "model")
    text = json.dumps(out)
    assert "LEAKED" not in text and TRUNCATED in text and "pw@" not in text
    assert out["model"] == f"https://{REDACTED}@hub.example/m"


def test_fields_off_the_allowlist_are_redacted_numbers_pass():
    from my_pkg.engine.jsonable import redacted_section

    out = redacted_section({"allowed_local_media_path": "/data", "new_text_field": "x", "max_model_len": 256}, "model")
    assert out == {"allowed_local_media_path": REDACTED, "new_text_field": REDACTED, "max_model_len": 256}
