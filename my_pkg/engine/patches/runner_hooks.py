"""What the V1 and V2 model-runner hooks share: finding the controller, classifying a request,
laying out a speculative-decoding step, arming a step, building the head right after the weights
load, and never raising into vLLM.

`model_runner.py` (V1: `GPUModelRunner`, which the CPU runner subclasses) and
`model_runner_v2.py` (Model Runner V2) differ only in where vLLM keeps a request's state and
which call computes a step's logits; everything else is here.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from my_pkg.engine.flashhead.controller import FlashHeadController
from my_pkg.engine.flashhead.rows import DenseReason, StepRows, request_dense_reason, request_stop_ids
from my_pkg.engine.setup import build_head
from my_pkg.engine.vllm_uses import attributes, symbol

logger = logging.getLogger(f"vllm.{__name__}")

#: Set on every function a hook installs, so that applying twice wraps once.
WRAPPED = "_my_pkg_wrapped"
#: Where the controller of a runner's model is cached on the runner.
CONTROLLER_ATTR = "_my_pkg_flashhead"
#: Where `share_pinned_ids` keeps, on the object holding the stop-id table, `(controller.pinned_ids, as a set)`.
PINNED_IDS_ATTR = "_my_pkg_pinned_ids"
_NOT_FOUND = object()
_warned: set[str] = set()
T = TypeVar("T")
#: What the shared hooks rely on beyond their imports (`my_pkg.devtools.compat` checks it): the V1 and V2
#: runners' model lookups and load step, the model config's sleep mode, the LM head's class tree, and how
#: speculative drafts are sampled.
VLLM_SYMBOLS = (
    symbol("vllm.v1.worker.gpu_model_runner:GPUModelRunner.get_model", "method", params=("self",)),
    symbol("vllm.v1.worker.gpu_model_runner:GPUModelRunner.load_model", "method", params=("self",)),
    *attributes("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "model", "model_config"),
    symbol("vllm.v1.worker.gpu.model_runner:GPUModelRunner.get_model", "method", params=("self",)),
    *attributes("vllm.config:ModelConfig", "enable_sleep_mode"),
    symbol(
        "vllm.model_executor.layers.vocab_parallel_embedding:ParallelLMHead",
        "class",
        subclass_of="vllm.model_executor.layers.vocab_parallel_embedding:VocabParallelEmbedding",
    ),
)


def wrap_once(owner: Any, name: str, hook: Callable[..., Any]) -> None:
    """`owner.name = hook`, marked, unless `owner.name` is already one of ours: applying twice wraps once."""
    if not getattr(getattr(owner, name, None), WRAPPED, False):
        setattr(hook, WRAPPED, True)
        setattr(owner, name, hook)


def warn_once(hook: str, exc: BaseException) -> None:
    """Log a hook's failure once per hook; vLLM's own behaviour is kept."""
    if hook not in _warned:
        _warned.add(hook)
        logger.warning(
            "my_pkg: %s hook failed (%s: %s); vLLM's own behaviour kept", hook, type(exc).__name__, exc, exc_info=exc
        )


def require(*methods: tuple[type, str]) -> None:
    """Raise, changing nothing, when one of vLLM's `(class, method)` is missing."""
    for owner, name in methods:
        if not callable(getattr(owner, name, None)):
            raise AttributeError(f"{owner.__module__}.{owner.__qualname__}.{name} is missing")


# ---- the lookups -----------------------------------------------------------------------------


def controller_of_runner(runner: Any) -> FlashHeadController | None:
    """The controller of the model `runner` runs; looked up once the model is loaded, then cached."""
    cached = runner.__dict__.get(CONTROLLER_ATTR, _NOT_FOUND)
    if cached is not _NOT_FOUND:
        return cached
    if runner.__dict__.get("model") is None:
        return None
    get_model = getattr(runner, "get_model", None)
    found = controller_in(get_model() if callable(get_model) else runner.model)  # unwraps CUDA-graph wrappers
    runner.__dict__[CONTROLLER_ATTR] = found
    return found


