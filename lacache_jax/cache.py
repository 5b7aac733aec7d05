"""Cache policies: how a block's forwards use (and refresh) a cache. Each policy builds its own
cache pytree and owns every forward that reads or writes it; the SAR loop (sar.py) only calls

    cache = policy.init(ctx)                                   before the first block
    logits_BQV, cache = policy.first(ctx, x_BT, keep_BT, s)     a block's first forward
    logits_BQV, cache = policy.step(ctx, x_BT, keep_BT, s, cache, i)   its later forwards

with `s` the block's first column (a scalar, or one per row [B] under slot refill: each row's
block is then cut, written and attended at its own column), `keep_BT` the keys the block sees
(padding and DPad's dropped suffix removed), `i` the step within the block, and logits for the
block's rows only. Shapes are static under jit: a policy whose later forwards shrink block
by block says so (`static_later(ctx)`), and the loop then runs each block's later steps in a
program of its own (`lax.switch` over the blocks) with `s` a Python int. (A switch per step
instead would copy the cache out of the conditional at every step.)

  policy   first forward of a block               later forwards
  none     full forward                           full forward
  exact    full forward; fill layer 0's LaCache   layer 0: embed/norm/QKV/RoPE of [s, e) only,
           (embeddings, q/k/v, FACache state)     FACache reuse; layers >= 1 full. Lossless.
  prefix   full forward, keep every K/V           queries [s, T) against cached K/V before s
                                                  (static s; per-row starts: the static
                                                  window [P, T), rows before s dropped)
  dual     full forward, keep every K/V           queries [s, e); their K/V overwrite the cache
                                                  (XLA's ops, or Flash-dLLM's fused kernel
                                                  under `dual_update("fused")`)
  dual + refresh_interval r: a full forward instead at steps i % r == 0 (`DualRefresh`).

In every forward but dual's later ones (whose rows are the block's) the last layer runs its
attention, output projection and MLP for the block's rows only (`head_blocks`): no other
row's output reaches the LM head.

With DPad (one block start), full forwards run on the compact canvas (compact.py): [0, e)
and the kept suffix only, one program per block; prefix's later steps query the block and the
kept suffix only. Caches keep the canvas layout, DPad's dropped columns masked keys; exact's
holds each block's compact columns instead (its forwards all run on the compact canvas).
`policy.rows(P, T, block_len, k, plan)` gives block k's (first forward's columns, a later
forward's query rows) for benchmarks (`block_rows`); `later_is_first` says every forward is
the first one (the loop then traces one forward, not two).

A new policy is one class here plus an entry in `POLICIES`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as PS

from kernels.cached_attention import FAState, cached_attention, takes_row_bounds
from kernels.flash_cache import chosen as flash_cache_chosen
from kernels.flash_cache import flash_cache
from kernels.forced import Forced
from lacache_jax import sampling
from lacache_jax.canvas import Canvas
from lacache_jax.compact import CompactPlan, View
from lacache_jax.config import GenerationConfig, ModelConfig
from lacache_jax.model import Params, finish_block, qkv, rms_norm, run_blocks
from lacache_jax.sharding import DATA, MODEL, shard_kernel


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Every layer's keys (after RoPE: never re-rotated) and values over the whole canvas."""
    k: list[jax.Array]  # n_layers x [M, T, G, K]
    v: list[jax.Array]  # n_layers x [M, T, G, K]

    @staticmethod
    def shape(cfg: ModelConfig, rows: int, T: int) -> tuple[int, ...]:
        """One layer's K (or V): [M, T, G, K]."""
        return (rows, T, cfg.n_kv_heads, cfg.head_dim)

    @classmethod
    def zeros(cls, cfg: ModelConfig, rows: int, T: int, dtype) -> "KVCache":
        shape = cls.shape(cfg, rows, T)
        layers = range(cfg.n_layers)
        return cls([jnp.zeros(shape, dtype) for _ in layers],
                   [jnp.zeros(shape, dtype) for _ in layers])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LaCache:
    """Layer-0 state of `cache="exact"` (REFERENCE.md §7), filled at a block's first step.

    Outside the current block nothing changes within the block, so these stay exact: the
    embedding outputs (EmbedCache), layer 0's normed, projected, RoPE'd q/k/v (RoPECache) and
    its attention's online-softmax state over the unchanged keys (FACache). Later steps
    recompute only the block's rows of each and overwrite them.
    """
    emb: jax.Array      # [M, T, D] embedding outputs
    q: jax.Array        # [M, T, H, K]
    k: jax.Array        # [M, T, G, K]
    v: jax.Array        # [M, T, G, K]
    fa: FAState

    # With DPad a block's state covers its compact canvas (compact.py), L <= T columns, held
    # in the first L columns of the canvas-wide arrays (one shape for the whole loop).
    def columns(self, L: int) -> "LaCache":
        """The first L columns."""
        if L == self.q.shape[1]:
            return self
        return self._map(lambda a, axis: jax.lax.slice_in_dim(a, 0, L, axis=axis))

    def widened(self, T: int) -> "LaCache":
        """Zero columns appended up to T."""
        def widen(a, axis):
            zeros = jnp.zeros(a.shape[:axis] + (T,) + a.shape[axis + 1:], a.dtype)
            return jax.lax.dynamic_update_slice_in_dim(zeros, a, 0, axis)
        return self._map(widen)

    def _map(self, fn, *others: "LaCache") -> "LaCache":
        """`fn(array, *the others' arrays, column axis)` on each array."""
        axes = LaCache(1, 1, 1, 1, FAState(m=2, l=2, acc=1))
        return jax.tree.map(fn, self, *others, axes)


