"""Per-model FlashHead state inside one worker: settings, counters, the head itself.

One `FlashHeadController` hangs off the logits processor of a model that ships
FlashHead assets (see `patches/logits_processor.py`); the worker methods in
`rpc.py` find it through the model, so two engines in one process never share
state. This module imports torch and numpy only; vLLM objects reach it as
plain arguments.

A decode step walks through `compute_logits`: the model runner announces the
rows of the step (`StepRows`: which rows must stay dense and why, which rows
are sampled); every row that may use FlashHead gets its candidates' exact
logits and -inf elsewhere, so vLLM's own sampler (temperature, top-k/p, min-p,
penalties) runs unchanged on them; rows that asked for logprobs, a grammar,
a logit bias, allowed or bad words get exact dense logits.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from my_pkg.env import env_flag, env_int

logger = logging.getLogger(f"vllm.{__name__}")

# Why a row is served by the dense head. Codes index this tuple; 0 means "FlashHead ok".
REQUEST_DENSE_REASONS = (
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
)
_REASON_BY_CODE = ("",) + REQUEST_DENSE_REASONS
DENSE_CODE = {name: code for code, name in enumerate(_REASON_BY_CODE) if name}

DEFAULT_DENSE_BATCH_THRESHOLD_CPU = 16  # bench/serve.py, 2-core CPU: 1.35x at 8 rows, 0.98x at 32
DEFAULT_DENSE_BATCH_THRESHOLD_GPU = 64  # not measured yet: rerun bench/serve.py on a GPU
UPDATE_FIELDS = ("enabled", "n_probes", "dense_batch_threshold")
DEFAULT_FIDELITY_EVERY = 100  # 1% of FlashHead rows also get the dense argmax (live fidelity telemetry)

#: `SamplingParams` fields that need exact dense logits when a request sets them, checked in this order.
DENSE_REQUEST_FIELDS = {
    "logprobs": "logprobs",
    "logprob_token_ids": "logprobs",
    "structured_outputs": "structured_output",
    "logit_bias": "logit_bias",
    "allowed_token_ids": "allowed_token_ids",
    "bad_words": "bad_words",
    "thinking_token_budget": "thinking_budget",
    "watermarking": "watermark",
}
#: `SamplingParams` fields FlashHead serves as they are: vLLM's sampler, penalties and stop
#: handling run on the candidates' exact logits, or the field does not touch logits at all.
#: Prompt logprobs come from a separate logits call over the prompt, which is always dense:
#: the request's generated tokens can still use FlashHead.
FLASHHEAD_REQUEST_FIELDS = frozenset({
    "prompt_logprobs", "prompt_logprob_token_ids",
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens",
    "prompt_logprob_start", "flat_logprobs", "detokenize", "skip_special_tokens",
    "spaces_between_special_tokens", "include_stop_str_in_output", "output_kind", "stream_interval",
    "skip_clone", "output_text_buffer_length", "extra_args", "skip_reading_prefix_cache",
    "repetition_detection", "routed_experts_prompt_start", "trace_decode_token_ids",
})
#: `vllm_xargs` key a request sets to false to be served by the dense head.
OPT_OUT_ARG = "flashhead"


def _request_fields(sampling_params: Any) -> tuple[str, ...]:
    """Public fields of vLLM's `SamplingParams` (a msgspec Struct), derived from the class."""
    fields = getattr(type(sampling_params), "__struct_fields__", None) or tuple(vars(sampling_params))
    return tuple(name for name in fields if not name.startswith("_"))


def _is_set(value: Any, default: Any) -> bool:
    if value is None or value is False:
        return False
    if isinstance(value, (list, tuple, dict, set, frozenset)) and not value:
        return False
    return value != default


def _is_off(value: Any) -> bool:
    """`false` as a request's `vllm_xargs` value can spell it (vLLM types them str | int | float)."""
    if isinstance(value, str):
        return value.strip().lower() in ("false", "0", "no", "off")
    return value is not None and value == 0


