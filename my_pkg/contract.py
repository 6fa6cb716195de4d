"""The contract between the two halves of my_pkg: worker methods, their replies, the update, the config sections.

The engine half (`my_pkg.engine.rpc`) builds every reply with the models below and sends
`model_dump(mode="json")`; the endpoint half (`my_pkg.endpoints`) validates every reply with the same
model, and the unit tests' fake engine builds its replies from them too, so the halves cannot drift.
This module imports pydantic only (no vLLM, no torch): both halves and the tests can import it anywhere.

Extra keys: replies keep keys the models do not declare (`extra="allow"`) and pass them through to the
admin API untyped, so that a newer worker's key neither makes the worker's method raise nor makes the
endpoint half answer 503. A declared field with the wrong type is refused on both sides. The FlashHead
controller (`my_pkg.engine.flashhead.controller`) builds its status as `FlashHeadState` itself, setting
every field (a test fails on a field left to its default).

The update body is the opposite: `extra="forbid"` and strict types, because it comes from a client.
`FlashHeadUpdate` is the one place where its fields are validated: the API validates the body with it
and each worker validates the update it receives with it again before the model-dependent checks
(FlashHead available, `n_probes` no more than the number of clusters).
"""

from __future__ import annotations

from enum import IntEnum
from typing import Annotated, Any, Final, Literal

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

# ---- worker methods: the names passed to `collective_rpc` -------------------------------------------
# Plain `str` constants: vLLM's msgpack encoder refuses `str` subclasses such as enum members.

#: Prefix of every worker method of the engine half.
RPC_PREFIX: Final = "my_pkg_"
#: `() -> PingReply`: the engine half is loaded; its version.
PING: Final = "my_pkg_ping"
#: `() -> WorkerIdentity`: what cannot change while the engine lives.
WORKER_INFO: Final = "my_pkg_worker_info"
#: `(section) -> WorkerConfig`, `section` in `CONFIG_SECTIONS`.
CONFIG: Final = "my_pkg_config"
#: `() -> WorkerStatus`: everything that changes while the engine runs (memory, FlashHead state and counters).
STATUS: Final = "my_pkg_status"
#: `() -> FlashHeadStatus`: the FlashHead part of `STATUS`, flat (also handy from `LLM.collective_rpc`).
FLASHHEAD_STATUS: Final = "my_pkg_flashhead_status"
#: `(update: dict) -> ValidationReply`: what `update` would break on this worker; changes nothing.
FLASHHEAD_VALIDATE: Final = "my_pkg_flashhead_validate"
#: `(update: dict) -> CommitReply`: validate and apply `update` on this worker alone, as one settings version
#: (for `LLM.collective_rpc`; refused while an API server's update holds the worker's lease).
FLASHHEAD_APPLY: Final = "my_pkg_flashhead_apply"
#: `(update: dict, txn: dict) -> PrepareReply`: phase 1 of an update: validate it and take the worker's lease
#: (`txn` is a `Transaction`); changes no setting.
FLASHHEAD_PREPARE: Final = "my_pkg_flashhead_prepare"
#: `(update: dict, txn: dict, entry: dict) -> CommitReply`: phase 2: apply the prepared update, set the version,
#: keep the audit `entry`, release the lease.
FLASHHEAD_COMMIT: Final = "my_pkg_flashhead_commit"
#: `(txn: dict, entry: dict | None) -> LeaseReply`: release the lease of `txn` without applying; keep `entry`.
FLASHHEAD_ABORT: Final = "my_pkg_flashhead_abort"
#: `() -> AuditReply`: the audit entries this worker keeps (rank 0 of each engine keeps them).
AUDIT: Final = "my_pkg_audit"

#: Sections of `GET /plugins/my_pkg/config/{section}`; each is the worker's `<section>_config`.
CONFIG_SECTIONS: Final = ("scheduler", "model", "cache", "parallel")


# ---- replies ---------------------------------------------------------------------------------------


class WorkerReply(BaseModel):
    """Base of every reply: undeclared keys are kept (see the module docstring)."""

    model_config = ConfigDict(extra="allow")


class RankedReply(WorkerReply):
    """The reply of one worker: its rank within its engine, and the engine's data-parallel rank."""

    rank: int = Field(description="Rank of the worker within its engine.")
    dp_rank: int = Field(
        default=0, description="Data-parallel rank of the worker's engine (set by the API server; 0 without DP)."
    )


