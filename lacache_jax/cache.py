"""Cache pytrees passed into and out of the jitted generation loop."""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Every layer's keys (after RoPE: never re-rotated) and values over the whole canvas."""
    k: list[jax.Array]  # n_layers x [B, T, G, K]
    v: list[jax.Array]  # n_layers x [B, T, G, K]
