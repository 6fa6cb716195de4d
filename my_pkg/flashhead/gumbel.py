"""Gumbel noise keyed by ``(seed, id)``: the noise of vLLM's CPU draw, reproducible outside its kernel.

vLLM's CPU sampler draws a row as ``argmax(logits + g)`` (``torch.ops._C.fused_gumbel_argmax``), where token
``v``'s noise is ``g = -log(-log(u))`` and ``u`` comes from SplitMix64: ``key = mix(seed)``,
``u = (mix(key + (v + 1) * GOLDEN) >> 11 + 0.5) / 2**53``.  :func:`gumbel` gives the same values for any ids, so
a draw over a few thousand exact tokens adds to each the noise vLLM's kernel adds to it, and the same seed
reproduces the same draw.  :func:`uniform` gives the uniforms behind it, and :func:`derived_keys` further streams
of a key (the compact law's proposals and acceptances, :mod:`~my_pkg.flashhead.compact_law`).

Torch's ``int64`` arithmetic wraps on overflow as unsigned 64-bit arithmetic does; right shifts are made logical
with a mask.  Imports torch only.
"""

from __future__ import annotations

import torch

__all__ = ["derived_keys", "gumbel", "row_keys", "splitmix64", "uniform"]

_MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
#: Added to a key before mixing for the second stream (:func:`derived_keys`): any odd constant.
_SECOND_STREAM = 0xD1B54A32D192ED03


def _signed(value: int) -> int:
    """A 64-bit pattern as torch's int64 holds it."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser of each int64 (its 64 bits as unsigned), elementwise."""
    z = (z ^ _shift_right(z, 30)) * _signed(_MIX1)
    z = (z ^ _shift_right(z, 27)) * _signed(_MIX2)
    return z ^ _shift_right(z, 31)


def row_keys(seeds: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64 keys of rows drawn with ``seeds`` (non-negative int64, as vLLM draws them)."""
    return splitmix64(seeds.to(torch.int64))


def derived_keys(keys: torch.Tensor) -> torch.Tensor:
    """A second, independent stream per key (for a draw that must not reuse the first stream's noise)."""
    return splitmix64(keys + _signed(_SECOND_STREAM))


def uniform(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``float64`` uniforms in ``(0, 1)`` of ``ids`` (int64, ``[..., N]``) under ``keys`` (broadcast against ``ids``):
    the uniform vLLM's CPU kernel turns into token ``id``'s noise."""
    bits = _shift_right(splitmix64(keys + (ids + 1) * _signed(GOLDEN)), 11)
    return (bits.to(torch.float64) + 0.5) * 2.0**-53


def gumbel(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``float64`` Gumbel noise of ``ids`` (int64, ``[..., N]``) under ``keys`` (broadcast against ``ids``, e.g.
    ``[B, 1]`` for ``[B, N]``): vLLM's CPU kernel's noise for token ``id`` of a row drawn with that key."""
    return -torch.log(-torch.log(uniform(keys, ids)))