class PingReply(RankedReply):
    plugin: str
    version: str
    pid: int


class MemoryInfo(WorkerReply):
    device_allocated_bytes: int | None = None
    device_reserved_bytes: int | None = None
    process_rss_bytes: int | None = None
    kv_cache_bytes: int | None = None


class ModelInfo(WorkerReply):
    name: str | None = None
    path: str | None = None
    dtype: str | None = None
    max_model_len: int | None = None


class KVCacheInfo(WorkerReply):
    block_size: int | None = None
    num_blocks: int | None = None


class WorkerIdentity(RankedReply):
    """Who and what a worker is; none of it changes while the engine lives."""

    local_rank: int | None = None
    world_size: int | None = None
    pid: int
    hostname: str | None = None
    device: str | None = None
    plugin_version: str | None = None
    torch_version: str | None = None
    vllm_version: str | None = None
    model: ModelInfo = Field(default_factory=ModelInfo)
    kv_cache: KVCacheInfo = Field(default_factory=KVCacheInfo)


class WorkerConfig(RankedReply):
    section: str
    config: dict[str, Any] | None = Field(description="The section as JSON data; null when the worker has none.")


# ---- FlashHead: why it is not active, and why a row is served dense -----------------------------------

#: `FlashHeadState.reason_code`: why FlashHead is not active on a worker (null when it is).
ReasonCode = Literal[
    "disabled",
    "not_built",
    "no_assets",
    "assets_invalid",
    "assets_mismatch",
    "build_failed",
    "quantized_head",
    "warm_up_failed",
    "tensor_parallel_rank",
    "pipeline_parallel",
    "speculative_decoding",
    "lora",
    "head_dtype",
    "runner_hook_failed",
    "logits_processor_taken",
]
#: One line per `ReasonCode`, in its order (docs/flashhead-serving.md's table is generated from it).
REASON_CODES: Final[dict[str, str]] = {
    "disabled": "turned off (`MY_PKG_FLASHHEAD=0` or `PUT enabled=false`)",
    "not_built": "the head is not built yet (it is built right after vLLM loads the weights)",
    "no_assets": "the model has no FlashHead assets (no `flash_head_cache_dir` in config.json)",
    "assets_invalid": "the assets could not be read",
    "assets_mismatch": "the assets do not match the model's vocabulary",
    "build_failed": "the head could not be built over the LM head vLLM loaded",
    "quantized_head": "the LM head is quantized",
    "warm_up_failed": "the head failed its warm-up step",
    "tensor_parallel_rank": "another tensor-parallel rank cannot serve FlashHead (agreed when the model loads)",
    "pipeline_parallel": "pipeline parallel size > 1",
    "speculative_decoding": "no longer reported: under speculative decoding, `spec` gives each part's own code",
    "lora": "LoRA is on (adapters change the logits)",
    "head_dtype": "`head_dtype` differs from the model's dtype",
    "runner_hook_failed": "vLLM's model runner could not be hooked (a vLLM internal moved)",
    "logits_processor_taken": "another plugin replaced vLLM's `LogitsProcessor` first",
}


#: `SpecPart.reason_code`: why FlashHead does not serve one part of speculative decoding (null when it does).
SpecReasonCode = Literal[
    "flashhead_inactive",
    "model_runner_v2",
    "spec_hook_failed",
    "no_draft_head",
    "draft_head_not_supported",
    "draft_not_loaded",
    "draft_hook_failed",
    "draft_no_assets",
    "draft_vocab_mismatch",
    "draft_head_unavailable",
]
#: One line per `SpecReasonCode`, in its order (docs/flashhead-serving.md's table is generated from it).
SPEC_REASON_CODES: Final[dict[str, str]] = {
    "flashhead_inactive": "FlashHead is not active on this model (see `reason_code`)",
    "model_runner_v2": "Model Runner V2: its drafters' heads, and verify rows it lays out on the device only "
    "(adaptive verification), are not served by FlashHead in this version",
    "spec_hook_failed": "vLLM's speculative-decoding metadata could not be hooked (a vLLM internal moved)",
    "no_draft_head": "the drafter has no LM head (n-gram, suffix decoding)",
    "draft_head_not_supported": "FlashHead as this method's draft head is not implemented in this version "
    "(only `draft_model`, EAGLE and EAGLE-3 drafters: MTP and Medusa heads stay dense)",
    "draft_not_loaded": "the drafter is not loaded yet (decided right after vLLM loads it)",
    "draft_hook_failed": "vLLM's drafter could not be hooked (a vLLM internal moved)",
    "draft_no_assets": "the drafter's head has no FlashHead assets (a draft model without `flash_head_cache_dir` "
    "in its config.json, an EAGLE head with an LM head of its own)",
    "draft_vocab_mismatch": "the drafter's vocabulary differs from the target's",
    "draft_head_unavailable": "the draft model's FlashHead head cannot serve (its assets or its LM head, see `reason`)",
}


