"""The FlashHead controller: one model's FlashHead in one worker, through a decode step and the admin API.

One `FlashHeadController` hangs off the logits processor of a model that ships
FlashHead assets (see `patches/logits_processor.py`); the worker methods in
`rpc.py` find it through the model, so two engines in one process never share
state. Its parts live beside it: which rows a step may serve
(`request_rows.py`), the settings (`flashhead_settings.py`) and the counters
(`flashhead_counters.py`). This module imports torch and numpy only; vLLM
objects reach it as plain arguments.

A decode step walks through `compute_logits`: the model runner announces the
rows of the step (`StepRows`: which rows must stay dense and why, which rows
are sampled); every row that may use FlashHead gets `FlashHead.step_logits`:
its candidates' exact logits and -inf elsewhere (greedy rows), or estimated
logits elsewhere (sampled rows), so vLLM's own sampler (temperature, top-k/p,
min-p, penalties) runs unchanged on them; rows that asked for logprobs, a
grammar, a logit bias, allowed or bad words get exact dense logits.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from my_pkg.engine.flashhead_counters import FlashHeadCounters, HeadTimer
from my_pkg.engine.flashhead_settings import UPDATE_FIELDS, default_settings
from my_pkg.engine.request_rows import DenseReason, StepRows
from my_pkg.flashhead.staging import index_tensor

logger = logging.getLogger(f"vllm.{__name__}")


class FlashHeadController:
    """FlashHead for one model in one worker.

    Built in two steps: `__init__` reads the assets (small: centroids and the
    cluster map) while the model is constructed; `bind()` attaches them to the
    head weight vLLM loaded, on the first logits call, without copying it.
    """

    def __init__(
        self,
        *,
        centroids: torch.Tensor | None,
        assignments: torch.Tensor | None,
        config: dict[str, Any],
        vocab_size: int,
        unavailable_reason: str | None = None,
        unavailable_code: str | None = None,
        pinned_ids: list[int] | tuple[int, ...] = (),
    ) -> None:
        self.vocab_size = vocab_size
        #: Scored exactly on every FlashHead row: EOS and special tokens (see `stop_and_special_token_ids`).
        self.pinned_ids = tuple(sorted({int(i) for i in pinned_ids if 0 <= int(i) < vocab_size}))
        self._pinned: tuple[Any, torch.Tensor | None] | None = None  # ((stop ids, device), ids)
        self._fidelity_credit = 0
        self._fidelity_agreed: torch.Tensor | None = None  # on the device: no host sync per check
        self._fidelity_rows_pending = 0  # rows checked into `_fidelity_agreed`, not yet in the counters
        self._fidelity_ready: Any = None  # CUDA event recorded after the last check
        self.counters = FlashHeadCounters()
        self._timer = HeadTimer(self.counters)
        self._step_source: Callable[[], StepRows | None] | None = None
        self._warned: set[str] = set()
        self.head: Any = None
        self.vocab_range: tuple[int, int] | None = None  # this rank's vocabulary shard under tensor parallelism
        self._centroids = centroids
        self._assignments = assignments
        self.unavailable_reason = unavailable_reason
        self.unavailable_code = (unavailable_code or "unavailable") if unavailable_reason else None
        if unavailable_reason is None and (centroids is None or assignments is None):
            self.unavailable_reason, self.unavailable_code = "no FlashHead assets", "no_assets"
        if self.unavailable_reason is None and int(assignments.shape[0]) != vocab_size:
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
        cls, model_dir: str | None, config: dict[str, Any], *, vocab_size: int,
        unavailable_reason: str | None = None, unavailable_code: str | None = None,
    ) -> "FlashHeadController":
        """Read the assets named by config.json; a failure leaves the controller unavailable."""
        centroids = assignments = None
        pinned_ids: list[int] = []
        if unavailable_reason is None:
            try:
                from my_pkg.flashhead.assets import load_assets, stop_and_special_token_ids

                if model_dir is None:
                    raise FileNotFoundError("the model directory could not be resolved")
                centroids, assignments = load_assets(Path(model_dir), config)
                pinned_ids = stop_and_special_token_ids(model_dir, config)
            except Exception as exc:  # noqa: BLE001 - bad assets mean dense, never a crash
                unavailable_reason = f"FlashHead assets could not be loaded: {exc}"
                unavailable_code = "assets_invalid"
        return cls(
            centroids=centroids, assignments=assignments, config=config, vocab_size=vocab_size,
            unavailable_reason=unavailable_reason, unavailable_code=unavailable_code,
            pinned_ids=pinned_ids,
        )

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        return self.unavailable_reason is None

    def bind(self, weight: torch.Tensor, vocab_range: tuple[int, int] | None = None) -> None:
        """Build the head over `weight` (the loaded LM head, shared, not copied).

        Under tensor parallelism `weight` is this rank's shard of vLLM's vocab-parallel head, whose
        rows are the tokens `vocab_range = (start, end)`: the head scores only the candidates in that
        range (the probes are the same on every rank: the centroids are global), and its logits are
        this shard's columns, which vLLM's gather puts together.
        """
        if self.head is not None or not self.available:
            return
        from my_pkg.flashhead.head import FlashHead

        assert self._centroids is not None and self._assignments is not None
        start, end = vocab_range if vocab_range is not None else (0, self.vocab_size)
        try:
            if not 0 <= start < end <= self.vocab_size:
                raise ValueError(f"vocabulary shard [{start}, {end}) is outside [0, {self.vocab_size})")
            if weight.shape[1] != self._centroids.shape[1]:
                raise ValueError(
                    f"centroids have hidden size {self._centroids.shape[1]}, "
                    f"the head has {weight.shape[1]}"
                )
            self.head = FlashHead(
                weight,
                self._centroids.to(device=weight.device, dtype=weight.dtype),
                self._assignments[start:end].to(device=weight.device),
                vocab_size=end - start,
                allow_empty_clusters=vocab_range is not None,
                n_probes=self.settings.n_probes,
                backend=self.settings.backend,
                sampled_n_probes=self.settings.sampled_n_probes,
                sampled_rank=self._sampled_rank(weight.shape[1]),
            )
            self.vocab_range = vocab_range
        except Exception as exc:  # noqa: BLE001
            self.unavailable_reason = f"FlashHead could not be built: {exc}"
            self.unavailable_code = "build_failed"
            logger.warning("my_pkg: FlashHead not active, dense head in use: %s", self.unavailable_reason)
        finally:
            self._centroids = self._assignments = None
        if self.head is not None:
            logger.info(
                "my_pkg: FlashHead active: %d clusters of %d, n_probes=%d, backend=%s, "
                "extra memory %.1f MiB",
                self.head.num_clusters, self.head.cluster_size, self.head.n_probes,
                self.head.backend, self.head.extra_memory_bytes / 2**20,
            )

    def warm_up(self, hidden: torch.Tensor) -> None:
        """Run the head once on `hidden` (vLLM's warm-up rows), greedy and sampled, so that kernels are
        compiled and the sampled rows' tables built before the first request; a head that fails here
        is dropped and the model stays dense."""
        if self.head is None:
            return
        rows = hidden[:2].detach()
        try:
            pins = self._step_pins((), hidden.device)
            for sampled in (False, True) if self.settings.probe_sampling else (False,):
                self.head.step_logits(rows, sampled=np.full(rows.shape[0], sampled), pinned=pins)
        except Exception as exc:  # noqa: BLE001
            self.head = None
            self.make_unavailable("warm_up_failed", f"FlashHead failed its warm-up step: {type(exc).__name__}: {exc}")

    def make_unavailable(self, code: str, reason: str) -> None:
        if self.unavailable_reason is None:
            self.unavailable_reason, self.unavailable_code = reason, code
            logger.warning("my_pkg: FlashHead not active, dense head in use: %s", reason)

    # ---- one decode step -------------------------------------------------------------------

    def arm(self, source: Callable[[], StepRows | None]) -> None:
        """Announce that the next logits call is a decode step whose rows `source` describes."""
        self._step_source = source

    def disarm(self) -> None:
        self._step_source = None

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

    def compute_logits(
        self,
        hidden: torch.Tensor,
        rows: StepRows,
        dense: Callable[[torch.Tensor], torch.Tensor],
        postprocess: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Logits `[rows, vocab]` for one decode step.

        `dense` computes vLLM's own logits for some rows; `postprocess` applies
        the model's logit scale/soft-cap to the finite logits FlashHead makes.
        """
        num_rows = hidden.shape[0]
        self.counters.steps += 1
        if rows.num_rows != num_rows:
            return self._all_dense(hidden, dense, "unexpected_rows")
        if not self.settings.enabled:
            return self._all_dense(hidden, dense, "disabled")
        if self.head is None:
            return self._all_dense(hidden, dense, "unavailable")
        threshold = self.settings.dense_batch_threshold
        if threshold is not None and num_rows > threshold:
            return self._all_dense(hidden, dense, "batch_threshold")
        dense_rows = np.flatnonzero(rows.dense_codes)
        if dense_rows.size:
            reasons = np.bincount(rows.dense_codes[dense_rows], minlength=max(DenseReason) + 1)
            for code in np.flatnonzero(reasons):
                self.counters.rows_dense[DenseReason(code).label] += int(reasons[code])
        if dense_rows.size == num_rows:
            return dense(hidden)

        token = self._timer.start(hidden.device)
        flash_hidden, sampled, flash_index = hidden, rows.sampled, None
        if dense_rows.size:  # score candidates only for the rows FlashHead serves
            flash_rows = np.flatnonzero(rows.dense_codes == 0)
            flash_index = index_tensor(flash_rows, hidden.device)
            flash_hidden, sampled = hidden.index_select(0, flash_index), sampled[flash_rows]
        # The head builds exactly what vLLM's sampler gets (the eval measures the same call):
        # candidates, estimated logits for sampled rows, and EOS/special/stop ids on every row.
        flash_logits = self.head.step_logits(
            flash_hidden,
            sampled=sampled if self.settings.probe_sampling else None,
            pinned=self._step_pins(rows.stop_ids, hidden.device),
            postprocess=postprocess,
        )
        if flash_index is None:
            logits = flash_logits
        else:
            logits = torch.empty((num_rows, self.head.vocab_size), dtype=flash_logits.dtype, device=hidden.device)
            logits.index_copy_(0, flash_index, flash_logits)
        self._timer.stop(token)
        self._check_fidelity(flash_hidden, logits, flash_index, dense)
        if dense_rows.size:
            index = index_tensor(dense_rows, hidden.device)
            logits[index] = dense(hidden.index_select(0, index)).to(logits.dtype)
        self.counters.rows_flashhead += num_rows - int(dense_rows.size)
        return logits

    def _check_fidelity(
        self,
        flash_hidden: torch.Tensor,
        logits: torch.Tensor,
        flash_index: torch.Tensor | None,
        dense: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """Live fidelity telemetry: for one FlashHead row in `fidelity_every`, also compute
        the dense logits and count whether FlashHead's best token is a dense argmax (ties agree).
        Off on a vocabulary shard (tensor parallelism): a shard's best token says nothing of the row's."""
        every = self.settings.fidelity_every
        if every <= 0 or self.vocab_range is not None:
            return
        self._fidelity_credit += int(flash_hidden.shape[0])
        checks = min(int(flash_hidden.shape[0]), self._fidelity_credit // every)
        if checks <= 0:
            return
        self._fidelity_credit -= checks * every
        reference = dense(flash_hidden[:checks]).float()
        served = logits[:checks] if flash_index is None else logits.index_select(0, flash_index[:checks])
        picked = reference.gather(1, served.argmax(dim=1, keepdim=True)).squeeze(1)
        agreed = (picked >= reference.max(dim=1).values).sum()
        self._fidelity_agreed = agreed if self._fidelity_agreed is None else self._fidelity_agreed + agreed
        self._fidelity_rows_pending += checks
        if agreed.is_cuda:  # `status` reads the sum once this event says the device got there
            self._fidelity_ready = torch.cuda.Event()
            self._fidelity_ready.record()

    def _collect_fidelity(self) -> None:
        """Move the checks the device has finished into the counters, without waiting for it."""
        if self._fidelity_agreed is None or (self._fidelity_ready is not None and not self._fidelity_ready.query()):
            return
        self.counters.fidelity_agreed += int(self._fidelity_agreed)
        self.counters.fidelity_rows += self._fidelity_rows_pending
        self._fidelity_agreed, self._fidelity_ready, self._fidelity_rows_pending = None, None, 0

    def _step_pins(self, stop_ids: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
        """Token ids scored exactly in this step, on `device`; None when there are none.

        Built once per distinct set of stop ids (the same requests share many
        steps), so a step copies nothing to the device.
        """
        key = (stop_ids, device)
        if self._pinned is None or self._pinned[0] != key:
            start, end = self.vocab_range or (0, self.vocab_size)
            ids = sorted(i - start for i in set(self.pinned_ids).union(stop_ids) if start <= i < end)
            self._pinned = (key, torch.tensor(ids, dtype=torch.long, device=device) if ids else None)
        return self._pinned[1]

    def _all_dense(self, hidden: torch.Tensor, dense: Callable[[torch.Tensor], torch.Tensor], reason: str) -> torch.Tensor:
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
                "my_pkg: FlashHead step failed, served dense instead (%s: %s); "
                "further %s failures are only counted", kind, exc, kind, exc_info=exc,
            )

    # ---- control ---------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The status reply; never waits for the device (work still running is counted by a later call)."""
        self._timer.collect(block=False)
        self._collect_fidelity()
        head = self.head
        active = head is not None and self.settings.enabled
        if active:
            code, reason = None, None
        elif not self.available:
            code, reason = self.unavailable_code, self.unavailable_reason
        elif not self.settings.enabled:
            code, reason = "disabled", "disabled (MY_PKG_FLASHHEAD=0 or PUT enabled=false)"
        else:
            code, reason = "not_built", "not built yet (built at vLLM's warm-up, or on the first logits call)"
        return {
            "available": self.available,
            "active": active,
            "reason": reason,
            "reason_code": code,
            "enabled": self.settings.enabled,
            "num_clusters": self.num_clusters,
            "cluster_size": self.cluster_size,
            "vocab_size": self.vocab_size,
            "n_probes": self.settings.n_probes,
            "dense_batch_threshold": self.settings.dense_batch_threshold,
            "probe_sampling": self.settings.probe_sampling,
            "sampled_n_probes": self._sampled_n_probes(),
            "sampled_rank": self._status_sampled_rank(),
            "pinned_token_ids": list(self.pinned_ids),
            "fidelity_every": self.settings.fidelity_every,
            "backend": head.backend if head is not None else None,
            "extra_memory_bytes": head.extra_memory_bytes if head is not None else None,
            "counters": self.counters.snapshot(),
        }

    def _sampled_rank(self, hidden_size: int) -> int:
        """The configured rank, at most the hidden size (the head refuses more)."""
        from my_pkg.flashhead.tail_estimate import default_tail_rank

        rank = self.settings.sampled_rank
        return default_tail_rank(hidden_size) if rank is None else min(rank, hidden_size)

    def _status_sampled_rank(self) -> int | None:
        if self.head is not None:
            return self.head.sampled_rank
        if self._centroids is not None:
            return self._sampled_rank(int(self._centroids.shape[1]))
        return self.settings.sampled_rank

    def _sampled_n_probes(self) -> int | None:
        """Clusters a sampled row probes now (the head's rule when not set)."""
        if self.head is not None:
            return self.head.sampled_n_probes
        if self.settings.sampled_n_probes is not None or self.num_clusters is None:
            return self.settings.sampled_n_probes
        from my_pkg.flashhead.head import default_sampled_n_probes

        return default_sampled_n_probes(self.settings.n_probes, self.num_clusters)

    def validate(self, update: dict[str, Any]) -> list[str]:
        errors = [f"unknown field {name!r}" for name in update if name not in UPDATE_FIELDS]
        if not self.available:
            errors.append(f"FlashHead is not available on this model: {self.unavailable_reason}")
            return errors
        if "enabled" in update and not isinstance(update["enabled"], bool):
            errors.append("enabled must be true or false")
        if "n_probes" in update:
            n_probes = update["n_probes"]
            if not isinstance(n_probes, int) or isinstance(n_probes, bool) or n_probes < 1:
                errors.append("n_probes must be an integer >= 1")
            elif n_probes > self.num_clusters:
                errors.append(f"n_probes must be <= the number of clusters ({self.num_clusters})")
        if "dense_batch_threshold" in update:
            threshold = update["dense_batch_threshold"]
            if threshold is not None and (not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0):
                errors.append("dense_batch_threshold must be an integer >= 0, or null (never)")
        return errors

    def apply(self, update: dict[str, Any]) -> None:
        """Apply an update that `validate` accepted; effective from the next step."""
        for name in UPDATE_FIELDS:
            if name in update:
                setattr(self.settings, name, update[name])
        if "n_probes" in update and self.head is not None:
            self.head.n_probes = update["n_probes"]
        logger.info("my_pkg: FlashHead settings now %s", asdict(self.settings))


NO_ASSETS_REASON = "the model has no FlashHead assets (no flash_head_cache_dir in config.json)"


def status_without_controller(code: str = "no_assets", reason: str = NO_ASSETS_REASON) -> dict[str, Any]:
    """Status of a worker whose model has no FlashHead controller, for `reason`."""
    return {
        "available": False,
        "active": False,
        "reason": reason,
        "reason_code": code,
        "enabled": False,
        "num_clusters": None,
        "cluster_size": None,
        "vocab_size": None,
        "n_probes": None,
        "dense_batch_threshold": None,
        "probe_sampling": None,
        "sampled_n_probes": None,
        "sampled_rank": None,
        "backend": None,
        "extra_memory_bytes": None,
        "counters": FlashHeadCounters().snapshot(),
    }


_NOT_FOUND = object()


def controller_of_runner(runner: Any) -> FlashHeadController | None:
    """The controller of the model `runner` runs; looked up once the model is loaded."""
    cached = runner.__dict__.get("_my_pkg_flashhead", _NOT_FOUND)
    if cached is not _NOT_FOUND:
        return cached
    if runner.__dict__.get("model") is None:
        return None
    get_model = getattr(runner, "get_model", None)
    model = get_model() if callable(get_model) else runner.model  # unwraps CUDA-graph wrappers
    found = None
    for module in model.modules():
        controller = getattr(module, "_my_pkg_flashhead", None)
        if isinstance(controller, FlashHeadController):
            found = controller
            break
    runner._my_pkg_flashhead = found
    return found


def find_controller(worker: Any) -> FlashHeadController | None:
    """The FlashHead controller of the model this worker runs, if any."""
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        return None
    return controller_of_runner(runner)