_DEFAULTS: dict[type, Any] = {}


def _default_of(sampling_params: Any) -> Any:
    cls = type(sampling_params)
    if cls not in _DEFAULTS:
        _DEFAULTS[cls] = cls()
    return _DEFAULTS[cls]


def request_dense_reason(sampling_params: Any) -> str | None:
    """The reason a request needs exact dense logits, or None when FlashHead may serve it.

    Derived from the request's own `SamplingParams`: a field that needs dense
    logits (`DENSE_REQUEST_FIELDS`) and is set, a `vllm_xargs` opt-out, or any
    field this plugin does not know (a newer vLLM) set to a non-default value
    makes the request dense.
    """
    if sampling_params is None:
        return None
    default = _default_of(sampling_params)
    for name, reason in DENSE_REQUEST_FIELDS.items():
        if _is_set(getattr(sampling_params, name, None), getattr(default, name, None)):
            return reason
    extra_args = getattr(sampling_params, "extra_args", None) or {}
    if _is_off(extra_args.get(OPT_OUT_ARG)):
        return "opt_out"
    for name in _request_fields(sampling_params):
        if name in DENSE_REQUEST_FIELDS or name in FLASHHEAD_REQUEST_FIELDS:
            continue
        if _is_set(getattr(sampling_params, name, None), getattr(default, name, None)):
            return "unclassified"
    return None


@dataclass
class StepRows:
    """What the model runner knows about the rows of one decode step."""

    dense_codes: np.ndarray  # uint8 [rows], 0 = FlashHead may serve the row
    sampled: np.ndarray  # bool [rows], True for rows that sample (temperature > 0)
    stop_ids: tuple[int, ...] = ()  # the step's requests' own stop_token_ids, scored exactly on every row

    @property
    def num_rows(self) -> int:
        return int(self.dense_codes.shape[0])


@dataclass
class FlashHeadSettings:
    enabled: bool
    n_probes: int
    dense_batch_threshold: int
    probe_sampling: bool
    backend: str
    fidelity_every: int  # check one FlashHead row in this many against the dense head; 0 = off


@dataclass
class FlashHeadCounters:
    steps: int = 0
    rows_flashhead: int = 0
    rows_dense: Counter = field(default_factory=Counter)
    fallbacks: int = 0
    head_seconds: float = 0.0
    fidelity_rows: int = 0
    fidelity_agreed: int = 0

    def snapshot(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "rows_flashhead": self.rows_flashhead,
            "rows_dense": dict(sorted(self.rows_dense.items())),
            "fallbacks": self.fallbacks,
            "head_seconds": round(self.head_seconds, 6),
            "fidelity_rows": self.fidelity_rows,
            "fidelity_agreed": self.fidelity_agreed,
        }


class _HeadTimer:
    """Accumulates time spent in the head without a host sync on GPU.

    CPU steps are timed with perf_counter; CUDA steps record events whose
    elapsed time is collected once they have completed.
    """

    def __init__(self, counters: FlashHeadCounters) -> None:
        self._counters = counters
        self._pending: list[tuple[Any, Any]] = []

    def start(self, device: torch.device) -> Any:
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, token: Any) -> None:
        if isinstance(token, float):
            self._counters.head_seconds += time.perf_counter() - token
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((token, end))
        self.collect(block=False)

    def collect(self, block: bool) -> None:
        while self._pending:
            start, end = self._pending[0]
            if not block and not end.query():
                return
            end.synchronize()
            self._counters.head_seconds += start.elapsed_time(end) / 1000.0
            self._pending.pop(0)