def controller_in(model: Any) -> FlashHeadController | None:
    """The first FlashHead controller among `model`'s modules (a wrapper's `unwrap()` first)."""
    if model is None:
        return None
    unwrap = getattr(model, "unwrap", None)
    if callable(unwrap):
        model = unwrap()
    for module in model.modules():
        controller = module.__dict__.get(CONTROLLER_ATTR)
        if isinstance(controller, FlashHeadController):
            return controller
    return None


def find_controller(worker: Any) -> FlashHeadController | None:
    """The FlashHead controller of the model this worker runs, if any."""
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        return None
    return controller_of_runner(runner)


# ---- a request, a step -----------------------------------------------------------------------


def share_pinned_ids(holder: Any, controller: FlashHeadController | Any | None) -> None:
    """Tell `holder` (the object keeping the stop-id table: V1's `InputBatch`, V2's `Sampler`) which ids
    the controller pins on every row anyway (`pinned_ids`: EOS, special tokens), so that requests joining
    from now on carry only their other stop ids (`classify`). O(1) once shared: the controller's tuple is
    compared by identity, and converted only when it is new."""
    if controller is None:
        return
    pinned = controller.pinned_ids
    shared = holder.__dict__.get(PINNED_IDS_ATTR)
    if shared is None or shared[0] is not pinned:
        holder.__dict__[PINNED_IDS_ATTR] = (pinned, frozenset(pinned))


def shared_pinned_ids(holder: Any) -> frozenset[int]:
    """The ids `share_pinned_ids` gave `holder`; empty before (a request then carries all its stop ids)."""
    shared = holder.__dict__.get(PINNED_IDS_ATTR)
    return shared[1] if shared is not None else frozenset()


def classify(sampling_params: Any, pinned: frozenset[int] = frozenset()) -> tuple[int, tuple[int, ...]]:
    """`(dense code, stop ids)` of a request joining the batch: 0 when FlashHead may serve its rows;
    a request that cannot be classified is dense (`unclassified`). The stop ids leave out `pinned` (the
    ids the controller pins on every row anyway): a typical request, which stops on EOS only, carries
    none, and a step whose requests carry none looks at no request for them (`union_stop_ids`)."""
    try:
        reason = request_dense_reason(sampling_params)
    except Exception:  # noqa: BLE001 - an odd request is served dense, never an error
        reason = DenseReason.UNCLASSIFIED
    try:
        stop_ids = request_stop_ids(sampling_params)
        if pinned:
            stop_ids = tuple(i for i in stop_ids if i not in pinned)
    except Exception:  # noqa: BLE001
        stop_ids = ()
    return (0 if reason is None else int(reason)), stop_ids


def union_stop_ids(tables: Any) -> tuple[int, ...]:
    """The sorted union of the stop-id tuples in `tables` (each sorted; many of them equal)."""
    distinct = set(tables)
    if len(distinct) <= 1:
        return next(iter(distinct), ())
    ids: set[int] = set()
    for one in distinct:
        ids.update(one)
    return tuple(sorted(ids))


def spec_step_rows(per_request: StepRows, num_draft_tokens: Any) -> StepRows:
    """The rows of a speculative-decoding step from its requests' rows (`step_rows`): request `i` with
    `n_i` drafts has `n_i + 1` consecutive rows, its verify rows then its bonus row, in batch order
    (as V1's `_calc_spec_decode_metadata` and V2's `cu_num_logits` lay them out). Each row is served as
    without speculation: vLLM's rejection sampler then emits FlashHead's own law. Host numpy only."""
    num_reqs = per_request.num_rows
    n = np.asarray(num_draft_tokens, dtype=np.int64)
    if n.shape != (num_reqs,) or (n < 0).any():
        return StepRows(per_request.dense_codes, per_request.sampled, per_request.stop_ids, all_dense="unexpected_rows")
    rows_per_request = n + 1
    first_row = np.cumsum(rows_per_request) - rows_per_request
    first_draft = np.cumsum(n) - n
    total = int(n.sum())
    verify_rows = np.repeat(first_row, n) + (np.arange(total, dtype=np.int64) - np.repeat(first_draft, n))
    return StepRows(
        dense_codes=np.repeat(per_request.dense_codes, rows_per_request),
        sampled=np.repeat(per_request.sampled, rows_per_request),
        stop_ids=per_request.stop_ids,
        verify_rows=verify_rows,
    )