class SpecPart(WorkerReply):
    """One part of speculative decoding (the target's verify rows, or the drafter's head)."""

    active: bool
    reason: str | None = None
    reason_code: SpecReasonCode | None = None


class SpecState(WorkerReply):
    """FlashHead under speculative decoding; `FlashHeadState.spec` (null without speculative decoding)."""

    method: str | None = None
    num_speculative_tokens: int | None = None
    verify: SpecPart
    draft: SpecPart
    draft_n_probes: int | None = Field(
        default=None,
        description="Clusters the drafter's FlashHead head probes per draft token; null when the drafter has "
        "no FlashHead head (see `draft`).",
    )


class DenseReason(IntEnum):
    """Why a request's rows are served by the dense head. The value is the row's code in the engine's step
    rows (0, no member, means FlashHead may serve it); `label` is its key in `FlashHeadCounters.rows_dense`."""

    LOGPROBS = 1
    STRUCTURED_OUTPUT = 2
    LOGIT_BIAS = 3
    ALLOWED_TOKEN_IDS = 4
    BAD_WORDS = 5
    CUSTOM_LOGITS_PROCESSORS = 6
    UNCLASSIFIED = 7
    THINKING_BUDGET = 8
    WATERMARK = 9
    OPT_OUT = 10
    PENALIZED_GREEDY = 11

    @property
    def label(self) -> str:
        return self.name.lower()


#: Why a whole step (or a wrapper's call) is served dense, whatever its requests asked for.
StepDenseReason = Literal[
    "batch_threshold",
    "disabled",
    "unavailable",
    "error",
    "unexpected_rows",
    "lora",
    "wrapped_head",
    "speculative_verify",
]
#: Every key of `FlashHeadCounters.rows_dense`: the requests' `DenseReason` labels, then the steps'.
DenseRowReason = Literal[
    "logprobs",
    "structured_output",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "custom_logits_processors",
    "unclassified",
    "thinking_budget",
    "watermark",
    "opt_out",
    "penalized_greedy",
    "batch_threshold",
    "disabled",
    "unavailable",
    "error",
    "unexpected_rows",
    "lora",
    "wrapped_head",
    "speculative_verify",
]
#: One line per `DenseRowReason`, in its order (docs/flashhead-serving.md's table is generated from it).
DENSE_ROW_REASONS: Final[dict[str, str]] = {
    "logprobs": "the request asked for `logprobs` or `logprob_token_ids`",
    "structured_output": "structured output (JSON schema, regex, grammar)",
    "logit_bias": "the request set `logit_bias`",
    "allowed_token_ids": "the request set `allowed_token_ids`",
    "bad_words": "the request set `bad_words`",
    "custom_logits_processors": "custom logits processors are configured on the server (every row)",
    "unclassified": "a request field this plugin does not know is set, or the request could not be classified",
    "thinking_budget": "the request set `thinking_token_budget`",
    "watermark": "the request asked for watermarking",
    "opt_out": 'the request opted out (`"vllm_xargs": {"flashhead": false}`)',
    "penalized_greedy": "a greedy request with a repetition, frequency or presence penalty",
    "batch_threshold": "the step had more rows than `dense_batch_threshold`",
    "disabled": "FlashHead is turned off",
    "unavailable": "FlashHead is not available on this model (see `reason_code`)",
    "error": "FlashHead raised during the step; the dense head answered",
    "unexpected_rows": "the logits call had another number of rows than the step announced",
    "lora": "vLLM's LoRA wrapper received the step",
    "wrapped_head": "another layer wrapping the logits processor received the step",
    "speculative_verify": "a speculative-decoding step whose verify rows FlashHead does not serve (see `spec.verify`)",
}


