"""What every forward of one generation shares, whatever its cache policy or step strategy:
the canvas geometry, each row's real-token mask and RoPE positions, classifier-free guidance's
unconditional copies, and the LM head on the current block's rows.

The canvas `x_BT` holds each row's prompt left-padded to P, then `gen_length` masks, so every
row's blocks start at the same column. Padding never shows: padded keys are masked and RoPE
positions count from each row's first real token, so a row generates what it generates alone.
With CFG (`cfg_scale > 0`) the model sees M = 2B rows: the B rows, then copies whose prompt
tokens are masks; every cache policy handles them as ordinary rows.

A block start `s` is a scalar (every row at the same block: `generate`, one dynamic slice) or
per row, `s_B` (slot refill, slots.py: rows in flight are at different blocks): `cut`, `put`
and `rope` then slice each row at its own column (vmapped dynamic slices), and the model rows
under CFG share their row's start (`model_s`).

A compact canvas (`gather`) is the same canvas restricted to some columns per row, each
keeping its RoPE position, validity and prompt flag: DPad's [0, block end) and kept suffix
(compact.py). Its first columns are the canvas's own, so a block keeps its columns in it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lacache_jax.config import GenerationConfig, ModelConfig
from lacache_jax.model import Params, lm_head, rope_tables


# Off (0): every forward passes its key mask, unpadded or not (read while tracing; the
# benchmarks time the two: `--settings lacache_jax.canvas:UNMASKED=0`).
UNMASKED = True


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Canvas:
    valid_BT: jax.Array   # [B, T] real tokens (prompt or generated), not left padding
    prompt_BT: jax.Array  # [B, T] real prompt tokens
    pos_MT: jax.Array     # [M, T] RoPE positions of the model rows
    cos_MTk: jax.Array    # [M, T, K/2] RoPE tables at those positions (fp32)
    sin_MTk: jax.Array
    prompt_len: int = dataclasses.field(metadata={"static": True})   # P (padded)
    block_len: int = dataclasses.field(metadata={"static": True})
    mask_id: int = dataclasses.field(metadata={"static": True})
    cfg_scale: float = dataclasses.field(metadata={"static": True})
    # Every row attends to every column at every step: no row is padded (known on the host)
    # and no DPad. Attention then takes no key mask: cuDNN's unmasked kernel instead of the
    # one adding a [B, 1, L, S] bias (`key_mask`). The views DPad's compact canvas gathers
    # copy it: False there.
    keeps_all: bool = dataclasses.field(default=False, metadata={"static": True})

    @classmethod
    def build(cls, pad_B: jax.Array | np.ndarray, T: int, cfg: ModelConfig,
              gen: GenerationConfig):
        """`pad_B`: each row's left padding; a host (numpy) array of zeros tells the trace
        that no row is padded (`keeps_all` without DPad)."""
        col = jnp.arange(T)
        P = T - gen.gen_length
        valid_BT = col[None, :] >= pad_B[:, None]
        pos_BT = jnp.maximum(col[None, :] - pad_B[:, None], 0).astype(jnp.int32)
        pos_MT = jnp.concatenate([pos_BT, pos_BT]) if gen.cfg_scale > 0 else pos_BT
        cos, sin = rope_tables(pos_MT, cfg.head_dim, cfg.rope_theta)
        keeps_all = (UNMASKED and isinstance(pad_B, np.ndarray) and not pad_B.any()
                     and gen.dpad is None)
        return cls(valid_BT, valid_BT & (col[None, :] < P), pos_MT, cos, sin, P,
                   gen.block_length, gen.mask_id, gen.cfg_scale, keeps_all)

    @property
    def guided(self) -> bool:
        """Classifier-free guidance: each batch row runs as two model rows."""
        return self.cfg_scale > 0

    @property
    def rows_per_row(self) -> int:
        """Model rows per batch row: 2 under CFG."""
        return 2 if self.guided else 1

    def model_rows(self, x_BT: jax.Array) -> jax.Array:
        """[B, T] tokens -> [M, T]: the unconditional copies mask the prompt."""
        if not self.guided:
            return x_BT
        return jnp.concatenate([x_BT, jnp.where(self.prompt_BT, self.mask_id, x_BT)])

    def dup(self, a_B: jax.Array) -> jax.Array:
        """A per-row array for the model rows (the copies share it)."""
        return jnp.concatenate([a_B, a_B]) if self.guided else a_B

    def key_mask(self, keep_BT: jax.Array) -> jax.Array | None:
        """The model rows' key mask for the layers' attention: None where every key is kept
        (`keeps_all`: `keep_BT` is then all-True, built from the canvas's validity alone; the
        same weights as the mask)."""
        return None if self.keeps_all else self.dup(keep_BT)

    def model_s(self, s):
        """A block start for the model rows: a scalar as is, a per-row start [B] -> [M]."""
        return s if jnp.ndim(s) == 0 else self.dup(s)

    def cut(self, a: jax.Array, s) -> jax.Array:
        """The block's `block_len` columns of a [rows, T, ...] array, from column s (scalar, or
        one start per row: [B], or [M] for model rows)."""
        if jnp.ndim(s) == 0:
            return jax.lax.dynamic_slice_in_dim(a, s, self.block_len, axis=1)
        return jax.vmap(lambda r, s: jax.lax.dynamic_slice_in_dim(r, s, self.block_len))(
            a, _per_row(s, a.shape[0]))

    def put(self, a: jax.Array, new: jax.Array, s) -> jax.Array:
        """`a` with the block's columns from column s (scalar or per row) replaced by `new`."""
        if jnp.ndim(s) == 0:
            return jax.lax.dynamic_update_slice_in_dim(a, new, s, axis=1)
        return jax.vmap(lambda r, n, s: jax.lax.dynamic_update_slice_in_dim(r, n, s, 0))(
            a, new, _per_row(s, a.shape[0]))

    def rope(self, s=None):
        """RoPE tables of all columns, or of the block's from column s."""
        if s is None:
            return self.cos_MTk, self.sin_MTk
        return self.cut(self.cos_MTk, s), self.cut(self.sin_MTk, s)

    def rope_at(self, cols_BR: jax.Array):
        """RoPE tables of the given columns, per row: cos, sin [B, R, K/2] (no CFG rows)."""
        take = lambda t: jnp.take_along_axis(t, cols_BR[..., None], axis=1)
        return take(self.cos_MTk), take(self.sin_MTk)

    def tail(self, s: int) -> "Canvas":
        """The canvas from column s on (a static start)."""
        return dataclasses.replace(
            self, valid_BT=self.valid_BT[:, s:], prompt_BT=self.prompt_BT[:, s:],
            pos_MT=self.pos_MT[:, s:], cos_MTk=self.cos_MTk[:, s:], sin_MTk=self.sin_MTk[:, s:])

    def gather(self, cols_BL: jax.Array) -> "Canvas":
        """The canvas restricted to the given columns of each row [B, L], in that order: a
        compact canvas of width L with the original RoPE positions."""
        take = lambda a, c: jnp.take_along_axis(a, c, axis=1)
        cols_ML = self.dup(cols_BL)
        return dataclasses.replace(
            self, valid_BT=take(self.valid_BT, cols_BL), prompt_BT=take(self.prompt_BT, cols_BL),
            pos_MT=take(self.pos_MT, cols_ML), cos_MTk=take(self.cos_MTk, cols_ML[..., None]),
            sin_MTk=take(self.sin_MTk, cols_ML[..., None]))

    def logits(self, params: Params, cfg: ModelConfig, h_MQD: jax.Array) -> jax.Array:
        """LM head on the block's rows only (logit truncation), fp32, CFG combined: [B, Q, V]."""
        with jax.named_scope("head"):
            logits = lm_head(params, cfg, h_MQD).astype(jnp.float32)
            if self.guided:
                B = logits.shape[0] // 2
                cond, uncond = logits[:B], logits[B:]
                logits = uncond + (self.cfg_scale + 1.0) * (cond - uncond)
            return logits


def _per_row(s_B: jax.Array, rows: int) -> jax.Array:
    """Per-row starts for an array of `rows` rows: the model rows under CFG (M = 2B) repeat
    their batch row's start."""
    return s_B if rows == s_B.shape[0] else jnp.tile(s_B, rows // s_B.shape[0])