def run_armed(controller: FlashHeadController | None, rows: Callable[[], StepRows], call: Callable[[], T]) -> T:
    """`call()` (vLLM's own step) with the controller armed for its one logits call; always disarmed."""
    if controller is None:
        return call()
    controller.arm(rows)
    try:
        return call()
    finally:
        controller.disarm()


# ---- right after the weights load ------------------------------------------------------------


def hook_load_model(owner: type, stop_table_holder: str | None = None) -> None:
    """Wrap `owner.load_model` (when `owner` defines its own) to build the head right after it; the
    runner's attribute `stop_table_holder` (where its hooks keep the stop-id table) learns the pinned ids."""
    original = owner.__dict__.get("load_model")
    if original is None or getattr(original, WRAPPED, False):
        return

    @functools.wraps(original)
    def load_model(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        try:
            prepare_after_load(self, stop_table_holder)
        except Exception as exc:  # noqa: BLE001 - the first logits call builds it instead
            warn_once("load_model", exc)
        return result

    wrap_once(owner, "load_model", load_model)


def prepare_after_load(runner: Any, stop_table_holder: str | None = None) -> None:
    """Build the controller's head over the LM head vLLM just loaded, before vLLM profiles memory
    and sizes the KV cache; when the LM head cannot be told apart, the first logits call builds it.
    `runner.<stop_table_holder>`, when given and present, learns the pinned ids before any request joins."""
    runner.__dict__.pop(CONTROLLER_ATTR, None)  # a (re)load: look the controller up again
    controller = controller_of_runner(runner)
    holder = runner.__dict__.get(stop_table_holder) if stop_table_holder else None
    if holder is not None:
        share_pinned_ids(holder, controller)
    if controller is None or controller.head is not None or not controller.available:
        return
    if getattr(getattr(runner, "model_config", None), "enable_sleep_mode", False):
        # vLLM loads the weights in its sleep-mode memory pool, whose contents sleep level 2 discards:
        # the head is built at the first logits call (the profile run), outside that pool.
        logger.info("my_pkg: sleep mode is on; FlashHead is built at the first logits call")
        return
    lm_head = lm_head_of(runner.get_model())
    if lm_head is None:
        logger.info("my_pkg: FlashHead is built at the first logits call (the LM head is not one module)")
        return
    build_head(controller, lm_head)


def every_rank(flag: bool, device: Any = "cpu") -> bool:
    """Whether `flag` holds on every rank of the tensor-parallel group: one all-reduce over vLLM's TP group (on
    `device`, the one its communicator works on), to be reached by every rank alike; `flag` itself without
    tensor parallelism."""
    import torch
    from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce

    world = get_tensor_model_parallel_world_size()
    if world <= 1:
        return flag
    total = tensor_model_parallel_all_reduce(torch.tensor([1.0 if flag else 0.0], device=device))
    return int(round(float(total.item()))) == world


def tensor_parallel() -> bool:
    """Whether this process is one rank of several in vLLM's tensor-parallel group (False when unknown)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_world_size() > 1
    except Exception:  # noqa: BLE001 - no group initialised: one rank
        return False


def lm_head_of(model: Any) -> Any:
    """The module whose weight the model computes its logits with: `model.lm_head` (tied or not), the
    one `ParallelLMHead`, or the one vocab-parallel embedding (models that reuse it, e.g. Gemma)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    head = getattr(model, "lm_head", None)
    if isinstance(head, VocabParallelEmbedding):
        return head
    for kind in (ParallelLMHead, VocabParallelEmbedding):
        found = [m for m in model.modules() if isinstance(m, kind)]
        if len(found) == 1:
            return found[0]
        if found:
            return None
    return None