class FlashHeadCounters(WorkerReply):
    """Counters since the worker started; they only grow."""

    steps: int = 0
    rows_flashhead: int = Field(
        default=0,
        description="Rows given FlashHead's answer, by FlashHead's kernels or by the dense product masked to it.",
    )
    rows_flashhead_masked: int = Field(
        default=0,
        description="Of `rows_flashhead`: rows whose FlashHead answer was made from the dense product (the cheaper "
        "way for their step, `step_costs`).",
    )
    rows_dense: dict[str, int] = Field(
        default_factory=dict, description="Rows served dense, by reason (a `DenseRowReason`, see `DENSE_ROW_REASONS`)."
    )
    fallbacks: int = 0
    head_seconds: float = 0.0
    fidelity_rows: int = Field(
        default=0, description="FlashHead rows also given the dense logits (one in `fidelity_every`): the live check."
    )
    fidelity_agreed: int = Field(default=0, description="Of `fidelity_rows`: rows whose best token is a dense argmax.")
    fidelity_sampled_rows: int = Field(default=0, description="Of `fidelity_rows`: rows that sample.")
    fidelity_tv_sum: float = Field(
        default=0.0,
        description="Over `fidelity_sampled_rows`: the sum of each row's total variation distance between FlashHead's "
        "law and the dense head's, at temperature 1 (divide by `fidelity_sampled_rows` for the mean).",
    )
    rows_flashhead_verify: int = Field(
        default=0, description="Of `rows_flashhead`: speculative-decoding verify rows (bonus rows not included)."
    )
    rows_flashhead_draft: int = Field(
        default=0,
        description="Speculative-decoding draft rows served by the drafter's FlashHead head (not in `rows_flashhead`).",
    )
    rows_dense_draft: int = Field(
        default=0, description="Draft rows of a FlashHead drafter served by its dense head (FlashHead off, a fallback)."
    )
    stage1_exchanges: int = Field(
        default=0,
        description="Under tensor parallelism: decode steps on which this rank exchanged its best clusters with the "
        "other ranks (the same count on every rank; steps above `dense_batch_threshold` exchange nothing).",
    )


SampledEstimate = Literal["fitted", "weight_only", "off"]


class RecentRows(WorkerReply):
    """The rows of the last decode steps (at most 256): a share over a window, where the counters only grow."""

    steps: int = 0
    rows_flashhead_greedy: int = 0
    rows_flashhead_sampled: int = 0
    rows_flashhead_masked: int = Field(
        default=0, description="Of the FlashHead rows, those made from the dense product (the masked way)."
    )
    rows_dense: int = Field(default=0, description="Rows that needed the dense head (see `counters.rows_dense`).")
    flashhead_share: float | None = Field(
        default=None, description="Of those steps' rows, the share given FlashHead's answer; null: no step yet."
    )


class ServedWay(WorkerReply):
    """How served steps of one batch bucket and kind are served now, and what each way cost them."""

    rows: str = Field(description="The bucket of rows per step, e.g. `5-8`.")
    kind: Literal["greedy", "sampled", "mixed"]
    way: Literal["flashhead", "masked"]
    flashhead_ms: float | None = None
    masked_ms: float | None = None
    steps: int = 0


class StepCostsReport(WorkerReply):
    """A decode step's cost on the dense head, on FlashHead's kernels and the masked way (the dense product masked
    to FlashHead's answer), measured on this worker when its head was built (`FlashHeadState.step_costs`). Both
    ways give every row the same answer; a step takes the masked way only when it is predicted cheaper."""

    batches: list[int] = Field(description="Rows per step at which the sides were timed.")
    dense_ms: list[float] = Field(
        description="Fastest of a few runs, in milliseconds, of vLLM's dense head at each batch."
    )
    greedy_ms: list[float] = Field(
        description="Fastest of a few runs, in milliseconds, of FlashHead with every row greedy."
    )
    sampled_ms: list[float] | None = Field(
        default=None,
        description="Fastest of a few runs, in milliseconds, of FlashHead with every row sampled; null without "
        "probe sampling.",
    )
    mixed_ms: list[float | None] | None = Field(
        default=None,
        description="Fastest of a few runs, in milliseconds, of FlashHead with every other row sampled (null at one "
        "row); null without probe sampling.",
    )
    masked_greedy_ms: list[float] | None = Field(
        default=None,
        description="Fastest of a few runs, in milliseconds, of the masked way with every row greedy; null: not timed.",
    )
    masked_sampled_ms: list[float] | None = Field(
        default=None,
        description="Fastest of a few runs, in milliseconds, of the masked way with every row sampled; null: not "
        "timed.",
    )
    masked_from_greedy: int | None = Field(
        default=None,
        description="Smallest timed batch at which the start-up timing sends a step of greedy rows the masked way; "
        "null: none.",
    )
    masked_from_sampled: int | None = Field(
        default=None,
        description="Smallest timed batch at which the start-up timing sends a step of sampled rows the masked way; "
        "null: none.",
    )
    served: list[ServedWay] = Field(
        default_factory=list,
        description="Served steps' own timings, which correct the start-up timing: per batch bucket and kind of "
        "step, the way it takes now and the running mean milliseconds of each way.",
    )