@dataclasses.dataclass(frozen=True)
class Ctx:
    """What a forward needs besides tokens and cache: weights, shapes, the canvas and, with
    DPad, the compact canvas's static widths (compact.py)."""
    params: Params
    cfg: ModelConfig
    canvas: Canvas
    compact: CompactPlan | None = None

    @classmethod
    def build(cls, params: Params, cfg: ModelConfig, gen: GenerationConfig,
              pad_B: jax.Array | np.ndarray, T: int) -> "Ctx":
        """`pad_B`: each row's left padding (host zeros: no row padded, `Canvas.build`)."""
        return cls(params, cfg, Canvas.build(pad_B, T, cfg, gen),
                   CompactPlan.build(gen, T - gen.gen_length))

    def compact_at(self, s) -> CompactPlan | None:
        """The compact plan where a forward at block start s runs DPad's compact canvas: one
        start for the batch; per-row starts (slot refill, s [B]) run the masked whole canvas."""
        return None if jnp.ndim(s) == 1 else self.compact


# On: a forward's last layer runs attention, the output projection and the MLP for the rows
# the LM head reads (the block's) only; every row's keys and values are still made (a cache
# keeps them). The other rows' outputs would be computed to be thrown away: at batch 1,
# prompt 512, the last layer's 736 of 768 rows. Off (0): every query row through the whole
# last layer (read while tracing; `--settings lacache_jax.cache:HEAD_ROWS_ONLY=0` times it).
HEAD_ROWS_ONLY = True


def head_blocks(x_BLD, layers, cfg: ModelConfig, cos, sin, key_mask, cut=None, **hooks):
    """`run_blocks`, returning the hidden states of the rows `cut(a)` selects from a [M, L,
    ...] array (the block's: the LM head's), computed in the last layer for those rows only
    under `HEAD_ROWS_ONLY`; no `cut`: every row is the block's."""
    if cut is None or HEAD_ROWS_ONLY:
        return run_blocks(x_BLD, layers, cfg, cos, sin, key_mask, rows=cut, **hooks)
    h, ks, vs = run_blocks(x_BLD, layers, cfg, cos, sin, key_mask, **hooks)
    return cut(h), ks, vs


