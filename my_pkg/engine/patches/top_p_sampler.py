"""vLLM's CPU top-k/top-p without a sort of every row (`my_pkg.sampling.top_p`).

Where vLLM sorts: `TopKTopPSampler.forward_cpu` (and `forward_native`, and the rejection sampler's
target probabilities) call `apply_top_k_top_p`. Without Triton, which is the case in vLLM's CPU
build, that function looks up `apply_top_k_top_p_pytorch` in its module at call time. With any
row's top-p below 1, `apply_top_k_top_p_pytorch` sorts every row of the batch.

The patch replaces that module function with a wrapper:

* a CPU tensor with a top-p goes to `my_pkg.sampling.apply_top_k_top_p`. It masks the same tokens
  (same law, same -inf positions up to boundary rounding; see that module). The rows it cannot
  decide from its window go to vLLM's own function.
* anything else goes to vLLM's function unchanged: no top-p (vLLM's top-k path has no sort), or a
  tensor on an accelerator.

Where vLLM samples with Triton, FlashInfer or another kernel, `apply_top_k_top_p` never reaches
this function, so GPU paths are untouched; where Triton imports (`HAS_TRITON`), nothing is
replaced at all. The draw after the mask (`fused_gumbel_argmax`, its seeds, the generators) is
vLLM's and does not change.

It never raises. An exception in the fast path is logged once and counted, and that call is
served by vLLM's function; the fast path writes the logits only after it has decided every row.
`MY_PKG_FAST_TOP_P=0` leaves vLLM's function in place.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

from my_pkg import env
from my_pkg.engine.vllm_uses import symbol

#: The module whose `apply_top_k_top_p_pytorch` is replaced.
TARGET = "vllm.v1.sample.ops.topk_topp_sampler"
#: What the wrapper relies on beyond its imports (`my_pkg.devtools.compat` checks it): the function it
#: replaces and how vLLM calls it (positionally: logits, k, p, allow_cpu_sync).
VLLM_SYMBOLS = (
    symbol(
        "vllm.v1.sample.ops.topk_topp_sampler:apply_top_k_top_p_pytorch",
        "function",
        params=("logits", "k", "p", "allow_cpu_sync"),
    ),
)

logger = logging.getLogger(f"vllm.{__name__}")

#: Set on the wrapper, so that applying twice wraps once.
WRAPPED = "_my_pkg_wrapped"
#: calls: served by the fast path; rows: their rows; sorted_rows: rows among them that went to vLLM's sort;
#: failures: calls where the fast path raised and vLLM's function served the whole call.
_counts = {"calls": 0, "rows": 0, "sorted_rows": 0, "failures": 0}
_warned = False


def counters() -> dict[str, int | bool]:
    """This process's counts since start-up (a copy), and whether the wrapper is in place (`installed`)."""
    module = sys.modules.get(TARGET)  # not imported here: the wrapper can only be in place if vLLM imported it
    function = getattr(module, "apply_top_k_top_p_pytorch", None)
    return {"installed": getattr(function, WRAPPED, False) is True, **_counts}


def _fast(logits: Any, k: Any, p: Any, sort_fallback: Callable[[Any, Any, Any], Any]) -> tuple[Any, int]:
    """The sort-free mask (a separate name so that a test can make it fail)."""
    from my_pkg.sampling.top_p import apply_top_k_top_p

    return apply_top_k_top_p(logits, k, p, sort_fallback=sort_fallback)


def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    """`original` (vLLM's `apply_top_k_top_p_pytorch`) behind the sort-free path."""

    @functools.wraps(original)
    def apply_top_k_top_p_pytorch(logits: Any, k: Any, p: Any, allow_cpu_sync: bool = False) -> Any:
        global _warned
        if p is None or logits.dim() != 2 or logits.device.type != "cpu":
            return original(logits, k, p, allow_cpu_sync)

        def vllm_sort(rows: Any, k_rows: Any, p_rows: Any) -> Any:
            return original(rows, k_rows, p_rows, allow_cpu_sync)

        try:
            masked, sorted_rows = _fast(logits, k, p, vllm_sort)
        except Exception as exc:  # noqa: BLE001 - vLLM's own function serves the call
            _counts["failures"] += 1
            if not _warned:
                _warned = True
                logger.warning(
                    "my_pkg: sort-free top-k/top-p failed (%s: %s); vLLM's own function serves such calls "
                    "(counted, logged once)",
                    type(exc).__name__,
                    exc,
                    exc_info=exc,
                )
            return original(logits, k, p, allow_cpu_sync)
        _counts["calls"] += 1
        _counts["rows"] += int(logits.shape[0])
        _counts["sorted_rows"] += sorted_rows
        return masked

    setattr(apply_top_k_top_p_pytorch, WRAPPED, True)
    return apply_top_k_top_p_pytorch


def apply() -> None:
    if not env.MY_PKG_FAST_TOP_P:
        logger.info("my_pkg: MY_PKG_FAST_TOP_P=0; vLLM's CPU top-k/top-p left as it is")
        return
    import vllm.v1.sample.ops.topk_topp_sampler as topk_topp_sampler

    if topk_topp_sampler.HAS_TRITON:  # `apply_top_k_top_p` calls Triton's kernel here, never this function
        logger.debug("my_pkg: vLLM's top-k/top-p runs on Triton here; its PyTorch function left as it is")
        return
    current = topk_topp_sampler.apply_top_k_top_p_pytorch
    if getattr(current, WRAPPED, False):
        return
    topk_topp_sampler.apply_top_k_top_p_pytorch = wrap(current)
