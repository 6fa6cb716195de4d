"""What changes while a worker runs: its FlashHead state, counters and step costs, its memory, its top-p counters.

The FlashHead controller (`my_pkg.engine.flashhead.controller`) builds its status as `FlashHeadState`
itself, setting every field (a test fails on a field left to its default).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from my_pkg.contract.reasons import ReasonCode, SpecReasonCode
from my_pkg.contract.replies import RankedReply, WorkerReply


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


class CompactCounters(WorkerReply):
    """Sampled rows the plugin drew itself from the compact law (`MY_PKG_FLASHHEAD_COMPACT_SAMPLING`), since start."""

    rows: int = Field(default=0, description="Rows drawn from the compact law (also in `rows_flashhead`).")
    resolved_clusters: int = Field(
        default=0, description="Clusters scored exactly at draw time: near a filter's cutoff, or a proposed atom."
    )
    over_budget_rows: int = Field(
        default=0, description="Rows that needed more clusters than the budget: the rest were dropped."
    )
    atom_rows: int = Field(default=0, description="Rows whose token was drawn from an atom (a cluster outside E).")
    bound_rows: int = Field(
        default=0, description="Threshold rows (no top_k; not min_p with top_p): temperature only, min_p, top_p."
    )
    bound_sum: float = Field(
        default=0.0,
        description="Over `bound_rows`: the sum of each row's estimate of the mass its margin missed, over its exact "
        "set's kept mass (divide by `bound_rows` for the mean; 0 while no member exceeds its estimate by the margin).",
    )
    unmatched_rows: int = Field(
        default=0,
        description="Rows planned but not drawn by the plugin (vLLM's sampler got another tensor): vLLM drew them "
        "from the exact set alone.",
    )
    failed_rows: int = Field(
        default=0, description="Rows whose draw raised: vLLM drew them from the exact set alone (logged once)."
    )


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
    compact: CompactCounters = Field(default_factory=CompactCounters)


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
        "corrections (a GPU head: FlashHead's kernels and the dense head only, the figures behind "
        "`slower_than_dense`); null when not timed (`MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD` set, "
        "`VLLM_BATCH_INVARIANT=1`, or no head): FlashHead's kernels then serve every step.",
    )
    counters: FlashHeadCounters = Field(default_factory=FlashHeadCounters)
    recent: RecentRows = Field(default_factory=RecentRows, description="The rows of the last decode steps.")
    spec: SpecState | None = Field(default=None, description="Speculative decoding's parts; null when it is off.")


class FlashHeadStatus(FlashHeadState, RankedReply):
    """`FlashHeadState` of one worker with its rank and process: reply of `FLASHHEAD_STATUS` and `FLASHHEAD_APPLY`."""

    pid: int | None = None


class MemoryInfo(WorkerReply):
    device_allocated_bytes: int | None = None
    device_reserved_bytes: int | None = None
    process_rss_bytes: int | None = None
    kv_cache_bytes: int | None = None


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