def full_forward(ctx: Ctx, x_BT, keep_BT, s, kv: bool = True):
    """All rows through all layers (the last one's attention and MLP for the block's rows:
    `head_blocks`); returns the block's logits and every layer's K/V (None without `kv`).
    With DPad and one block start, only the compact canvas's columns run (compact.py); their
    K/V are written back at their canvas columns, the rest left zero (those keys are
    masked)."""
    plan = ctx.compact_at(s)
    if plan is None:
        return _forward(ctx, ctx.canvas, x_BT, keep_BT, s, kv)

    def on_view(view: View):
        logits, c = _forward(ctx, view.canvas, view.take(x_BT), view.keep_BL, s, kv)
        if c is not None:
            zero = lambda a: jnp.zeros(_kv_shape(ctx), a.dtype)
            c = KVCache([view.put(zero(k), k) for k in c.k], [view.put(zero(v), v) for v in c.v])
        return logits, c
    return plan.run(ctx.canvas, keep_BT, s, on_view)


def _forward(ctx: Ctx, cv: Canvas, x_BT, keep_BT, s, kv: bool):
    cos, sin = cv.rope()
    h, ks, vs = head_blocks(ctx.params.embed[cv.model_rows(x_BT)], ctx.params.layers, ctx.cfg,
                            cos, sin, cv.key_mask(keep_BT), lambda a: cv.cut(a, s))
    return cv.logits(ctx.params, ctx.cfg, h), KVCache(ks, vs) if kv else None


def _width(T: int, k: int, plan: CompactPlan | None) -> int:
    """Columns of block k's full forward."""
    return T if plan is None else plan.width(k)


def _kv_shape(ctx: Ctx):
    return KVCache.shape(ctx.cfg, *ctx.canvas.pos_MT.shape)


# How the dual cache's later steps project, rotate and write the block's K/V: XLA's ops
# (a dot, RoPE, a dynamic-update-slice) or Flash-dLLM's fused cache-update kernel
# (kernels/flash_cache.py: one pass, no q/k/v round trip through HBM), the latter only where
# that kernel itself would run (its dispatch: a GPU, up to FUSED_MAX_ROWS rows, one head
# group), never its reference's scatter. XLA by default: inside the step the kernel ran 1.01x
# at batch 1 and 0.95x at batch 8 on the H200 (benchmarks/generate.py --dual-update
# xla,fused; RESULTS.md, fourteenth session). Read while tracing: a program compiled under
# one choice keeps it (`jax.clear_caches()` before switching).
dual_update = Forced("dual_update", ("xla", "fused"))


def query_layers(ctx: Ctx, tok_ML, cos, sin, keep_BT, cache: KVCache, write, cols_ML=None,
                 cut=None):
    """Query rows (model-row token ids `tok_ML`: the block's for dual, the block and what
    follows for prefix, [P, T) for prefix under slot refill, the block and its kept suffix with
    DPad; at RoPE `cos`/`sin`) through every layer, attending to the canvas-layout cache into
    which `write(c, new)` puts each layer's new K/V. `cols_ML`: the cache columns `write`
    puts the rows at, given where the fused cache-update kernel may do the writing
    (`dual_update`). `cut`: the block's rows among them (`head_blocks`), None where they are
    all the block's. Returns (hidden of the block's rows, the written cache)."""
    def kv_fn(i):
        def put(c, new):
            with jax.named_scope("cache_update"):
                return write(c, new)
        return lambda k, v: (put(cache.k[i], k), put(cache.v[i], v))

    def fused_fn(i):
        layer = ctx.params.layers[i]

        def project_and_write(h):
            with jax.named_scope("cache_update"):
                return flash_cache(h, layer.w_qkv, cos, sin, cols_ML, cache.k[i], cache.v[i],
                                   n_heads=ctx.cfg.n_heads, tp=layer.tp)
        return project_and_write

    layers = range(ctx.cfg.n_layers)
    fused = (cols_ML is not None and dual_update.choice("xla") == "fused"
             and flash_cache_chosen(*tok_ML.shape, ctx.params.layers[0].tp,
                                    ctx.cfg.head_dim) == "pallas")
    h, ks, vs = head_blocks(ctx.params.embed[tok_ML], ctx.params.layers, ctx.cfg, cos, sin,
                            ctx.canvas.key_mask(keep_BT), cut, kv_fns=[kv_fn(i) for i in layers],
                            qkv_fns=[fused_fn(i) for i in layers] if fused else None)
    return h, KVCache(ks, vs)


