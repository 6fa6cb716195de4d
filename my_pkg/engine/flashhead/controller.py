"""The FlashHead controller: one model's FlashHead in one worker, through a decode step and the admin API.

One `FlashHeadController` hangs off the logits processor of a model that ships FlashHead assets
(`patches/logits_processor.py` makes it; `patches/runner_hooks.py` finds it from a model runner
or a worker). Its life, in order:

1. `__init__` / `from_model_dir`: reads the assets (centroids and the cluster map) while vLLM
   constructs the model, or records why FlashHead cannot serve it (`ReasonCode`).
2. `prepare(weight)`: right after vLLM loaded the weights, builds the head over the loaded LM head
   (shared; on CPU plus its rows in cluster order), its sampled-row tables and kernels, so that
   vLLM's KV-cache sizing counts their memory (`bind` + `warm_up`; the first logits call does it when
   the load hook could not); then, on a CPU head with no threshold set, times its steps beside
   vLLM's dense product (`measure_costs`, `my_pkg.flashhead.step_costs`).
   Under tensor parallelism the head covers this rank's vocabulary shard and `stage1` this rank's
   share of the centroids (`my_pkg.flashhead.probes.ShardStage1`).
3. Each decode step: the model runner arms it with the step's rows (`arm`, `StepRows`), and
   `compute_logits` serves every row that may use FlashHead with `FlashHead.step_logits` (exact
   candidate logits and -inf elsewhere for greedy rows, estimates elsewhere for sampled rows,
   exact logits for the pinned ids) and the other rows with vLLM's dense logits. Where the dense
   product is the cheaper way (`timing.StepWays`), the FlashHead rows are made from it instead, masked to
   FlashHead's answer (`FlashHead.masked_logits`): which way serves a step never changes a row's tokens.
   Under tensor parallelism the logits processor first exchanges each rank's best clusters
   (`exchange_width`, `stage1_payload`) and `compute_logits` probes the clusters chosen from all of them;
   whether a rank serves FlashHead at all was agreed by every rank when the model loaded (`agree`).
4. The admin API: `status()` (a `FlashHeadState`), `validate(update)` and `apply(update)` (a
   `FlashHeadUpdate`; the contract already checked its types, this checks what the model decides).

Its parts live beside it: which rows a step may serve (`rows.py`), the counters, timer and fidelity
check (`telemetry.py`), the pinned ids (`pins.py`), the way each step takes (`timing.py`), the
tensor-parallel stage-1 exchange (`exchange.py`), the status reply's parts (`report.py`) and the
start-up settings (`my_pkg.flashhead.settings`). This module imports torch, numpy and the contract; vLLM objects
reach it as plain arguments.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from my_pkg.contract import DenseReason, FlashHeadState, FlashHeadUpdate, ReasonCode, SpecState, StepCostsReport
from my_pkg.engine.flashhead import exchange
from my_pkg.engine.flashhead.pins import PinnedRows
from my_pkg.engine.flashhead.report import (
    DISABLED_REASON,
    NO_ASSETS_REASON,
    NOT_BUILT_REASON,
    log_step_costs,
    sampled_estimate,
    step_costs_report,
)
from my_pkg.engine.flashhead.rows import StepRows
from my_pkg.engine.flashhead.spec import effective as effective_spec
from my_pkg.engine.flashhead.telemetry import Counters, FidelityCheck, HeadTimer, RecentSteps
from my_pkg.engine.flashhead.timing import StepWays
from my_pkg.flashhead.head import FlashHead
from my_pkg.flashhead.layout import hidden_major
from my_pkg.flashhead.masked import masked_logits
from my_pkg.flashhead.probes import ShardStage1, merge_probes
from my_pkg.flashhead.settings import default_settings
from my_pkg.flashhead.spec import HeadSpec, resolve_sampled_n_probes
from my_pkg.flashhead.staging import index_tensor
from my_pkg.flashhead.step_costs import StepCosts, measure_step_costs
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
        self._warned: set[str] = set()
        self.head: Any = None
        self.vocab_range: tuple[int, int] | None = None  # this rank's vocabulary shard under tensor parallelism
        self.stage1: ShardStage1 | None = None  # this rank's share of the centroids under tensor parallelism
        #: What a step costs each way on this machine, measured at `prepare` (a CPU head; under tensor
        #: parallelism this rank's own part), and the way each step takes, corrected by served steps.
        self.step_costs: StepCosts | None = None
        self.ways = StepWays(None)
        #: Tensor parallelism: some rank could not serve FlashHead when the model loaded (`agree`): no rank does.
        self.dense_on_every_rank = False
        self.spec: SpecState | None = None  # speculative decoding's parts (`flashhead/spec.py`), set by its maker
        #: Under speculative decoding, the drafter's own controller when FlashHead serves its head (`draft.py`).
        self.draft: FlashHeadController | None = None
        self._centroids = centroids
        self._assignments = assignments
        self.unavailable_code: ReasonCode | None = None
        self.unavailable_reason: str | None = None
        if unavailable is not None:
            self.unavailable_code, self.unavailable_reason = unavailable
        elif centroids is None or assignments is None:
            self.unavailable_code, self.unavailable_reason = "no_assets", NO_ASSETS_REASON
        elif int(assignments.shape[0]) != vocab_size:
            self.unavailable_code = "assets_mismatch"
            self.unavailable_reason = (
                f"FlashHead assets do not match the model: cluster_assignments covers "
                f"{assignments.shape[0]} tokens, the vocabulary has {vocab_size}"
            )
        self.num_clusters: int | None = None
        self.cluster_size: int | None = None
        if self.unavailable_reason is None:
            self.num_clusters = int(centroids.shape[0])
            self.cluster_size = int(torch.bincount(assignments.flatten().long()).max())
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
        """Read the assets named by config.json; a failure leaves the controller unavailable.

        `pinned_ids` (the tokenizer's EOS and special ids) are pinned beside the ids the model
        directory names (`stop_and_special_token_ids`)."""
        centroids = assignments = tail_factors = None
        pinned = set(pinned_ids)
        if unavailable is None:
            try:
                from my_pkg.flashhead.assets import load_assets, load_tail_factors, stop_and_special_token_ids

                if model_dir is None:
                    raise FileNotFoundError("the model directory could not be resolved")
                centroids, assignments = load_assets(Path(model_dir), config)
                tail_factors = load_tail_factors(Path(model_dir), config)
                pinned.update(stop_and_special_token_ids(model_dir, config))
            except Exception as exc:  # noqa: BLE001 - bad assets mean dense, never a crash
                unavailable = ("assets_invalid", f"FlashHead assets could not be loaded: {exc}")
        return cls(
            centroids=centroids,
            assignments=assignments,
            config=config,
            vocab_size=vocab_size,
            unavailable=unavailable,
            pinned_ids=pinned,
            tail_factors=tail_factors,
        )

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
        """Build the head over the loaded `weight` and warm it up on zero rows (kernels, sampled-row
        tables): called right after vLLM loads the weights, so its memory is counted before vLLM
        sizes the KV cache. With `dense` (vLLM's product for the head) it then measures where the
        dense head is faster (`measure_costs`). Never raises; a failure leaves the model dense with its
        reason."""
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
        """Build the head over `weight` (the loaded LM head, shared; a CPU head adds its rows in cluster order).

        Under tensor parallelism `weight` is this rank's shard of vLLM's vocab-parallel head, whose
        rows are the tokens `vocab_range = (start, end)`, and `shard = (rank, world_size)` names the
        rank: `stage1` scores this rank's share of the global centroids (a view of the head's, no
        copy), the ranks choose the probes together from their shares (the same probes on every rank),
        the head scores only the candidates in its range, and its logits are this shard's columns,
        which vLLM's gather puts together.
        """
        if self.head is not None or not self.available:
            return
        assert self._centroids is not None and self._assignments is not None
        start, end = vocab_range if vocab_range is not None else (0, self.vocab_size)
        try:
            if not 0 <= start < end <= self.vocab_size:
                raise ValueError(f"vocabulary shard [{start}, {end}) is outside [0, {self.vocab_size})")
            if weight.shape[1] != self._centroids.shape[1]:
                raise ValueError(
                    f"centroids have hidden size {self._centroids.shape[1]}, the head has {weight.shape[1]}"
                )
            # One copy in stage 1's layout, shared by the head and this rank's share (`layout.py`).
            centroids = hidden_major(self._centroids.to(device=weight.device, dtype=weight.dtype))
            if shard is not None:  # first, so that this rank still scores its share if the head fails below
                self.stage1 = ShardStage1(centroids, *shard)
            self.head = FlashHead.from_settings(
                weight,
                centroids,
                self._assignments[start:end].to(device=weight.device),
                settings=self.settings,
                vocab_size=end - start,
                allow_empty_clusters=vocab_range is not None,
                tail_factors=self._tail_factors,
            )
            self.vocab_range = vocab_range
            self._pins = PinnedRows(self.pinned_ids, (start, end))
        except Exception as exc:  # noqa: BLE001
            self.make_unavailable("build_failed", f"FlashHead could not be built: {exc}")
        finally:
            self._centroids = self._assignments = None
        if self.head is not None:
            logger.info(
                "my_pkg: FlashHead active: %d clusters of %d, n_probes=%d, backend=%s",
                self.head.num_clusters,
                self.head.cluster_size,
                self.head.n_probes,
                self.head.backend,
            )

    def measure_costs(self, dense: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Time this head's steps beside `dense` (vLLM's product for the head) at batches of 1, 2, 4, ...
        rows, and the masked way (the dense product masked to FlashHead's answer), `my_pkg.flashhead.step_costs`:
        the prior from which `ways` chooses each step's way (both give every row the same answer). Only when
        the environment sets no `MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD`, on a CPU head (the host clock times a
        CPU step, not an accelerator's). Under tensor parallelism each rank times and chooses for its own part
        alone (the ways differ in cost only, so the ranks need not agree). Never raises: a failed measurement
        leaves FlashHead's kernels on every step, logged."""
        head = self.head
        if not self.settings.measure_step_costs or head is None:
            return
        if head.weight.device.type != "cpu":
            return
        self._timed(
            lambda step: measure_step_costs(
                step,
                dense,
                int(head.weight.shape[1]),
                dtype=head.weight.dtype,
                sampled_rows=self.settings.probe_sampling,
                masked_step=self._masked_step(dense),
            )
        )

    def _timed(self, measure: Callable[[Callable[[torch.Tensor, np.ndarray], torch.Tensor]], StepCosts]) -> None:
        """`step_costs = measure(step)`, `step` being this head's decode step as `compute_logits` runs it
        (pinned ids included); on any failure no costs (FlashHead's kernels on every step), logged."""
        try:
            with torch.inference_mode():
                self.step_costs = measure(self._head_step())
        except Exception as exc:  # noqa: BLE001 - without a measurement FlashHead's kernels serve every step
            self.step_costs = None
            logger.warning(
                "my_pkg: FlashHead could not time its steps beside the dense head (%s: %s)", type(exc).__name__, exc
            )
            return
        self.ways = StepWays(self.step_costs)
        report = self._step_costs_report()
        assert report is not None
        log_step_costs(self.step_costs, report)

    def _own_probes(self) -> Callable[[torch.Tensor], torch.Tensor | None]:
        """A step's probes without an exchange: None (the head's own stage 1), or under tensor parallelism this rank's
        best clusters of its share, merged as the exchanged ones are (without the other ranks' keys)."""
        head, stage1, width = self.head, self.stage1, self._keys_width()
        assert head is not None

        def probes(hidden: torch.Tensor) -> torch.Tensor | None:
            if stage1 is None or width is None:
                return None
            return merge_probes(stage1.keys(hidden, width), width, head.num_clusters)

        return probes

    def _head_step(self) -> Callable[[torch.Tensor, np.ndarray], torch.Tensor]:
        """This head's decode step on `(hidden, sampled)` as `compute_logits` runs it, pinned ids included (the
        step's stop ids and the model's logit scale aside): what the warm-up runs and the timing times. Under
        tensor parallelism stage 1 is this rank's share (`_own_probes`)."""
        head, pins, probes = self.head, self._pins, self._own_probes()
        assert head is not None
        pinned = pins.get((), head.weight) if pins is not None else None

        def step(hidden: torch.Tensor, sampled: np.ndarray) -> torch.Tensor:
            sampled_rows = sampled if self.settings.probe_sampling else None
            logits = head.step_logits(hidden, sampled=sampled_rows, probes=probes(hidden))
            if pins is not None:
                pins.score(logits, hidden, pinned, lambda x: x)
            return logits

        return step

    def _masked_step(
        self, dense: Callable[[torch.Tensor], torch.Tensor]
    ) -> Callable[[torch.Tensor, np.ndarray], torch.Tensor]:
        """The masked way's step on `(hidden, sampled)` as `compute_logits` runs it: `dense` (vLLM's product for the
        head), then every row masked to FlashHead's answer (`FlashHead.masked_logits`)."""
        head, pins, probes = self.head, self._pins, self._own_probes()
        assert head is not None
        pinned = pins.get((), head.weight) if pins is not None else None

        def step(hidden: torch.Tensor, sampled: np.ndarray) -> torch.Tensor:
            return masked_logits(
                head,
                hidden,
                dense(hidden),
                sampled=sampled if self.settings.probe_sampling else None,
                pinned=pinned[0] if pinned is not None else None,
                probes=probes(hidden),
            )

        return step

    def warm_up(self, hidden: torch.Tensor) -> None:
        """Run the head once on `hidden[:2]`, greedy and sampled, so that kernels are compiled and the
        sampled rows' tables built before the first request; a head that fails here is dropped and the
        model stays dense."""
        if self.head is None:
            return
        rows = hidden[:2].detach()
        try:
            step = self._head_step()
            for sampled in (False, True) if self.settings.probe_sampling else (False,):
                step(rows, np.full(rows.shape[0], sampled))
        except Exception as exc:  # noqa: BLE001
            self.head = None
            self.make_unavailable("warm_up_failed", f"FlashHead failed its warm-up step: {type(exc).__name__}: {exc}")
            return
        logger.info("my_pkg: FlashHead extra memory %.1f MiB", self.extra_memory_bytes / 2**20)

    @property
    def extra_memory_bytes(self) -> int | None:
        """Device bytes FlashHead holds beyond vLLM's head weight: centroids, cluster map, the sampled
        rows' tables once built (at `prepare`) and the pinned ids' cached weight rows."""
        if self.head is None:
            return None
        return int(self.head.extra_memory_bytes + (self._pins.nbytes if self._pins is not None else 0))

    def _worker_extra_memory_bytes(self) -> int | None:
        """`extra_memory_bytes` of this head and of the drafter's FlashHead head linked to it (an EAGLE head's
        is a second head over the same weight, a draft model's one over its own), as the status reports it."""
        own = self.extra_memory_bytes
        drafter = self.draft.extra_memory_bytes if self.draft is not None else None
        if drafter is None:
            return own
        shared = self.head is not None and self.draft.head is not None and self.head.cluster_rows is not None
        if shared and self.draft.head.cluster_rows is self.head.cluster_rows:  # one copy for both heads
            drafter -= self.head.cluster_rows.nbytes
        return (own or 0) + drafter

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
        """Keys each rank sends per row in the stage-1 exchange of an armed step of `num_rows` rows, or None when the
        step exchanges nothing (`exchange.exchange_width`). Read from the settings, the agreed availability and the
        step's size only, which every rank holds alike (the admin API updates all ranks between steps), never from
        this rank's head, timing or rows: all ranks or none reach the collective, with the same shape."""
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
        """Logits `[rows, vocab]` for one decode step, without making the host wait for the device.

        `dense` computes vLLM's own logits for some rows; `postprocess` applies
        the model's logit scale/soft-cap to the finite logits FlashHead makes. Under tensor
        parallelism `exchanged` (`[rows, tp * width]`) holds every rank's `stage1_payload` of this step:
        the FlashHead rows probe the best of them (`merge_probes`), as the full stage 1 would.
        """
        num_rows = hidden.shape[0]
        self.counters.steps += 1
        if rows.all_dense is not None:
            return self._all_dense(hidden, dense, rows.all_dense)
        if rows.num_rows != num_rows:
            return self._all_dense(hidden, dense, "unexpected_rows")
        if not self.settings.enabled:
            return self._all_dense(hidden, dense, "disabled")
        if self.head is None:
            return self._all_dense(hidden, dense, "unavailable")
        threshold = self.settings.dense_batch_threshold
        if threshold is not None and num_rows > threshold:
            return self._all_dense(hidden, dense, "batch_threshold")
        if self.stage1 is not None and exchanged is None:  # the exchange did not happen on this rank
            return self._all_dense(hidden, dense, "error")
        dense_rows = np.flatnonzero(rows.dense_codes)
        if dense_rows.size:
            reasons = np.bincount(rows.dense_codes[dense_rows])
            for code in np.flatnonzero(reasons):
                self.counters.rows_dense[DenseReason(code).label] += int(reasons[code])
        if dense_rows.size == num_rows:
            return dense(hidden)

        timed = self.ways.timed
        started = time.perf_counter() if timed else 0.0
        flash_hidden, sampled, flash_index, flash_rows = hidden, rows.sampled, None, None
        if dense_rows.size:  # FlashHead's answer only for the rows FlashHead serves
            flash_rows = np.flatnonzero(rows.dense_codes == 0)
            flash_index = index_tensor(flash_rows, hidden.device)
            flash_hidden, sampled = hidden.index_select(0, flash_index), sampled[flash_rows]
        probes = None
        if exchanged is not None:
            keys = exchanged if flash_index is None else exchanged.index_select(0, flash_index)
            width = self._keys_width()
            if width is None:
                raise RuntimeError("keys were exchanged on a step without a stage-1 exchange")
            probes = merge_probes(keys, width, self.head.num_clusters)
        num_sampled = int(np.count_nonzero(sampled)) if self.settings.probe_sampling else 0
        num_flash = num_rows - int(dense_rows.size)
        way = self.ways.choose(
            num_flash - num_sampled, num_sampled, int(dense_rows.size), check_every=self._checked_every()
        )
        assert self._pins is not None
        pins = self._pins.get(rows.stop_ids, self.head.weight)
        rows_sampled = sampled if self.settings.probe_sampling else None
        if way == "masked":
            # What FlashHead's kernels would give every FlashHead row, made from the dense product of the step.
            logits = dense(hidden)
            part = logits if flash_index is None else logits.index_select(0, flash_index)
            masked = masked_logits(
                self.head,
                flash_hidden,
                part,
                sampled=rows_sampled,
                pinned=pins[0] if pins is not None else None,
                postprocess=postprocess,
                probes=probes,
            )
            if self.vocab_range is None:  # the live fidelity check against the dense logits already at hand
                self._fidelity.check(
                    self.settings.fidelity_every,
                    flash_hidden,
                    masked,
                    None,
                    lambda rows: part[: rows.shape[0]],
                    sampled,
                )
            logits = masked if flash_index is None else logits.index_copy_(0, flash_index, masked.to(logits.dtype))
            self.counters.rows_flashhead_masked += num_flash
        else:
            token = self._timer.start(hidden.device)
            # What vLLM's sampler gets (the eval scores the same rows with `step_logits(pinned=...)`): candidates,
            # estimated logits for sampled rows, then every pinned id (EOS, specials, the step's stop ids) exact.
            flash_logits = self.head.step_logits(
                flash_hidden, sampled=rows_sampled, postprocess=postprocess, probes=probes
            )
            self._pins.score(flash_logits, flash_hidden, pins, postprocess)
            if flash_index is None:
                logits = flash_logits
            else:
                logits = torch.empty((num_rows, self.head.vocab_size), dtype=flash_logits.dtype, device=hidden.device)
                logits.index_copy_(0, flash_index, flash_logits)
            self._timer.stop(token)
            if self.vocab_range is None:  # a shard's best token says nothing of the row's
                self._fidelity.check(self.settings.fidelity_every, flash_hidden, logits, flash_index, dense, sampled)
            if dense_rows.size:
                index = index_tensor(dense_rows, hidden.device)
                logits[index] = dense(hidden.index_select(0, index)).to(logits.dtype)
        if rows.verify_rows is not None:
            self.counters.rows_flashhead_verify += int(np.count_nonzero(rows.dense_codes[rows.verify_rows] == 0))
        self.counters.rows_flashhead += num_flash
        self.recent.add(num_flash - num_sampled, num_sampled, int(dense_rows.size), num_flash if way == "masked" else 0)
        if timed:
            self.ways.observe(
                num_flash - num_sampled, num_sampled, int(dense_rows.size), way, time.perf_counter() - started
            )
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
        self.counters.fallbacks += 1
        self.counters.rows_dense["error"] += num_rows
        kind = type(exc).__name__
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(
                "my_pkg: FlashHead step failed, served dense instead (%s: %s); further %s failures are only counted",
                kind,
                exc,
                kind,
                exc_info=exc,
            )

    # ---- control ---------------------------------------------------------------------------

    def status(self) -> FlashHeadState:
        """The status reply; never waits for the device (work still running is counted by a later call)."""
        self._timer.collect(block=False)
        self._fidelity.collect()
        head = self.head
        active = head is not None and self.settings.enabled
        sampled_n_probes, sampled_rank = self._sampled_status()
        code: ReasonCode | None
        if active:
            code, reason = None, None
        elif not self.available:
            code, reason = self.unavailable_code, self.unavailable_reason
        elif not self.settings.enabled:
            code, reason = "disabled", DISABLED_REASON
        else:
            code, reason = "not_built", NOT_BUILT_REASON
        return FlashHeadState(
            available=self.available,
            active=active,
            reason=reason,
            reason_code=code,
            enabled=self.settings.enabled,
            num_clusters=self.num_clusters,
            cluster_size=self.cluster_size,
            vocab_size=self.vocab_size,
            n_probes=self.settings.n_probes,
            dense_batch_threshold=self.settings.dense_batch_threshold,
            probe_sampling=self.settings.probe_sampling,
            sampled_n_probes=sampled_n_probes,
            sampled_rank=sampled_rank,
            sampled_rescore=head.sampled_rescore if head is not None and self.settings.probe_sampling else None,
            sampled_estimate=sampled_estimate(head, self.settings.probe_sampling),
            pinned_token_ids=list(self.pinned_ids),
            fidelity_every=self.settings.fidelity_every,
            backend=head.backend if head is not None else None,
            extra_memory_bytes=self._worker_extra_memory_bytes(),
            step_costs=self._step_costs_report(),
            counters=self.counters.snapshot(self.draft.counters if self.draft is not None else None),
            recent=self.recent.report(),
            spec=effective_spec(self._spec_with_draft(), active),
        )

    def _step_costs_report(self) -> StepCostsReport | None:
        return step_costs_report(self.step_costs, self.ways.report(), self._checked_every())

    def _spec_with_draft(self) -> SpecState | None:
        """`spec` with the drafter's probe count when FlashHead serves the drafter's head."""
        if self.spec is None or self.draft is None:
            return self.spec
        return self.spec.model_copy(update={"draft_n_probes": self.draft.settings.n_probes})

    def _sampled_status(self) -> tuple[int | None, int | None]:
        """`(sampled_n_probes, sampled_rank)` as served: the head's once built, else its spec
        (`HeadSpec.resolve` over the whole vocabulary) while the assets are held, else the settings'."""
        settings, clusters, head = self.settings, self.num_clusters, self.head
        if head is not None:
            rank = head.sampled_rank
        elif self._centroids is not None:
            fitted_rank = self._tail_factors.rank if self._tail_factors is not None else 0
            hidden_size = int(self._centroids.shape[1])
            spec = HeadSpec.resolve(
                settings,
                num_clusters=clusters,
                vocab_size=self.vocab_size,
                hidden_size=hidden_size,
                fitted_rank=fitted_rank,
            )
            return spec.sampled_n_probes, spec.sampled_rank
        else:
            rank = settings.sampled_rank
        if clusters is None:
            return settings.sampled_n_probes, rank
        if not settings.probe_sampling:
            return min(settings.n_probes, clusters), rank
        if head is not None:
            return head.sampled_n_probes, rank
        return resolve_sampled_n_probes(settings.sampled_n_probes, settings.n_probes, clusters, rank or 0), rank

    def validate(self, update: FlashHeadUpdate) -> list[str]:
        """What the served model refuses in `update` (the contract has checked its fields and types):
        FlashHead must be available, `n_probes` at most the number of clusters, and `draft_n_probes` needs
        a FlashHead drafter (`draft`) and at most its clusters."""
        update = _as_update(update)
        if not self.available:
            return [f"FlashHead is not available on this model: {self.unavailable_reason}"]
        if update.n_probes is not None and self.num_clusters is not None and update.n_probes > self.num_clusters:
            return [f"n_probes must be <= the number of clusters ({self.num_clusters})"]
        if update.draft_n_probes is not None:
            if self.draft is None:
                part = self.spec.draft.reason_code if self.spec is not None else "no speculative decoding"
                return [f"draft_n_probes: FlashHead does not serve the drafter's head on this model ({part})"]
            clusters = self.draft.num_clusters
            if clusters is not None and update.draft_n_probes > clusters:
                return [f"draft_n_probes must be <= the draft model's number of clusters ({clusters})"]
        return []

    def apply(self, update: FlashHeadUpdate) -> None:
        """Apply an update that `validate` accepted; effective from the next step. `draft_n_probes` is the
        drafter's `n_probes`; `enabled` and `dense_batch_threshold` apply to the drafter's head too."""
        update = _as_update(update)
        for name in update.model_fields_set - {"draft_n_probes"}:
            setattr(self.settings, name, getattr(update, name))
        if update.n_probes is not None and self.head is not None:
            self.head.n_probes = update.n_probes
            self.ways.forget_kernels()  # served steps time the new probe count; nothing is timed here
        draft = self.draft
        if draft is not None:  # the drafter's head: its own probe count, the target's switch and threshold
            for name in ("enabled", "dense_batch_threshold"):
                if name in update.model_fields_set:
                    setattr(draft.settings, name, getattr(update, name))
            if update.draft_n_probes is not None:
                draft.settings.n_probes = update.draft_n_probes
                if draft.head is not None:
                    draft.head.n_probes = update.draft_n_probes
                    draft.ways.forget_kernels()
        logger.info(
            "my_pkg: FlashHead settings now %s%s",
            asdict(self.settings),
            f", draft_n_probes={draft.settings.n_probes}" if draft is not None else "",
        )


def _as_update(update: FlashHeadUpdate | dict[str, Any]) -> FlashHeadUpdate:
    """The contract model; a plain mapping (an older caller) is validated into it."""
    return update if isinstance(update, FlashHeadUpdate) else FlashHeadUpdate.model_validate(update)