def default_settings(config: dict[str, Any], num_clusters: int | None, device_type: str) -> FlashHeadSettings:
    """Settings at start-up: environment overrides config.json, which overrides defaults."""
    configured_probes = config.get("n_probes")
    fallback_probes = max(1, (num_clusters or 16) // 16)
    n_probes = env_int("MY_PKG_FLASHHEAD_N_PROBES", None, minimum=1)
    if n_probes is None:
        n_probes = int(configured_probes) if isinstance(configured_probes, int) and configured_probes > 0 else fallback_probes
    if num_clusters is not None and n_probes > num_clusters:
        logger.warning("my_pkg: n_probes=%d exceeds %d clusters; using %d", n_probes, num_clusters, num_clusters)
        n_probes = num_clusters
    default_threshold = (
        DEFAULT_DENSE_BATCH_THRESHOLD_GPU if device_type == "cuda" else DEFAULT_DENSE_BATCH_THRESHOLD_CPU
    )
    return FlashHeadSettings(
        enabled=env_flag("MY_PKG_FLASHHEAD", True),
        n_probes=n_probes,
        dense_batch_threshold=env_int("MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD", default_threshold, minimum=0),
        probe_sampling=env_flag("MY_PKG_FLASHHEAD_PROBE_SAMPLING", True),
        backend=_backend_from_env(),
        fidelity_every=env_int("MY_PKG_FLASHHEAD_FIDELITY_EVERY", DEFAULT_FIDELITY_EVERY, minimum=0),
    )


def _backend_from_env() -> str:
    backend = os.environ.get("MY_PKG_FLASHHEAD_BACKEND", "auto").strip().lower() or "auto"
    if backend not in ("auto", "torch", "triton"):
        logger.warning("my_pkg: ignoring MY_PKG_FLASHHEAD_BACKEND=%r; using auto", backend)
        return "auto"
    return backend


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
        device_type: str,
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
        self.counters = FlashHeadCounters()
        self._timer = _HeadTimer(self.counters)
        self._step_source: Callable[[], StepRows | None] | None = None
        self._warned: set[str] = set()
        self.head: Any = None
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
        self.settings = default_settings(config, self.num_clusters, device_type)
        if self.unavailable_reason is not None:
            self._centroids = self._assignments = None
            logger.warning("my_pkg: FlashHead not active, dense head in use: %s", self.unavailable_reason)

    @classmethod
    def from_model_dir(
        cls, model_dir: str | None, config: dict[str, Any], *, vocab_size: int, device_type: str,
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
            device_type=device_type, unavailable_reason=unavailable_reason, unavailable_code=unavailable_code,
            pinned_ids=pinned_ids,
        )

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        return self.unavailable_reason is None

    def bind(self, weight: torch.Tensor) -> None:
        """Build the head over `weight` (the loaded LM head, shared, not copied)."""
        if self.head is not None or not self.available:
            return
        from my_pkg.flashhead.head import FlashHead

        assert self._centroids is not None and self._assignments is not None
        try:
            if weight.shape[1] != self._centroids.shape[1]:
                raise ValueError(
                    f"centroids have hidden size {self._centroids.shape[1]}, "
                    f"the head has {weight.shape[1]}"
                )
            self.head = FlashHead(
                weight,
                self._centroids.to(device=weight.device, dtype=weight.dtype),
                self._assignments.to(device=weight.device),
                vocab_size=self.vocab_size,
                n_probes=self.settings.n_probes,
                backend=self.settings.backend,
            )
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
        the model's logit scale/soft-cap to candidate logits.
        """
        num_rows = hidden.shape[0]
        self.counters.steps += 1
        if rows.num_rows != num_rows:
            return self._all_dense(hidden, dense, "unexpected_rows")
        if not self.settings.enabled:
            return self._all_dense(hidden, dense, "disabled")
        if self.head is None:
            return self._all_dense(hidden, dense, "unavailable")
        if num_rows > self.settings.dense_batch_threshold:
            return self._all_dense(hidden, dense, "batch_threshold")
        dense_rows = np.flatnonzero(rows.dense_codes)
        if dense_rows.size:
            reasons = np.bincount(rows.dense_codes[dense_rows], minlength=len(_REASON_BY_CODE))
            for code in np.flatnonzero(reasons):
                self.counters.rows_dense[_REASON_BY_CODE[code]] += int(reasons[code])
        if dense_rows.size == num_rows:
            return dense(hidden)

        token = self._timer.start(hidden.device)
        flash_hidden, sampled, flash_index = hidden, rows.sampled, None
        if dense_rows.size:  # score candidates only for the rows FlashHead serves
            flash_rows = np.flatnonzero(rows.dense_codes == 0)
            flash_index = torch.from_numpy(flash_rows).to(hidden.device, non_blocking=True)
            flash_hidden, sampled = hidden.index_select(0, flash_index), sampled[flash_rows]
        sample_rows = None
        if self.settings.probe_sampling and sampled.any():
            sample_rows = torch.from_numpy(sampled).to(hidden.device, non_blocking=True)
        token_ids, candidate_logits = self.head.candidate_logits(flash_hidden, sample_rows=sample_rows)
        candidate_logits = postprocess(candidate_logits)
        logits = torch.full(
            (num_rows, self.vocab_size), float("-inf"), dtype=candidate_logits.dtype, device=hidden.device
        )
        if flash_index is None:
            logits.scatter_(1, token_ids, candidate_logits)
        else:
            flat_ids = token_ids + (flash_index * self.vocab_size).unsqueeze(1)
            logits.view(-1).scatter_(0, flat_ids.flatten(), candidate_logits.flatten())
        pins = self._step_pins(rows.stop_ids, hidden.device)
        if pins is not None:  # EOS, special and stop tokens: exact on every row, probed or not
            pin_logits = postprocess(torch.nn.functional.linear(flash_hidden, self.head.weight.index_select(0, pins)))
            if flash_index is None:
                logits[:, pins] = pin_logits.to(logits.dtype)
            else:
                logits[flash_index.unsqueeze(1), pins] = pin_logits.to(logits.dtype)
        self._timer.stop(token)
        self._check_fidelity(flash_hidden, logits, flash_index, dense)
        if dense_rows.size:
            index = torch.from_numpy(dense_rows).to(hidden.device, non_blocking=True)
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
        the dense logits and count whether FlashHead's best token is a dense argmax (ties agree)."""
        every = self.settings.fidelity_every
        if every <= 0:
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
        self.counters.fidelity_rows += checks

    def _step_pins(self, stop_ids: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
        """Token ids scored exactly in this step, on `device`; None when there are none.

        Built once per distinct set of stop ids (the same requests share many
        steps), so a step copies nothing to the device.
        """
        key = (stop_ids, device)
        if self._pinned is None or self._pinned[0] != key:
            ids = sorted(set(self.pinned_ids).union(i for i in stop_ids if 0 <= i < self.vocab_size))
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
        self._timer.collect(block=True)
        if self._fidelity_agreed is not None:
            self.counters.fidelity_agreed += int(self._fidelity_agreed)
            self._fidelity_agreed = None
        head = self.head
        active = head is not None and self.settings.enabled
        if active:
            code, reason = None, None
        elif not self.available:
            code, reason = self.unavailable_code, self.unavailable_reason
        elif not self.settings.enabled:
            code, reason = "disabled", "disabled (MY_PKG_FLASHHEAD=0 or PUT enabled=false)"
        else:
            code, reason = "not_built", "not built yet (built on the first decode step)"
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
            "pinned_token_ids": list(self.pinned_ids),
            "fidelity_every": self.settings.fidelity_every,
            "backend": head.backend if head is not None else None,
            "extra_memory_bytes": head.extra_memory_bytes if head is not None else None,
            "counters": self.counters.snapshot(),
        }

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
            if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0:
                errors.append("dense_batch_threshold must be an integer >= 0")
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