class NoCache:
    """Every forward recomputes the whole canvas (with DPad: the compact canvas)."""
    later_is_first = True  # the loop may run every step through `step` (one program)

    def static_later(self, ctx: Ctx) -> bool:
        return False

    def init(self, ctx: Ctx):
        return None

    def first(self, ctx: Ctx, x_BT, keep_BT, s):
        return full_forward(ctx, x_BT, keep_BT, s, kv=False)[0], None

    def step(self, ctx: Ctx, x_BT, keep_BT, s, cache, i):
        return self.first(ctx, x_BT, keep_BT, s)

    @staticmethod
    def rows(P: int, T: int, block_len: int, k: int, plan) -> tuple[int, int]:
        w = _width(T, k, plan)
        return w, w


class KVPolicy:
    """Shared by the Fast-dLLM caches: every layer's K/V kept from the block's first forward."""
    later_is_first = False

    def static_later(self, ctx: Ctx) -> bool:
        return False

    def init(self, ctx: Ctx):
        return KVCache.zeros(ctx.cfg, *ctx.canvas.pos_MT.shape, ctx.params.dtype)

    def first(self, ctx: Ctx, x_BT, keep_BT, s):
        return full_forward(ctx, x_BT, keep_BT, s)


class PrefixCache(KVPolicy):
    """Fast-dLLM prefix cache: later steps query the block and the suffix.

    With one block start, the loop runs the block's later steps in one program per block with
    s a Python int (`static_later`): a later step queries [s, T) only, or with DPad the block
    and block k's kept suffix slots (`CompactPlan.kept[k]`, so late blocks query no more rows
    than without DPad), falling back to [s, T) with DPad's mask when a row kept more. Per-row
    starts (slot refill) query the static window [P, T) and drop the rows before s."""

    def static_later(self, ctx: Ctx) -> bool:
        return True

    def step(self, ctx: Ctx, x_BT, keep_BT, s, cache, i):
        plan = ctx.compact
        if not isinstance(s, int):  # per-row starts (slots.py)
            return self._step_window(ctx, x_BT, keep_BT, s, cache)
        if plan is None:
            return self._step_from(ctx, x_BT, keep_BT, s, cache)
        slots = plan.kept[plan.block(s)]
        return plan.run_at(keep_BT, s,
                           lambda x, c: self._step_compact(ctx, x, keep_BT, s, c, slots),
                           lambda x, c: self._step_from(ctx, x, keep_BT, s, c), x_BT, cache)

    @staticmethod
    def rows(P: int, T: int, block_len: int, k: int, plan) -> tuple[int, int]:
        later = T - (P + k * block_len) if plan is None else block_len + plan.kept[k]
        return _width(T, k, plan), later

    def _step_from(self, ctx: Ctx, x_BT, keep_BT, s: int, cache):
        """Queries [s, T) for a static s: no row is computed to be thrown away. Their K/V
        overwrite the cache from column s, which every later step rewrites anyway, so the
        cache is updated in place instead of copied."""
        cv = ctx.canvas
        sub = cv.tail(s)
        write = lambda c, new: jax.lax.dynamic_update_slice_in_dim(c, new, s, axis=1)
        cos, sin = sub.rope()
        h, cache = query_layers(ctx, sub.model_rows(x_BT[:, s:]), cos, sin, keep_BT, cache,
                                write, cut=lambda a: a[:, :cv.block_len])
        return cv.logits(ctx.params, ctx.cfg, h), cache

    def _step_compact(self, ctx: Ctx, x_BT, keep_BT, s: int, cache, slots: int):
        """DPad: queries the block [s, s + block_len) and the kept suffix (`slots` static
        slots, empty ones masked); their K/V are scattered into the cache at their columns."""
        cv, bl = ctx.canvas, ctx.canvas.block_len
        B = x_BT.shape[0]
        cols = jnp.concatenate([s + jnp.broadcast_to(jnp.arange(bl, dtype=jnp.int32), (B, bl)),
                                sampling.dpad_columns(keep_BT, s + bl, slots)], axis=1)
        view = View.at(cv, keep_BT, cols)
        cos, sin = view.canvas.rope()
        h, cache = query_layers(ctx, view.canvas.model_rows(view.take(x_BT)), cos, sin,
                                keep_BT, cache, view.put, cut=lambda a: a[:, :bl])
        return cv.logits(ctx.params, ctx.cfg, h), cache

    @staticmethod
    def _step_window(ctx: Ctx, x_BT, keep_BT, s, cache):
        """The static query window [P, T) for any start (scalar or per row): rows before s
        are computed (but for the last layer's attention and MLP) and ignored; their keys,
        like all keys before s, come from the cache."""
        cv = ctx.canvas
        P = cv.prompt_len
        s_M1 = jnp.reshape(cv.model_s(s), (-1, 1))  # [1, 1], or [M, 1] per row
        fresh = (jnp.arange(cv.pos_MT.shape[1])[None, :] >= s_M1)[:, :, None, None]
        mix = lambda c, new: jnp.where(fresh, c.at[:, P:].set(new), c)
        cos, sin = cv.rope()
        # The mixed K/V serve this step's attention only: the cache stays as the first
        # forward left it.
        h, _ = query_layers(ctx, cv.model_rows(x_BT)[:, P:], cos[:, P:], sin[:, P:], keep_BT,
                            cache, mix, cut=lambda a: cv.cut(a, s - P))
        return cv.logits(ctx.params, ctx.cfg, h), cache


