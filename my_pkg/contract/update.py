"""The update: the body of `PUT /plugins/my_pkg/flashhead`, the settings it changes, a worker's verdict on it.

The update body comes from a client: `extra="forbid"` and strict types. `FlashHeadUpdate` is the one
place where its fields are validated: the API validates the body with it and each worker validates the
update it receives with it again before the model-dependent checks (FlashHead available, `n_probes` no
more than the number of clusters). `UPDATE_FIELDS` is derived from it.
"""

from __future__ import annotations

from typing import Annotated, Any, Final

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    model_validator,
)

from my_pkg.contract.replies import RankedReply
from my_pkg.contract.status import FlashHeadState


def _absent_not_null(schema: dict[str, Any]) -> None:
    """JSON schema of an optional update field: it may be left out, but `null` is not a value of it."""
    branches = [branch for branch in schema.pop("anyOf", []) if branch.get("type") != "null"]
    if len(branches) == 1:
        schema.update(branches[0])
    schema.pop("default", None)


def _integral(value: Any) -> Any:
    """A float with no fractional part is the integer it spells (JSON Schema's `integer` allows `8.0`)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


#: Upper bound of the integer fields: far above any served model's clusters or batch, and small enough that
#: every RPC transport carries it (an unbounded int overflows vLLM's msgpack encoder).
MAX_UPDATE_INT: Final = 2**31 - 1

ProbeCount = Annotated[StrictInt, Field(ge=1, le=MAX_UPDATE_INT), BeforeValidator(_integral)]
RowCount = Annotated[StrictInt, Field(ge=0, le=MAX_UPDATE_INT), BeforeValidator(_integral)]


class FlashHeadUpdate(BaseModel):
    """Body of `PUT /plugins/my_pkg/flashhead` and argument of the worker methods: at least one field.

    A field left out keeps its value. `null` is a value of `dense_batch_threshold` only (no per-step
    switch to the dense head); the other fields refuse it.
    """

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"minProperties": 1, "examples": [{"n_probes": 8}, {"enabled": False}]},
    )

    enabled: StrictBool | None = Field(
        default=None, description="Turn FlashHead on or off.", json_schema_extra=_absent_not_null
    )
    n_probes: ProbeCount | None = Field(
        default=None,
        description="Clusters probed per token (>= 1, at most the number of clusters).",
        json_schema_extra=_absent_not_null,
    )
    dense_batch_threshold: RowCount | None = Field(
        default=None,
        description="Decode steps with more rows than this use the dense head (>= 0); null: never (the default, "
        "so a request's text does not depend on the server's load).",
    )
    draft_n_probes: ProbeCount | None = Field(
        default=None,
        description="Clusters the drafter's FlashHead head probes per draft token under speculative decoding (>= 1, "
        "at most the draft model's clusters; refused unless FlashHead serves the drafter's head, `spec.draft`).",
        json_schema_extra=_absent_not_null,
    )

    @model_validator(mode="after")
    def _given_fields_valid(self) -> FlashHeadUpdate:
        nulls = [
            name
            for name in UPDATE_FIELDS
            if name not in NULLABLE_FIELDS and name in self.model_fields_set and getattr(self, name) is None
        ]
        if nulls:
            raise ValueError(f"{', '.join(repr(n) for n in nulls)} must not be null (leave the field out to keep it)")
        if not self.to_update():
            raise ValueError(f"at least one of {', '.join(repr(f) for f in UPDATE_FIELDS)} must be given")
        return self

    def to_update(self) -> dict[str, Any]:
        """The fields that were given, as the workers receive them."""
        return {name: getattr(self, name) for name in UPDATE_FIELDS if name in self.model_fields_set}


def update_errors(update: Any) -> list[str]:
    """Why `update` is not a valid `FlashHeadUpdate`, one message per problem; empty when it is."""
    try:
        FlashHeadUpdate.model_validate(update)
    except ValidationError as exc:
        return [
            f"{'.'.join(str(part) for part in error['loc']) or 'update'}: {error['msg']}"
            for error in exc.errors(include_url=False, include_input=False)
        ]
    return []


#: Fields of `FlashHeadUpdate`, in the order the API documents them.
UPDATE_FIELDS: Final = tuple(FlashHeadUpdate.model_fields)
#: Fields whose `null` is a value; the others may be left out but not sent as `null`.
NULLABLE_FIELDS: Final = tuple(
    name for name, field in FlashHeadUpdate.model_fields.items() if field.json_schema_extra is not _absent_not_null
)


class SettingsValues(BaseModel):
    """The settings an update can change, as one worker has them."""

    enabled: bool | None = None
    n_probes: int | None = None
    dense_batch_threshold: int | None = None
    draft_n_probes: int | None = None

    @classmethod
    def of_state(cls, state: FlashHeadState) -> SettingsValues:
        """The settings a worker's FlashHead status shows."""
        return cls(
            enabled=state.enabled,
            n_probes=state.n_probes,
            dense_batch_threshold=state.dense_batch_threshold,
            draft_n_probes=state.spec.draft_n_probes if state.spec is not None else None,
        )

    def whole(self, update: dict[str, Any] | None = None) -> dict[str, Any]:
        """These settings with `update` over them, as a whole update: every field a worker can take (`null`
        only for the `NULLABLE_FIELDS`, where it is a value)."""
        merged = {**self.model_dump(), **(update or {})}
        return {k: v for k, v in merged.items() if k in UPDATE_FIELDS and (v is not None or k in NULLABLE_FIELDS)}


class ValidationReply(RankedReply):
    errors: list[str] = Field(default_factory=list, description="Empty when the update can be applied.")
