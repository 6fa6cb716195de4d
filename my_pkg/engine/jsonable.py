"""Turn vLLM config objects into plain JSON-safe data, showing only what a reader of the admin API may see.

A config section leaves the worker through :func:`redacted_section`, which is an allowlist: a section's
top-level fields that hold text or structures are shown only when listed in `SHOWN` (anything else,
including fields a later vLLM adds, becomes `"<redacted>"`); numbers, booleans and None are shown unless
listed in `HIDDEN` (ports). Inside what is shown, at any depth:

* keys that name a secret (`*token`, `*key`, secret, password, authorization, credential, cookie, ...)
  are redacted;
* every value of a Ray runtime env's `env_vars` is redacted (vLLM masks them in its own logs);
* the user and password of a URL (`scheme://user:pw@host`) are redacted;
* what lies deeper than the depth cut becomes `"<truncated>"`, never its `str()`.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import numbers
import re
from typing import Any

REDACTED = "<redacted>"
TRUNCATED = "<truncated>"

_SECRET_KEY = re.compile(
    r"(token|api_?key|apikey|secret|passw|authorization|credential|cookie|private|_pat$|^pat$|signature|session)",
    re.IGNORECASE,
)
#: Counting words that end like a secret but are not one (`max_num_batched_tokens`, `tokenizer`).
_NOT_SECRET = re.compile(r"(tokens$|tokenizer|token_ids|token_threshold|_tokens_)", re.IGNORECASE)
_URL_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")
_ENV_VARS_KEYS = ("env_vars",)

#: Per section: the top-level fields shown although they hold text or structures.
SHOWN: dict[str, frozenset[str]] = {
    "scheduler": frozenset({"runner_type", "policy", "scheduler_cls"}),
    "cache": frozenset(
        {
            "kv_cache_layout",
            "cache_dtype",
            "prefix_caching_hash_algo",
            "kv_cache_dtype_skip_layers",
            "mamba_cache_dtype",
            "mamba_ssm_cache_dtype",
            "mamba_cache_mode",
            "kv_offloading_backend",
        }
    ),
    "parallel": frozenset(
        {
            "data_parallel_backend",
            "expert_placement_strategy",
            "all2all_backend",
            "distributed_executor_backend",
            "worker_cls",
            "worker_extension_cls",
            "dcp_comm_backend",
            "eplb_config",
            "fault_tolerance_config",
            "ray_runtime_env",
        }
    ),
    "model": frozenset(
        {
            "model",
            "model_weights",
            "runner",
            "convert",
            "tokenizer",
            "tokenizer_mode",
            "dtype",
            "hf_config_path",
            "revision",
            "code_revision",
            "tokenizer_revision",
            "quantization",
            "quantization_config",
            "logprobs_mode",
            "served_model_name",
            "config_format",
            "generation_config",
            "override_generation_config",
            "model_impl",
            "logits_processors",
            "hf_config",
            "hf_text_config",
            "hf_overrides",
            "model_class_overrides",
            "pooler_config",
            "multimodal_config",
            "io_processor_plugin",
        }
    ),
}
#: Per section: top-level numbers hidden too (where the engines listen).
HIDDEN: dict[str, frozenset[str]] = {
    "parallel": frozenset({"master_port", "data_parallel_master_port", "data_parallel_rpc_port"}),
}


def _is_secret(name: str) -> bool:
    """`hf_token`, `api_key`, `client_secret`, `Authorization`, `GITHUB_PAT`...; not `max_num_batched_tokens`."""
    return bool(_SECRET_KEY.search(name)) and not _NOT_SECRET.search(name)


def _scrub_text(text: str) -> str:
    return _URL_USERINFO.sub(REDACTED + "@", text) if "://" in text else text


def plain(value: Any) -> Any:
    """`value` as exactly dict/list/str/int/float/bool/None: safe for any RPC transport."""
    return json.loads(json.dumps(to_jsonable(value, redact=False), allow_nan=False))


def redacted_section(config: Any, section: str, depth: int = 6) -> Any:
    """One config section as the admin API shows it (see the module docstring)."""
    data = to_jsonable(config, depth)
    if not isinstance(data, dict):
        return data
    shown, hidden = SHOWN.get(section, frozenset()), HIDDEN.get(section, frozenset())
    out: dict[str, Any] = {}
    for key, value in data.items():
        scalar = value is None or isinstance(value, (bool, int, float))
        if key in hidden or _is_secret(key) and value not in (None, False, ""):
            out[key] = REDACTED
        elif scalar or key in shown:
            out[key] = value
        else:
            out[key] = REDACTED
    return out


def to_jsonable(value: Any, depth: int = 6, *, redact: bool = True) -> Any:
    """Convert `value` to dicts, lists, strings, numbers, booleans and None.

    Dataclasses, pydantic models and objects with `to_dict()` become dicts of
    their public fields; fields whose name suggests a secret are redacted, so are
    a Ray runtime env's `env_vars` values and URL user info; anything else unknown
    becomes its `str()`. Below `depth` levels: `"<truncated>"`. `redact=False` (replies the
    plugin built itself, e.g. an audit entry's `token_source`) converts without redacting.
    """
    # Subclasses (e.g. torch's TorchVersion, IntEnum) become the plain type: vLLM's
    # msgpack encoder refuses anything else, and a refused RPC result breaks the engine.
    if value is None or type(value) in (bool, int):
        return value
    if type(value) is str:
        return _scrub_text(value) if redact else value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, enum.Enum):
        return to_jsonable(value.value, depth, redact=redact) if isinstance(value.value, (str, int)) else value.name
    if isinstance(value, numbers.Integral):  # int subclasses, numpy integers
        return int(value)
    if isinstance(value, str):
        return _scrub_text(str(value))
    if isinstance(value, numbers.Real):
        return float(value) if math.isfinite(value) else str(value)
    if isinstance(value, type) or callable(value):
        return _scrub_text(str(value))
    if depth <= 0:
        return TRUNCATED
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            key = str(k)
            if redact and _is_secret(key) and v:
                out[key] = REDACTED
            elif redact and key in _ENV_VARS_KEYS and isinstance(v, dict):
                out[key] = {str(name): REDACTED for name in v}
            else:
                out[key] = to_jsonable(v, depth - 1, redact=redact)
        return out
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=str) if isinstance(value, (set, frozenset)) else value
        return [to_jsonable(v, depth - 1, redact=redact) for v in items]
    if dataclasses.is_dataclass(value):
        return to_jsonable(
            {f.name: getattr(value, f.name, None) for f in dataclasses.fields(value) if not f.name.startswith("_")},
            depth,
            redact=redact,
        )
    for exporter in ("to_dict", "model_dump"):
        export = getattr(value, exporter, None)
        if callable(export):
            try:
                return to_jsonable(export(), depth - 1, redact=redact)
            except Exception:  # noqa: BLE001 - a broken exporter must not break introspection
                return REDACTED
    public = getattr(value, "__dict__", None)
    if isinstance(public, dict):
        return to_jsonable({k: v for k, v in public.items() if not k.startswith("_")}, depth, redact=redact)
    return _scrub_text(str(value))
