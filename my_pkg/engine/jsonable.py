"""Turn vLLM config objects into plain JSON-safe data."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import numbers
from typing import Any

_SECRET_WORDS = ("api_key", "apikey", "secret", "password")
REDACTED = "<redacted>"


def _is_secret(name: str) -> bool:
    """`hf_token`, `api_key`, `client_secret`...; not `max_num_batched_tokens` or `tokenizer`."""
    lowered = name.lower()
    return lowered.endswith("token") or any(word in lowered for word in _SECRET_WORDS)


def plain(value: Any) -> Any:
    """`value` as exactly dict/list/str/int/float/bool/None: safe for any RPC transport."""
    return json.loads(json.dumps(to_jsonable(value), allow_nan=False))


def to_jsonable(value: Any, depth: int = 6) -> Any:
    """Convert `value` to dicts, lists, strings, numbers, booleans and None.

    Dataclasses, pydantic models and objects with `to_dict()` become dicts of
    their public fields; fields whose name suggests a secret are redacted;
    anything else unknown becomes its `str()`. Recursion stops at `depth`.
    """
    # Subclasses (e.g. torch's TorchVersion, IntEnum) become the plain type: vLLM's
    # msgpack encoder refuses anything else, and a refused RPC result breaks the engine.
    if value is None or type(value) in (bool, int, str):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, enum.Enum):
        return to_jsonable(value.value, depth) if isinstance(value.value, (str, int)) else value.name
    if isinstance(value, numbers.Integral):  # int subclasses, numpy integers
        return int(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, numbers.Real):
        return float(value) if math.isfinite(value) else str(value)
    if depth <= 0 or isinstance(value, type) or callable(value):
        return str(value)
    if isinstance(value, dict):
        return {
            str(k): (REDACTED if _is_secret(str(k)) and v else to_jsonable(v, depth - 1))
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=str) if isinstance(value, (set, frozenset)) else value
        return [to_jsonable(v, depth - 1) for v in items]
    if dataclasses.is_dataclass(value):
        return to_jsonable({f.name: getattr(value, f.name, None) for f in dataclasses.fields(value)
                            if not f.name.startswith("_")}, depth)
    for exporter in ("to_dict", "model_dump"):
        export = getattr(value, exporter, None)
        if callable(export):
            try:
                return to_jsonable(export(), depth - 1)
            except Exception:  # noqa: BLE001 - a broken exporter must not break introspection
                return str(value)
    public = getattr(value, "__dict__", None)
    if isinstance(public, dict):
        return to_jsonable({k: v for k, v in public.items() if not k.startswith("_")}, depth)
    return str(value)
