"""DPad's compact canvas: the only columns a forward computes when DPad drops suffix positions,
at shapes fixed per block.

Block k, [s_k, e_k), sees [0, e_k) and the suffix columns DPad kept for it
(sampling.dpad_keep). Every other column is a masked key: no kept row attends to it, and its
own row feeds nothing that is kept. A forward over the kept columns alone, each at its own
RoPE position, therefore gives the kept rows the logits and K/V of the masked full canvas (up
to summation order). Its width must be static under jit: block k's compact canvas holds
[0, e_k) (so the block keeps its columns), then `kept[k]` suffix slots, the kept columns in
column order with empty slots masked (sampling.dpad_capacity: exact for uniform DPad, a
1 - DPAD_TAIL quantile of the kept count for gaussian). `CompactPlan.run` picks the block's
program with `lax.switch` (one program per block). A block where some row kept more than
`kept[k]` (gaussian only) runs the last block's program instead, whose compact canvas is the
whole canvas with DPad's dropped columns masked: what every block computed before compaction.

Shapes: B rows, M model rows (2B under CFG), T canvas columns, L compact columns.
Cache policies (cache.py) run their full forwards through `CompactPlan.run`. The K/V caches
(prefix, dual) keep the canvas layout: `View.put` writes compact K/V back at their canvas
columns. The exact cache keeps its layer-0 state in compact layout (the first L columns of
canvas-wide arrays), so its later steps must run on the canvas its first forward chose:
`CompactPlan.run_at` makes the same choice for a static block start.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from lacache_jax import sampling
from lacache_jax.canvas import Canvas
from lacache_jax.config import GenerationConfig


@dataclasses.dataclass(frozen=True)
class View:
    """A compact canvas: the canvas at `cols_BL` of each row, and the keys its queries see."""
    canvas: Canvas       # width L; RoPE positions, validity, prompt flags of the columns
    cols_BL: jax.Array   # canvas column of each compact column; >= T: an empty slot
    keep_BL: jax.Array   # kept keys among the compact columns (empty slots never)

    @classmethod
    def at(cls, canvas: Canvas, keep_BT: jax.Array, cols_BL: jax.Array) -> "View":
        """The view of `cols_BL` (columns >= T are empty slots). Empty slot j gets the column
        T + j, so the columns stay unique and ascending when they were (scatters say so)."""
        T = keep_BT.shape[1]
        cols_BL = jnp.where(cols_BL < T, cols_BL, T + jnp.arange(cols_BL.shape[1]))
        safe = jnp.minimum(cols_BL, T - 1)
        keep = jnp.take_along_axis(keep_BT, safe, axis=1) & (cols_BL < T)
        return cls(canvas.gather(safe), cols_BL, keep)

    def take(self, x_BT: jax.Array) -> jax.Array:
        """[B, T] canvas tokens -> [B, L] (empty slots read the last column; they are masked)."""
        return jnp.take_along_axis(x_BT, jnp.minimum(self.cols_BL, x_BT.shape[1] - 1), axis=1)

    def put(self, into_MT: jax.Array, a_ML: jax.Array) -> jax.Array:
        """`into_MT` [M, T, ...] with the compact columns of `a_ML` [M, L, ...] written at their
        canvas columns (empty slots dropped)."""
        cols_ML = self.canvas.dup(self.cols_BL)
        rows_M1 = jnp.arange(cols_ML.shape[0])[:, None]
        return into_MT.at[rows_M1, cols_ML].set(a_ML.astype(into_MT.dtype), mode="drop",
                                                indices_are_sorted=True, unique_indices=True)


@dataclasses.dataclass(frozen=True)
class CompactPlan:
    """The static widths of every block's compact canvas for one canvas geometry."""
    P: int                  # prompt width: block k starts at P + k * block_len
    block_len: int
    T: int
    kept: tuple[int, ...]   # suffix slots of block k's compact canvas
    spills: tuple[bool, ...]  # block k's rows can keep more than its slots (gaussian DPad
                              # whose slots are below the most it can keep there)

    @classmethod
    def build(cls, gen: GenerationConfig, P: int) -> "CompactPlan | None":
        """None without DPad, or when no block's compact canvas would be narrower than the
        canvas (its slots hold the whole suffix: gathers and scatters for nothing)."""
        if gen.dpad is None:
            return None
        T, bl = P + gen.gen_length, gen.block_length
        n_suffix = [T - (P + (k + 1) * bl) for k in range(gen.num_blocks)]
        kept = tuple(sampling.dpad_capacity(gen.dpad, n) for n in n_suffix)
        if kept == tuple(n_suffix):
            return None
        most = (sampling.dpad_most_kept(gen.dpad, n) for n in n_suffix)
        return cls(P, bl, T, kept, tuple(k < m for k, m in zip(kept, most)))

    def width(self, k: int) -> int:
        """Columns of block k's compact canvas."""
        return self.P + (k + 1) * self.block_len + self.kept[k]

    def block(self, s):
        """The index of the block starting at column s (a Python int, or traced)."""
        return (s - self.P) // self.block_len

    def overflow(self, keep_BT: jax.Array, s, slots) -> jax.Array:
        """Some row kept more suffix columns after the block at s than `slots` ([] traced)."""
        if not any(self.spills):
            return jnp.bool_(False)
        col = jnp.arange(self.T)
        return ((keep_BT & (col >= s + self.block_len)).sum(-1) > slots).any()

    def view(self, canvas: Canvas, keep_BT: jax.Array, k: int) -> View:
        """Block k's compact canvas: [0, e_k), then its kept suffix slots."""
        e = self.P + (k + 1) * self.block_len
        B = keep_BT.shape[0]
        cols = jnp.concatenate([jnp.broadcast_to(jnp.arange(e, dtype=jnp.int32), (B, e)),
                                sampling.dpad_columns(keep_BT, e, self.kept[k])], axis=1)
        return View.at(canvas, keep_BT, cols)

    def run(self, canvas: Canvas, keep_BT: jax.Array, s: jax.Array, fn: Callable[[View], object]):
        """`fn(view)` on the compact canvas of the block starting at the traced scalar s, in
        that block's program (`lax.switch` over the blocks), or in the last block's (the
        whole canvas, DPad's mask) when a row kept more than the block's slots."""
        nb = len(self.kept)
        k = self.block(s)
        over = self.overflow(keep_BT, s, jnp.asarray(self.kept)[k])
        branches = [lambda j=j: fn(self.view(canvas, keep_BT, j)) for j in range(nb)]
        return jax.lax.switch(jnp.where(over, nb - 1, k), branches)

    def run_at(self, keep_BT: jax.Array, s: int, compact: Callable, whole: Callable, *operands):
        """For the block at the static start s (a later step's program): `compact(*operands)`,
        or, as `run` chooses, `whole(*operands)` where a row kept more suffix columns than the
        block's slots (never where the slots hold the most DPad can keep there)."""
        k = self.block(s)
        if not self.spills[k]:
            return compact(*operands)
        return jax.lax.cond(self.overflow(keep_BT, s, self.kept[k]), whole, compact, *operands)