class DualCache(KVPolicy):
    """Fast-dLLM dual cache: later steps query the block only and write its K/V."""

    def step(self, ctx: Ctx, x_BT, keep_BT, s, cache, i):
        cv = ctx.canvas
        cos, sin = cv.rope(s)
        tok_MT = cv.model_rows(x_BT)
        # the columns `put` writes, cut as the rows are (an idle slot's start past the canvas
        # clamps the same way)
        cols_MQ = cv.cut(jnp.broadcast_to(jnp.arange(tok_MT.shape[1], dtype=jnp.int32),
                                          tok_MT.shape), s)
        h, cache = query_layers(ctx, cv.cut(tok_MT, s), cos, sin, keep_BT, cache,
                                lambda c, new: cv.put(c, new, s), cols_MQ)
        return cv.logits(ctx.params, ctx.cfg, h), cache

    @staticmethod
    def rows(P: int, T: int, block_len: int, k: int, plan) -> tuple[int, int]:
        return _width(T, k, plan), block_len


@dataclasses.dataclass(frozen=True)
class DualRefresh(DualCache):
    """The dual cache refreshed by a full forward every `interval` steps of a block."""
    interval: int

    def step(self, ctx: Ctx, x_BT, keep_BT, s, cache, i):
        return jax.lax.cond(i % self.interval == 0,
                            lambda x, c: full_forward(ctx, x, keep_BT, s),
                            lambda x, c: DualCache.step(self, ctx, x, keep_BT, s, c, i),
                            x_BT, cache)


