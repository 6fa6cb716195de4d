"""The audit as `GET /plugins/my_pkg/audit` answers it: the engines' entries merged per transaction, with this
API server's outcomes folded in.

The engines keep what they applied or rejected (`my_pkg.engine.admin_ledger`); an applied update is kept by
every engine that committed it, and is listed once (`kept_by`). This API server's own outcomes of a
transaction the engines kept (partial, failed, a 504 answered before it applied) are folded into that
entry; the others (`my_pkg.endpoints.audit.AuditLog`) are listed as they are.
"""

from __future__ import annotations

from typing import Any

from my_pkg.contract import AUDIT, AuditReply
from my_pkg.endpoints.client import WorkerClient, parse_replies


async def engine_audit(state: WorkerClient) -> list[dict[str, Any]]:
    """Every engine's entries: an applied update once per transaction (`kept_by`: the engines that committed
    it), rejections as each engine counted them; oldest first."""
    replies = parse_replies(AUDIT, AuditReply, await state.call_unbounded(AUDIT))
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for reply in replies:
        for position, entry in enumerate(reply.entries):
            record = entry.model_dump(mode="json", exclude_none=True)
            before = [{"dp_rank": reply.dp_rank, **b} for b in record.pop("before", [])]
            if record.get("result") == "applied" and record.get("transaction"):
                key: tuple[Any, ...] = ("applied", record["transaction"])
            else:
                key = ("engine", reply.dp_rank, reply.rank, position)
            kept = merged.setdefault(key, {**record, "kept_by": [], "before": []})
            kept["kept_by"].append(reply.dp_rank)
            kept["before"].extend(before)  # each engine's settings before it applied the update
    return sorted(merged.values(), key=lambda e: e["time"])


def merged_audit(engine_entries: list[dict[str, Any]], local: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The engines' entries with this API server's outcomes: an outcome of a transaction the engines kept
    (partial, failed) is folded into that entry, and so is a 504 its caller got before it applied
    (`answered_status_code`); the others are listed as they are. Oldest first."""
    by_txn = {e["transaction"]: e for e in engine_entries if e.get("result") == "applied" and e.get("transaction")}
    rest = []
    for entry in local:
        kept = by_txn.get(entry.get("transaction") or "")
        if kept is not None and entry.get("result") in ("partial", "failed"):
            outcome = ("result", "status_code", "committed_engines", "outcomes", "reason")
            kept.update({k: entry[k] for k in outcome if k in entry})
        elif kept is not None and entry.get("result") == "pending":
            kept["answered_status_code"] = entry["status_code"]
        else:
            rest.append(entry)
    return sorted([*engine_entries, *rest], key=lambda e: e["time"])
