"""Cache pytrees passed into and out of the jitted generation loop."""

from __future__ import annotations

import dataclasses

import jax

from kernels.cached_attention import FAState


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Every layer's keys (after RoPE: never re-rotated) and values over the whole canvas."""
    k: list[jax.Array]  # n_layers x [B, T, G, K]
    v: list[jax.Array]  # n_layers x [B, T, G, K]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LaCache:
    """Layer-0 state of `cache="exact"` (REFERENCE.md §7), filled at a block's first step.

    Outside the current block nothing changes within the block, so these stay exact: the
    embedding outputs (EmbedCache), layer 0's normed, projected, RoPE'd q/k/v (RoPECache) and
    its attention's online-softmax state over the unchanged keys (FACache). Later steps
    recompute only the block's rows of each and overwrite them.
    """
    x0: jax.Array       # [B, T, D] embedding outputs
    q: jax.Array        # [B, T, H, K]
    k: jax.Array        # [B, T, G, K]
    v: jax.Array        # [B, T, G, K]
    fa: FAState