def facache(q, k, v, key_mask, s, e, state: FAState | None = None, *, mode: str,
            block_len: int | None = None):
    """FACache attention; under a mesh, one kernel per (row shard, head shard). `block_len`
    (the static e - s): in reuse mode it selects the Triton kernel's split-key path for the
    block's tiles (measured faster on the H200: RESULTS.md), in fill mode it sizes the Mosaic
    GPU kernel's phase-B window. Per-row bounds `s`, `e` [M] (slot refill) go to the Mosaic
    GPU kernel as they are (`takes_row_bounds`), else run the kernel vmapped over rows, each
    row with its own scalar bounds (Pallas batches a vmapped call into one launch with a row
    grid axis); under a mesh the bounds split with the rows."""
    heads = PS(DATA, None, MODEL, None)
    st = FAState(PS(DATA, MODEL, None), PS(DATA, MODEL, None), heads)
    extra = () if state is None else (state,)
    kernel = functools.partial(cached_attention, mode=mode, block_len=block_len)
    bounds = PS() if jnp.ndim(s) == 0 else PS(DATA)
    if jnp.ndim(s) == 1 and not takes_row_bounds(q, mode):
        kernel = functools.partial(_row_by_row, kernel)
    fn = shard_kernel(kernel, (heads, heads, heads, PS(DATA, None), bounds, bounds,
                               *((st,) if extra else ())),
                      (heads, st) if mode == "fill" else heads)
    with jax.named_scope("attention"):
        return fn(q, k, v, key_mask, s, e, *extra)


def _row_by_row(kernel, q, k, v, key_mask, s, e, *state):
    """`kernel` once per row, each with its scalar bounds s[b], e[b]."""
    def one_row(q, k, v, key_mask, s, e, *state):
        row = lambda a: a[None]
        out = kernel(row(q), row(k), row(v), row(key_mask), s, e, *jax.tree.map(row, state))
        return jax.tree.map(lambda a: a[0], out)
    return jax.vmap(one_row)(q, k, v, key_mask, s, e, *state)


