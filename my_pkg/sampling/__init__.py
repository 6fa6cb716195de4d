"""Sampling filters, vLLM-free (torch only): the vLLM glue lives in `my_pkg.engine.patches`."""

from my_pkg.sampling.top_p import DEFAULT_WINDOW, apply_top_k_top_p, sorted_top_k_top_p

__all__ = ["DEFAULT_WINDOW", "apply_top_k_top_p", "sorted_top_k_top_p"]