class FlashHeadState(WorkerReply):
    """The FlashHead controller's status of one worker (its `status()` dict)."""

    available: bool
    active: bool
    reason: str | None = None
    reason_code: ReasonCode | None = None
    enabled: bool
    num_clusters: int | None = None
    cluster_size: int | None = None
    vocab_size: int | None = None
    n_probes: int | None = None
    dense_batch_threshold: int | None = None
    probe_sampling: bool | None = None
    sampled_n_probes: int | None = None
    sampled_rank: int | None = None
    sampled_rescore: int | None = Field(
        default=None,
        description="Tokens a sampled row scores exactly besides its probed clusters' members: those its "
        "estimate ranks best; null while no head is built or without probe sampling.",
    )
    sampled_estimate: SampledEstimate | None = Field(
        default=None,
        description="Sampled rows' estimate of the unprobed logits: `fitted` to the build's calibration states, "
        "`weight_only`, or `off` (rank 0 or probe sampling off); null while no head is built.",
    )
    pinned_token_ids: list[int] | None = None
    fidelity_every: int | None = None
    backend: str | None = None
    extra_memory_bytes: int | None = None
    step_costs: StepCostsReport | None = Field(
        default=None,
        description="What a step costs each way on this worker, timed when the head was built, and the served steps' "
        "corrections; null when not timed (`MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD` set, `VLLM_BATCH_INVARIANT=1`, "
        "a GPU head, or no head): FlashHead's kernels then serve every step.",
    )
    counters: FlashHeadCounters = Field(default_factory=FlashHeadCounters)
    recent: RecentRows = Field(default_factory=RecentRows, description="The rows of the last decode steps.")
    spec: SpecState | None = Field(default=None, description="Speculative decoding's parts; null when it is off.")


class FlashHeadStatus(FlashHeadState, RankedReply):
    """`FlashHeadState` of one worker with its rank and process: reply of `FLASHHEAD_STATUS` and `FLASHHEAD_APPLY`."""

    pid: int | None = None


class TopPCounters(WorkerReply):
    """vLLM's CPU top-k/top-p calls this worker's process served without a sort of every row (`MY_PKG_FAST_TOP_P`),
    since it started."""

    installed: bool = Field(default=False, description="The sort-free top-p replaces vLLM's function here.")
    calls: int = Field(default=0, description="Sampler calls with a top-p it served.")
    rows: int = Field(default=0, description="Their rows.")
    sorted_rows: int = Field(default=0, description="Rows among them whose nucleus spilled past the window: sorted.")
    failures: int = Field(default=0, description="Calls where it raised and vLLM's own function served the call.")


class WorkerStatus(RankedReply):
    """Reply of `STATUS`: everything about a worker that changes while the engine runs."""

    pid: int
    settings_version: int = Field(default=0, description="Updates committed on this worker since it started.")
    memory: MemoryInfo = Field(default_factory=MemoryInfo)
    flashhead: FlashHeadState
    top_p: TopPCounters = Field(default_factory=TopPCounters)

    def flashhead_status(self) -> FlashHeadStatus:
        """The FlashHead part, flat, as `FLASHHEAD_STATUS` answers it."""
        return FlashHeadStatus.model_validate(
            {**self.flashhead.model_dump(), "rank": self.rank, "dp_rank": self.dp_rank, "pid": self.pid}
        )


class ValidationReply(RankedReply):
    errors: list[str] = Field(default_factory=list, description="Empty when the update can be applied.")


