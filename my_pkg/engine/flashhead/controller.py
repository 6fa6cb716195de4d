"""The FlashHead controller: one model's FlashHead in one worker, through a decode step and the admin API.

One `FlashHeadController` hangs off the logits processor of a model that ships FlashHead assets
(`engine/setup.py` makes it; `patches/runner_hooks.py` finds it from a model runner or a worker). Its life:

1. `__init__` / `from_model_dir`: reads the assets while vLLM constructs the model, or records why FlashHead
   cannot serve it (`availability.py`, `ReasonCode`).
2. `prepare(weight)`: right after vLLM loaded the weights, builds the head over the loaded LM head (`bind`),
   runs it once (`warm_up`) so that vLLM's KV-cache sizing counts its memory, then with no threshold set times
   its steps beside vLLM's dense product (`measure_costs`; all three in `build.py`): on a GPU a head slower than
   the dense product stands down.
   Under tensor parallelism the head covers this rank's vocabulary shard and `stage1` its share of the
   centroids (`my_pkg.flashhead.probes.ShardStage1`).
3. Each decode step: the model runner arms it with the step's rows (`arm`, `StepRows`) and `compute_logits`
   serves every row that may use FlashHead with `FlashHead.step_logits` and the pinned ids, the others with
   vLLM's dense logits; where the dense product is the cheaper way (`timing.StepWays`) the FlashHead rows are
   made from it, masked to FlashHead's answer (`step.py`): the way never changes a row's tokens. Under tensor
   parallelism the ranks first exchange their best clusters (`exchange_width`, `stage1_payload`,
   `exchange.py`); whether a rank serves FlashHead at all was agreed when the model loaded (`agree`).
4. The admin API: `status()` (a `FlashHeadState`, `report.py`), `validate(update)` and `apply(update)` (a
   `FlashHeadUpdate`, `updates.py`).

Its other parts: the counters, timer and fidelity check (`telemetry.py`), the pinned ids (`pins.py`) and the
settings (`my_pkg.flashhead.settings`, resolved for a head by `my_pkg.flashhead.spec.HeadSpec`). The parts
take plain values and never import this module. It imports torch, numpy and the contract; vLLM objects reach it
as plain arguments.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from my_pkg.contract import FlashHeadState, FlashHeadUpdate, ReasonCode, SpecState, StepCostsReport
from my_pkg.engine.flashhead import build, compact_step, exchange, report, step, updates
from my_pkg.engine.flashhead.availability import cluster_shape, read_assets, unavailability
from my_pkg.engine.flashhead.pins import PinnedRows
from my_pkg.engine.flashhead.report import log_step_costs, step_costs_report
from my_pkg.engine.flashhead.rows import StepRows
from my_pkg.engine.flashhead.telemetry import Counters, Fallbacks, FidelityCheck, HeadTimer, RecentSteps
from my_pkg.engine.flashhead.timing import StepWays
from my_pkg.engine.flashhead.updates import as_update
from my_pkg.flashhead.probes import ShardStage1
from my_pkg.flashhead.settings import default_settings
from my_pkg.flashhead.spec import HeadSpec
from my_pkg.flashhead.step_costs import StepCosts
from my_pkg.flashhead.tail_estimate import TailFactors

__all__ = ["FlashHeadController"]

logger = logging.getLogger(f"vllm.{__name__}")


class FlashHeadController:
    """FlashHead for one model in one worker (see the module docstring for its life)."""

    def __init__(
        self,
        *,
        centroids: torch.Tensor | None,
        assignments: torch.Tensor | None,
        config: dict[str, Any],
        vocab_size: int,
        unavailable: tuple[ReasonCode, str] | None = None,
        pinned_ids: Iterable[int] = (),
        tail_factors: TailFactors | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self._tail_factors = tail_factors  # sampled rows' estimate fitted at build time (None: weight-only)
        #: Scored exactly on every FlashHead row: EOS and special tokens of the model and its tokenizer.
        self.pinned_ids = tuple(sorted({int(i) for i in pinned_ids if 0 <= int(i) < vocab_size}))
        self.counters = Counters()
        self.recent = RecentSteps()
        self._timer = HeadTimer(self.counters)
        self._fidelity = FidelityCheck(self.counters)
        self._pins: PinnedRows | None = None
        self._step_source: Callable[[], StepRows | None] | None = None
        self._fallbacks = Fallbacks(self.counters)
        self.head: Any = None
        self.vocab_range: tuple[int, int] | None = None  # this rank's vocabulary shard under tensor parallelism
        self.stage1: ShardStage1 | None = None  # this rank's share of the centroids under tensor parallelism
        #: What a step costs each way on this machine, measured at `prepare` (under tensor parallelism this rank's
        #: own part), and the way each step takes, corrected by served steps (a CPU head).
        self.step_costs: StepCosts | None = None
        self.ways = StepWays(None)
        #: Tensor parallelism: some rank could not serve FlashHead when the model loaded (`agree`): no rank does.
        self.dense_on_every_rank = False
        self.spec: SpecState | None = None  # speculative decoding's parts (`flashhead/spec.py`), set by its maker
        #: Under speculative decoding, the drafter's own controller when FlashHead serves its head (`draft.py`).
        self.draft: FlashHeadController | None = None
        #: The last step's compact rows, until the sampler hook draws them (`compact_step.py`).
        self.compact = compact_step.PlanSlot(self.counters)
        self._served = compact_step.Served(self.counters, self.recent, self._timer, self._fidelity, self.compact)
        self._centroids, self._assignments = centroids, assignments
        reason = unavailability(centroids, assignments, vocab_size, unavailable)
        self.unavailable_code: ReasonCode | None = reason[0] if reason is not None else None
        self.unavailable_reason: str | None = reason[1] if reason is not None else None
        self.num_clusters: int | None = None
        self.cluster_size: int | None = None
        if centroids is not None and assignments is not None and reason is None:
            self.num_clusters, self.cluster_size = cluster_shape(centroids, assignments)
        self.settings = default_settings(config, self.num_clusters)
        if self.unavailable_reason is not None:
            self._centroids = self._assignments = None
            logger.warning("my_pkg: FlashHead not active, dense head in use: %s", self.unavailable_reason)

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | None,
        config: dict[str, Any],
        *,
        vocab_size: int,
        unavailable: tuple[ReasonCode, str] | None = None,
        pinned_ids: Iterable[int] = (),
    ) -> FlashHeadController:
        """The controller over the assets config.json names (`availability.read_assets`), `pinned_ids` (the
        tokenizer's EOS and special ids) beside the model directory's; a failure leaves it unavailable."""
        assets = read_assets(model_dir, config, unavailable=unavailable, pinned_ids=pinned_ids)
        return cls(config=config, vocab_size=vocab_size, **assets.arguments())

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        return self.unavailable_reason is None

    def make_unavailable(self, code: ReasonCode, reason: str) -> None:
        if self.unavailable_reason is None:
            self.unavailable_code, self.unavailable_reason = code, reason
            logger.warning("my_pkg: FlashHead not active, dense head in use: %s", reason)

    def prepare(
        self,
        weight: torch.Tensor,
        vocab_range: tuple[int, int] | None = None,
        shard: tuple[int, int] | None = None,
        dense: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """Build the head over the loaded `weight` and warm it up on zero rows, before vLLM sizes the KV cache;
        with `dense` (vLLM's product for the head) then time it (`measure_costs`). Never raises: a failure
        leaves the model dense with its reason."""
        if self.head is not None or not self.available:
            return
        self.bind(weight, vocab_range, shard)
        if self.head is not None:
            self.warm_up(torch.zeros((2, weight.shape[1]), dtype=weight.dtype, device=weight.device))
        if self.head is not None and dense is not None:
            self.measure_costs(dense)

    def bind(
        self,
        weight: torch.Tensor,
        vocab_range: tuple[int, int] | None = None,
        shard: tuple[int, int] | None = None,
    ) -> None:
        """Build the head over `weight` (the loaded LM head; under tensor parallelism this rank's shard, the tokens
        `vocab_range`, and `shard = (rank, world_size)`: `build.build_head`); a failure leaves the model dense."""
        if self.head is not None or not self.available:
            return
        assert self._centroids is not None and self._assignments is not None
        built = build.build_head(
            self.settings,
            weight,
            self._centroids,
            self._assignments,
            vocab_size=self.vocab_size,
            vocab_range=vocab_range,
            shard=shard,
            tail_factors=self._tail_factors,
            pinned_ids=self.pinned_ids,
        )
        self._centroids = self._assignments = None
        self.stage1 = built.stage1
        if built.error is not None:
            self.make_unavailable("build_failed", f"FlashHead could not be built: {built.error}")
        else:
            self.head, self._pins, self.vocab_range = built.head, built.pins, vocab_range

    def measure_costs(self, dense: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """With no `MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD`, time the head's steps beside `dense` (`build.measure`;
        each tensor-parallel rank its own part). On the host both ways are timed: the prior from which `ways`
        chooses. An accelerator's head whose kernels measured slower than `dense` at one row stands down: the model
        serves vLLM's dense head."""
        head = self.head
        if not self.settings.measure_step_costs or head is None:
            return
        self.step_costs = build.measure(
            head, self._pins, self.stage1, self._keys_width(), self.settings.probe_sampling, dense
        )
        if self.step_costs is None:
            return
        slower = None if build.on_host(head) else self.step_costs.slower_than_dense()
        if slower is not None:
            self.head = None
            self.make_unavailable("slower_than_dense", f"{slower} on {head.weight.device}")
            return
        self.ways = StepWays(self.step_costs)
        costs_report = self._step_costs_report()
        assert costs_report is not None
        log_step_costs(self.step_costs, costs_report)

    def warm_up(self, hidden: torch.Tensor) -> None:
        """Run the head once on `hidden[:2]` (`build.warm_up`); a head that fails here is dropped, the model stays
        dense."""
        if self.head is None:
            return
        settings = self.settings
        args = (self._pins, self.stage1, self._keys_width(), hidden, settings.probe_sampling, settings.compact_sampling)
        failed = build.warm_up(self.head, *args)
        if failed is not None:
            self.head = None
            self.make_unavailable("warm_up_failed", failed)
            return
        logger.info("my_pkg: FlashHead extra memory %.1f MiB", self.extra_memory_bytes / 2**20)

    @property
    def extra_memory_bytes(self) -> int | None:
        """Device bytes FlashHead holds beyond vLLM's head weight: centroids, cluster map, the sampled
        rows' tables once built (at `prepare`) and the pinned ids' cached weight rows."""
        return build.extra_memory_bytes(self.head, self._pins)

    def _worker_extra_memory_bytes(self) -> int | None:
        """`extra_memory_bytes` of this head and of the drafter's FlashHead head linked to it (an EAGLE head's
        is a second head over the same weight, a draft model's one over its own), as the status reports it."""
        draft = (self.draft.head, self.draft.extra_memory_bytes) if self.draft is not None else None
        return build.extra_memory_bytes(self.head, self._pins, draft)

    # ---- one decode step -------------------------------------------------------------------

    def arm(self, source: Callable[[], StepRows | None]) -> None:
        """Announce that the next logits call is a decode step whose rows `source` describes."""
        self._step_source = source

    def disarm(self) -> None:
        self._step_source = None

    @property
    def armed(self) -> bool:
        """Whether the next logits call is an armed decode step (the same on every rank of a step)."""
        return self._step_source is not None

    def take_step(self) -> StepRows | None:
        """The rows of the armed step, once; None for any other logits call."""
        source, self._step_source = self._step_source, None
        return source() if source is not None else None

    def serve_step_dense(self, num_rows: int, reason: str) -> None:
        """Consume the armed step, if any, as `num_rows` rows served dense for `reason`."""
        source, self._step_source = self._step_source, None
        if source is not None:
            self.counters.steps += 1
            self.counters.rows_dense[reason] += num_rows

    # ---- tensor parallelism: stage 1 split over the ranks -----------------------------------

    def exchange_width(self, num_rows: int) -> int | None:
        """Keys each rank sends per row in the stage-1 exchange of an armed step of `num_rows` rows, or None
        (`exchange.exchange_width`: from what every rank holds alike, so all ranks or none reach the collective)."""
        return exchange.exchange_width(self._keys_width(), self.settings.dense_batch_threshold, num_rows)

    def _keys_width(self) -> int | None:
        part = exchange.takes_part(self.unavailable_code, self.dense_on_every_rank)
        return exchange.keys_width(self.settings, self.num_clusters, part=part)

    def stage1_payload(
        self, hidden: torch.Tensor, width: int, rows: StepRows | None = None
    ) -> tuple[torch.Tensor, bool]:
        """`([rows, width] int64, scored)`: what this rank sends in the stage-1 exchange (`exchange.payload`);
        never raises, failures are counted as fallbacks."""
        return exchange.payload(self.stage1, hidden, width, rows, self.record_fallback)

    def stage1_received(self, gathered: torch.Tensor, width: int) -> torch.Tensor:
        """Every rank's keys `[rows, tp * width]` from the gathered payloads (`stage1_payload`)."""
        self.counters.stage1_exchanges += 1
        return gathered.reshape(int(gathered.shape[0]), -1)

    def agree(self, every_rank_available: bool) -> None:
        """Tensor parallelism: what the ranks agreed when the model loaded (one collective over the TP group, made by
        the load hook on every rank alike): when some rank cannot serve FlashHead, none does."""
        if every_rank_available:
            return
        self.dense_on_every_rank = True
        if self.available:
            self.head = None
            self.make_unavailable(
                "tensor_parallel_rank", "another tensor-parallel rank cannot serve FlashHead; dense head on every rank"
            )

    def compute_logits(
        self,
        hidden: torch.Tensor,
        rows: StepRows,
        dense: Callable[[torch.Tensor], torch.Tensor],
        postprocess: Callable[[torch.Tensor], torch.Tensor],
        exchanged: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits `[rows, vocab]` for one decode step, without making the host wait for the device. `dense`: vLLM's
        own logits for some rows; `postprocess`: the model's logit scale/soft-cap for FlashHead's finite logits;
        `exchanged` (tensor parallelism, `[rows, tp * width]`): every rank's `stage1_payload` of this step."""
        num_rows = hidden.shape[0]
        self.counters.steps += 1
        self.compact.drop()  # a plan the sampler never took: its rows were drawn by vLLM
        exchange_missing = self.stage1 is not None and exchanged is None  # the exchange did not happen here
        reason = step.all_dense_reason(rows, num_rows, self.settings, self.head is not None, exchange_missing)
        if reason is not None:
            return self._all_dense(hidden, dense, reason)
        dense_rows = step.dense_rows(rows, self.counters)
        if dense_rows.size == num_rows:
            return dense(hidden)

        compact = compact_step.rows_to_draw(rows, self.settings, self.head, self.vocab_range)
        if compact is not None:  # always FlashHead's kernels: the law of a row drawn by the plugin
            pins = self._pins.get(rows.stop_ids, self.head.weight) if self._pins is not None else None
            args = (hidden, rows, compact, dense_rows, dense, pins, postprocess, self._served, self._checked_every())
            return compact_step.serve(self.head, *args)
        timed = self.ways.timed
        started = time.perf_counter() if timed else 0.0
        flash = step.FlashRows(hidden, rows, dense_rows)
        probes = step.exchanged_probes(exchanged, flash, self._keys_width(), self.head.num_clusters)
        num_sampled = int(np.count_nonzero(flash.sampled)) if self.settings.probe_sampling else 0
        num_dense = int(dense_rows.size)
        greedy = num_rows - num_dense - num_sampled
        way = self.ways.choose(greedy, num_sampled, num_dense, check_every=self._checked_every())
        assert self._pins is not None
        # The live fidelity check, not under tensor parallelism: a shard's best token says nothing of the row's.
        check = (self._fidelity, self.settings.fidelity_every) if self.vocab_range is None else None
        logits = step.serve(
            way, self.head, hidden, flash, dense_rows, dense, probe_sampling=self.settings.probe_sampling,
            pinned_rows=self._pins, stop_ids=rows.stop_ids, postprocess=postprocess, probes=probes, timer=self._timer,
            check=check,
        )  # fmt: skip
        step.count_served(self.counters, self.recent, rows, greedy, num_sampled, num_dense, way == "masked")
        if timed:
            self.ways.observe(greedy, num_sampled, num_dense, way, time.perf_counter() - started)
        return logits

    def _checked_every(self) -> int:
        """One FlashHead row in this many also gets the dense head's logits (the live fidelity check, off under
        tensor parallelism: a shard's best token says nothing of the row's); 0: none."""
        return self.settings.fidelity_every if self.vocab_range is None else 0

    def _all_dense(
        self, hidden: torch.Tensor, dense: Callable[[torch.Tensor], torch.Tensor], reason: str
    ) -> torch.Tensor:
        self.counters.rows_dense[reason] += hidden.shape[0]
        return dense(hidden)

    def record_fallback(self, exc: BaseException, num_rows: int) -> None:
        """Count a step that failed inside FlashHead and went dense; log each kind once."""
        self._fallbacks.record(exc, num_rows)

    # ---- control ---------------------------------------------------------------------------

    def status(self) -> FlashHeadState:
        """The status reply; never waits for the device (work still running is counted by a later call)."""
        self._timer.collect(block=False)
        self._fidelity.collect()
        return report.status(
            self,
            extra_memory_bytes=self._worker_extra_memory_bytes(),
            step_costs=self._step_costs_report(),
            head_spec=self._head_spec(),
        )

    def _step_costs_report(self) -> StepCostsReport | None:
        return step_costs_report(self.step_costs, self.ways.report(), self._checked_every())

    def _head_spec(self) -> HeadSpec | None:
        """The head's parameters before it is built, over the whole vocabulary (None once the assets are dropped)."""
        if self._centroids is None or self.num_clusters is None:
            return None
        return HeadSpec.resolve(
            self.settings,
            num_clusters=self.num_clusters,
            vocab_size=self.vocab_size,
            hidden_size=int(self._centroids.shape[1]),
            fitted_rank=self._tail_factors.rank if self._tail_factors is not None else 0,
        )

    def validate(self, update: FlashHeadUpdate) -> list[str]:
        """What the served model refuses in `update` (`updates.refusals`)."""
        draft_clusters = self.draft.num_clusters if self.draft is not None else None
        return updates.refusals(
            as_update(update),
            unavailable_reason=self.unavailable_reason,
            num_clusters=self.num_clusters,
            has_draft=self.draft is not None,
            draft_clusters=draft_clusters,
            spec=self.spec,
        )

    def apply(self, update: FlashHeadUpdate) -> None:
        """Apply an update that `validate` accepted; effective from the next step (`updates.apply`)."""
        updates.apply(as_update(update), self, self.draft)