class ExactCache:
    """LaCache (REFERENCE.md §7): layer 0's embeddings, q/k/v and FACache state of the columns
    outside the block are filled at its first forward and reused, so later forwards compute
    layer 0 for the block's rows only; the deeper layers run as none's do. Same tokens.
    With DPad (one block start) every forward of a block runs on its compact canvas, as none's
    do, the state held in the first L columns of canvas-wide arrays (`LaCache.widened`); the
    later steps then run in a program per block (`static_later`), where L is static."""
    later_is_first = False

    def static_later(self, ctx: Ctx) -> bool:
        return ctx.compact is not None

    @staticmethod
    def rows(P: int, T: int, block_len: int, k: int, plan) -> tuple[int, int]:
        w = _width(T, k, plan)  # layers >= 1; layer 0's later queries are the block
        return w, w

    def init(self, ctx: Ctx):
        cfg, (M, T) = ctx.cfg, ctx.canvas.pos_MT.shape
        empty = lambda shape, dtype=ctx.params.dtype: jnp.zeros(shape, dtype)
        q_shape, kv_shape = (M, T, cfg.n_heads, cfg.head_dim), _kv_shape(ctx)
        return LaCache(empty((M, T, cfg.d_model)), empty(q_shape), empty(kv_shape),
                       empty(kv_shape), FAState(empty((M, cfg.n_heads, T), jnp.float32),
                                                empty((M, cfg.n_heads, T), jnp.float32),
                                                empty(q_shape, jnp.float32)))

    @staticmethod
    def _layer0_qkv(ctx: Ctx, tok, cos, sin):
        layer0 = ctx.params.layers[0]
        emb = ctx.params.embed[tok]
        return (emb, *qkv(rms_norm(emb, layer0.attn_norm, ctx.cfg.norm_eps), layer0, ctx.cfg,
                         cos, sin))

    @staticmethod
    def _rest(ctx: Ctx, cv: Canvas, emb, attn, keep_BT, s):
        """Layer 0 after its attention, then the deeper layers as usual."""
        params = ctx.params
        cos, sin = cv.rope()
        h, _, _ = head_blocks(finish_block(emb, attn, params.layers[0], ctx.cfg),
                              params.layers[1:], ctx.cfg, cos, sin, cv.key_mask(keep_BT),
                              lambda a: cv.cut(a, s))
        return cv.logits(params, ctx.cfg, h)

    def first(self, ctx: Ctx, x_BT, keep_BT, s):
        plan = ctx.compact_at(s)
        if plan is None:
            return self._first(ctx, ctx.canvas, x_BT, keep_BT, s)
        T = ctx.canvas.pos_MT.shape[1]

        def on_view(view: View):
            logits, cache = self._first(ctx, view.canvas, view.take(x_BT), view.keep_BL, s)
            return logits, cache.widened(T)
        return plan.run(ctx.canvas, keep_BT, s, on_view)

    def step(self, ctx: Ctx, x_BT, keep_BT, s, cache, i):
        plan = ctx.compact_at(s)
        if plan is None:
            return self._step(ctx, ctx.canvas, x_BT, keep_BT, s, cache)
        # s is a Python int here (`static_later`). The state holds the columns of the canvas
        # the block's first forward ran on, so a later step must choose as `plan.run` chose:
        # the block's compact canvas, or the last block's (the whole canvas) on overflow.
        return plan.run_at(keep_BT, s, self._step_on(ctx, keep_BT, s, plan.block(s)),
                           self._step_on(ctx, keep_BT, s, len(plan.kept) - 1), x_BT, cache)

    def _step_on(self, ctx: Ctx, keep_BT, s: int, k: int):
        """A later step on block k's compact canvas, as a function of (tokens, cache); the
        last block's (k = len(kept) - 1) is the whole canvas, DPad's overflow fallback."""
        def on_block(x_BT, cache):
            view = ctx.compact.view(ctx.canvas, keep_BT, k)
            return self._step(ctx, view.canvas, view.take(x_BT), view.keep_BL, s, cache)
        return on_block

    def _first(self, ctx: Ctx, cv: Canvas, x_BT, keep_BT, s):
        emb, q, k, v = self._layer0_qkv(ctx, cv.model_rows(x_BT), *cv.rope())
        s_M = cv.model_s(s)
        attn, fa = facache(q, k, v, cv.dup(keep_BT), s_M, s_M + cv.block_len, mode="fill",
                           block_len=cv.block_len)
        return self._rest(ctx, cv, emb, attn, keep_BT, s), LaCache(emb, q, k, v, fa)

    def _step(self, ctx: Ctx, cv: Canvas, x_BT, keep_BT, s, cache):
        """`cache` may be wider than `cv` (DPad: its state in the first L columns). The block
        sits at columns [s, s + block_len) of both, so its fresh rows are written into the
        canvas-wide state directly and only the first L columns are read."""
        fresh = self._layer0_qkv(ctx, cv.cut(cv.model_rows(x_BT), s), *cv.rope(s))
        with jax.named_scope("cache_update"):
            emb, q, k, v = (cv.put(c, n, s)
                            for c, n in zip((cache.emb, cache.q, cache.k, cache.v), fresh))
        cache = LaCache(emb, q, k, v, cache.fa)
        here = cache.columns(cv.pos_MT.shape[1])
        s_M = cv.model_s(s)
        attn = facache(here.q, here.k, here.v, cv.dup(keep_BT), s_M, s_M + cv.block_len,
                       here.fa, mode="reuse", block_len=cv.block_len)
        return self._rest(ctx, cv, here.emb, attn, keep_BT, s), cache


# name -> policy for a GenerationConfig (`cache=`).
POLICIES: dict[str, Callable[[GenerationConfig], Any]] = {
    "none": lambda gen: NoCache(),
    "exact": lambda gen: ExactCache(),
    "prefix": lambda gen: PrefixCache(),
    "dual": lambda gen: (DualCache() if gen.refresh_interval is None
                         else DualRefresh(gen.refresh_interval)),
}


def policy_for(gen: GenerationConfig):
    return POLICIES[gen.cache](gen)


def block_rows(gen: GenerationConfig, P: int) -> list[tuple[int, int]]:
    """Each block's (columns of its first forward, query rows of a later forward) in a
    generation whose rows share the block start, prompt width P; DPad's compact widths at
    their static slots (compact.py)."""
    policy, plan = policy_for(gen), CompactPlan.build(gen, P)
    T = P + gen.gen_length
    return [policy.rows(P, T, gen.block_length, k, plan) for k in range(gen.num_blocks)]