# ---- versioned updates: a lease per worker, taken in ascending dp rank, then a commit ------------------

#: The longest lease a worker grants (seconds): a caller cannot wedge updates for longer than this.
MAX_LEASE_S: Final = 600.0
#: The highest settings version a worker takes (15 digits, what `If-Match` accepts).
MAX_SETTINGS_VERSION: Final = 10**15 - 1
#: Transaction ids: what the API server makes (uuid4 hex), or any short token of these characters.
TRANSACTION_ID_PATTERN: Final = r"^[A-Za-z0-9._:-]{1,64}$"

SettingsVersion = Annotated[StrictInt, Field(ge=0, le=MAX_SETTINGS_VERSION)]


class Transaction(BaseModel):
    """Who runs an update and under which lease; sent with every phase of it. Checked by every worker method
    that takes it (bounded lease, bounded version, nothing undeclared)."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=TRANSACTION_ID_PATTERN, description="Unique per update; names the lease and the audit.")
    holder: str = Field(max_length=200, description="The API server running it (host, pid, API-server index).")
    lease_s: float = Field(
        gt=0, le=MAX_LEASE_S, description="The lease lapses this many seconds after it was taken (at most 600)."
    )
    expected_version: SettingsVersion | None = Field(
        default=None, description="Compare-and-set: refuse unless the worker's version is this one."
    )
    new_version: SettingsVersion | None = Field(
        default=None,
        description="The version the commit sets: above the worker's (a worker refuses a non-increasing one).",
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
        only for `dense_batch_threshold`, where it is a value)."""
        merged = {**self.model_dump(), **(update or {})}
        return {
            k: v for k, v in merged.items() if k in UPDATE_FIELDS and (v is not None or k == "dense_batch_threshold")
        }


class PrepareReply(RankedReply):
    """Phase 1 on one worker: `granted` when the update is valid here and the lease is now the transaction's."""

    granted: bool
    version: int = Field(description="The worker's settings version.")
    errors: list[str] = Field(default_factory=list, description="Why the update cannot be applied here.")
    conflict: str | None = Field(
        default=None, description="'busy' (another update holds the lease) or 'version' (compare-and-set failed)."
    )
    holder: str | None = Field(default=None, description="Who holds the lease when busy.")
    before: SettingsValues = Field(default_factory=SettingsValues)


class LeaseReply(RankedReply):
    released: bool
    version: int


class CommitReply(FlashHeadStatus):
    """Phase 2 on one worker: its FlashHead status after the update, and the version it now has."""

    settings_version: int


_Short = Annotated[str, Field(max_length=200)]


class AuditInput(BaseModel):
    """What an API server may send a worker to keep with a commit or a rejection: who asked, for what, and
    why it was refused. The worker adds the time, the outcome, the transaction and its version itself."""

    model_config = ConfigDict(extra="forbid")

    request_id: _Short | None = None
    api_server: _Short | None = None
    role: _Short | None = None
    token_source: _Short | None = None
    token_fingerprint: _Short | None = None
    client: _Short | None = None
    method: _Short | None = None
    path: _Short | None = None
    engines: list[int] | None = Field(default=None, max_length=4096)
    update: dict[str, Any] | None = None
    status_code: int | None = Field(default=None, ge=100, le=599)
    error_type: _Short | None = None
    reason: Annotated[str, Field(max_length=2000)] | None = None

    @model_validator(mode="after")
    def _update_is_an_update(self) -> AuditInput:
        if self.update is not None and update_errors(self.update):
            raise ValueError("update: not a FlashHead update")
        return self


class AuditEntry(BaseModel):
    """One audit record: a mutation (applied, partial, rejected, failed, pending) or refusals of one caller,
    counted."""

    model_config = ConfigDict(extra="allow")

    time: str = Field(description="When it happened (UTC, ISO 8601); for refusals, the latest one.")
    result: str = Field(description="applied, partial, rejected, failed, pending or refused.")
    status_code: int
    request_id: str | None = None
    api_server: str | None = Field(default=None, description="The API server that answered the request.")
    role: str | None = None
    token_source: str | None = None
    token_fingerprint: str | None = Field(
        default=None, description="HMAC of the token with a per-process key: equal within one process only."
    )
    client: str | None = None
    method: str | None = None
    path: str | None = None
    transaction: str | None = None
    settings_version: int | None = None
    engines: list[int] | None = Field(default=None, description="Data-parallel ranks the mutation covered.")
    update: dict[str, Any] | None = None
    settings: dict[str, Any] | None = Field(
        default=None, description="The whole settings the update committed (the update over the settings in force)."
    )
    before: list[dict[str, Any]] | None = None
    error_type: str | None = None
    reason: str | None = None
    committed_engines: list[int] | None = Field(
        default=None, description="Data-parallel ranks whose engines committed the update (partial, failed)."
    )
    outcomes: list[dict[str, Any]] | None = Field(
        default=None,
        description="Per engine: `dp_rank` and `outcome` (committed, aborted, failed, refused, not_reached).",
    )
    answered_status_code: int | None = Field(
        default=None,
        description="What the caller was told, where it differs from the outcome: 504 for an update that applied "
        "after its caller stopped waiting.",
    )
    count: int = Field(default=1, description="Refusals: how many were collapsed into this entry.")
    first_time: str | None = Field(default=None, description="Refusals: when the first one happened.")


class AuditReply(RankedReply):
    entries: list[AuditEntry] = Field(default_factory=list)


# ---- the update ------------------------------------------------------------------------------------


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
            for name in ("enabled", "n_probes", "draft_n_probes")
            if name in self.model_fields_set and getattr(self, name) is None
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


# ---- the registry: each worker method's reply, the update's fields --------------------------------------

#: Every worker method of the engine half (the name `collective_rpc` takes) and the model of its reply: the
#: engine half builds each reply with it, the endpoint half parses each reply with it (`parse_replies` refuses
#: another), and a test calls every worker method and validates its reply with it.
WORKER_METHOD_REPLIES: Final[dict[str, type[RankedReply]]] = {
    PING: PingReply,
    WORKER_INFO: WorkerIdentity,
    CONFIG: WorkerConfig,
    STATUS: WorkerStatus,
    FLASHHEAD_STATUS: FlashHeadStatus,
    FLASHHEAD_VALIDATE: ValidationReply,
    FLASHHEAD_APPLY: CommitReply,
    FLASHHEAD_PREPARE: PrepareReply,
    FLASHHEAD_COMMIT: CommitReply,
    FLASHHEAD_ABORT: LeaseReply,
    AUDIT: AuditReply,
}
WORKER_METHOD_NAMES: Final = tuple(WORKER_METHOD_REPLIES)

#: Fields of `FlashHeadUpdate`, in the order the API documents them.
UPDATE_FIELDS: Final = tuple(FlashHeadUpdate.model_fields)

__all__ = [
    "AUDIT",
    "FLASHHEAD_ABORT",
    "FLASHHEAD_COMMIT",
    "FLASHHEAD_PREPARE",
    "MAX_LEASE_S",
    "MAX_SETTINGS_VERSION",
    "MAX_UPDATE_INT",
    "AuditEntry",
    "AuditInput",
    "AuditReply",
    "CommitReply",
    "LeaseReply",
    "PrepareReply",
    "SettingsValues",
    "Transaction",
    "DENSE_ROW_REASONS",
    "REASON_CODES",
    "SPEC_REASON_CODES",
    "DenseReason",
    "DenseRowReason",
    "ReasonCode",
    "SpecPart",
    "SpecReasonCode",
    "SpecState",
    "RecentRows",
    "ServedWay",
    "StepCostsReport",
    "TopPCounters",
    "StepDenseReason",
    "CONFIG",
    "CONFIG_SECTIONS",
    "FLASHHEAD_APPLY",
    "FLASHHEAD_STATUS",
    "FLASHHEAD_VALIDATE",
    "PING",
    "RPC_PREFIX",
    "STATUS",
    "UPDATE_FIELDS",
    "WORKER_INFO",
    "WORKER_METHOD_NAMES",
    "WORKER_METHOD_REPLIES",
    "FlashHeadCounters",
    "FlashHeadState",
    "FlashHeadStatus",
    "FlashHeadUpdate",
    "KVCacheInfo",
    "MemoryInfo",
    "ModelInfo",
    "PingReply",
    "RankedReply",
    "ValidationReply",
    "WorkerConfig",
    "WorkerIdentity",
    "WorkerReply",
    "WorkerStatus",
    "update_errors",
]
