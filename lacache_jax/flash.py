"""Flash-dLLM decoding (REFERENCE.md §8): sliding-window threshold decoding with selective
cache refresh and, with `FlashConfig(verify=True)`, Flash-Verify, as one jitted
`lax.while_loop` over steps with a typed state.

Parity target: tests/reference_flash.py (its docstring settles every semantic choice). Per row:
- decoded positions (real prompt tokens and accepted ones) carry a rank, their order in the
  reference's `decoded` list; undecoded positions are pending. The window is the `W` left-most
  pending positions, the look-ahead the next `A`; among the window, last step's rejects come
  first in confidence order (`wkey`), which only breaks exact confidence ties.
- step 1 is a prefill: every column is a query. Later steps query R = W + A + Tr rows: the
  window, the look-ahead and the `track` highest-ranked decoded positions (track=None: every
  column, a full recompute). Each layer writes the query rows' rotated K and V into the cache
  (kernels/flash_cache.py) and attends over the whole cache with padding keys masked; budget
  rows without a position write nothing (their column is T: dropped).
- importance: raw q.k of the window rows against every key, mean over those rows and query
  heads, summed over layers 2..L-1: emitted by the attention of the query rows
  (kernels/window_attention.py) from the scores it computes anyway, no second pass.
- acceptance: window confidence (softmax probability of the argmax as log-odds, 0 at or past the
  predicted length once an EOS is accepted), every position >= threshold, at least the most
  confident; the rank order is then re-sorted: older decoded positions by ascending
  importance (ties keep their order), this step's accepted last in confidence order.
- EOS: the first step accepting EOS sets the predicted length (its last accepted EOS + 1);
  a row is done when no pending position lies before it, and its pending positions are filled
  with EOS (stop_at_eos), as the rest of the engine does.
- verify (a second forward in the same step, counted in NFE even with no candidate): after
  the draft acceptance, S = min(window positions before the predicted length minus the
  accepted, window // 2) candidates, the rejects in draft-confidence order; query slots
  [tracked | unused | S drafts | S masks], 2 * window per row, the tracked ones the last
  2 * window - 2S of the decoded order (older ranks, then this step's accepted). Keys: every
  cached column not queried, then the fresh rows under the two-view mask (`verify_mask`);
  nothing is written to the cache. The accepted prefix ("cumprod" or "agree") is decoded and
  ranked last, so the draft-accepted tokens compete on importance (the released code's
  `keep_num` reuse, tests/reference_flash.py).

Columns are canvas columns ([B, T], prompts left-padded to P); RoPE positions count from each
row's first real token and padding keys are masked, so a row decodes what it decodes alone.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

from kernels.flash_cache import flash_cache
from kernels.window_attention import window_attention
from lacache_jax import cache as policies
from lacache_jax import sampling
from lacache_jax.cache import Ctx, KVCache
from lacache_jax.config import FlashConfig, GenerationConfig, ModelConfig
from lacache_jax.model import Params, _attention_impl, finish_block, qkv, rms_norm
from lacache_jax.sar import report_progress

IMPORTANCE_FIRST_LAYER = 2  # the released kernel scores layers with index > 1

# Query-slot kinds, in slot order: the window first (its rows go through the LM head).
WINDOW, OTHER, UNUSED = 0, 1, 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class FlashState:
    x_BT: jax.Array           # [B, T] canvas
    decoded_BT: jax.Array     # [B, T] bool: real prompt tokens and accepted positions
    rank_BT: jax.Array        # [B, T] int32: order of the decoded positions (T if pending)
    wkey_BT: jax.Array        # [B, T] int32: window order (rejects first), T + column else
    accepted_BT: jax.Array    # [B, T] bool: accepted at the last step
    importance_BT: jax.Array  # [B, T] fp32: the last step's importance
    pred_len_B: jax.Array     # [B] int32: predicted length (column past the EOS; T before)
    eos_seen_B: jax.Array     # [B] bool
    done_B: jax.Array         # [B] bool: nothing left to decode before the predicted length
    nfe_B: jax.Array          # [B] forward passes the row took part in
    steps_B: jax.Array        # [B] decoding steps the row took part in
    revealed_B: jax.Array     # [B] tokens accepted (not the EOS fill)
    cache: KVCache | None     # per layer [B, T, G, K]; None when every step recomputes all


def drop_columns(st: FlashState, d: int) -> FlashState:
    """The state of a canvas d columns narrower (slot refill's smaller prompt bucket: the
    dropped columns are left padding of every row in flight). Column-valued leaves move with
    their columns: the sentinels T + column (window order) and T (pending rank, no
    predicted length) become those of the new width."""
    T = st.x_BT.shape[1]
    cut = lambda a: a[:, d:]  # noqa: E731
    return dataclasses.replace(
        st, x_BT=cut(st.x_BT), decoded_BT=cut(st.decoded_BT),
        rank_BT=jnp.minimum(cut(st.rank_BT), T - d),
        wkey_BT=jnp.where(cut(st.wkey_BT) >= T, cut(st.wkey_BT) - 2 * d, cut(st.wkey_BT)),
        accepted_BT=cut(st.accepted_BT), importance_BT=cut(st.importance_BT),
        pred_len_B=st.pred_len_B - d,
        cache=None if st.cache is None else jax.tree.map(cut, st.cache))


@dataclasses.dataclass(frozen=True)
class Budget:
    """Static query budget of a later step: W window + A look-ahead + Tr tracked rows."""
    W: int
    A: int
    Tr: int
    full: bool  # track=None: every column is queried at every step

    @classmethod
    def build(cls, flash: FlashConfig, gen_length: int, T: int) -> "Budget":
        W = min(flash.window, gen_length)
        full = flash.track is None
        A = gen_length - W if full or flash.lookahead is None else min(flash.lookahead,
                                                                       gen_length - W)
        return cls(W, A, T if full else min(flash.track, T), full)

    def rows(self, T: int) -> int:
        """R, the query rows of a later step (a row's queries never exceed its columns)."""
        return T if self.full else min(T, self.W + self.A + self.Tr)


def init_state(ctx: Ctx, x_BT: jax.Array, keep_cache: bool) -> FlashState:
    """Before the prefill: the real prompt tokens decoded in position order, an empty cache
    (none with `keep_cache=False`: every step then recomputes every column)."""
    cv, cfg = ctx.canvas, ctx.cfg
    B, T = x_BT.shape
    col = jnp.arange(T, dtype=jnp.int32)[None, :]
    decoded = cv.prompt_BT
    pad_B = T - cv.valid_BT.sum(-1)
    zeros = jnp.zeros((B,), jnp.int32)
    cache = KVCache.zeros(cfg, B, T, ctx.params.dtype) if keep_cache else None
    return FlashState(
        x_BT=x_BT, decoded_BT=decoded,
        rank_BT=jnp.where(decoded, col - pad_B[:, None], T).astype(jnp.int32),
        wkey_BT=jnp.broadcast_to(T + col, (B, T)).astype(jnp.int32),
        accepted_BT=jnp.zeros((B, T), bool), importance_BT=jnp.zeros((B, T), jnp.float32),
        pred_len_B=jnp.full((B,), T, jnp.int32), eos_seen_B=jnp.zeros((B,), bool),
        done_B=jnp.zeros((B,), bool), nfe_B=zeros, steps_B=zeros, revealed_B=zeros,
        cache=cache)


def select_queries(st: FlashState, valid_BT, budget: Budget, R: int, everything: bool):
    """Query columns [B, R] (window first, then the rest by column) and their kinds [B, R].

    `everything` (the prefill, or track=None) queries every real column."""
    T = st.x_BT.shape[1]
    col = jnp.arange(T, dtype=jnp.int32)[None, :]
    pending = valid_BT & ~st.decoded_BT
    order = jnp.cumsum(pending, axis=-1) - 1  # rank of a pending column among the pending
    window = pending & (order < budget.W)
    if everything:
        other = valid_BT & ~window
    else:
        look = pending & (order >= budget.W) & (order < budget.W + budget.A)
        n_dec = st.decoded_BT.sum(-1, keepdims=True)
        tracked = st.decoded_BT & (st.rank_BT >= n_dec - budget.Tr)
        other = look | tracked
    kind = jnp.where(window, WINDOW, jnp.where(other, OTHER, UNUSED))
    cols = jnp.argsort(kind * T + col, axis=-1)[:, :R].astype(jnp.int32)
    return cols, jnp.take_along_axis(kind, cols, axis=-1)


def query_forward(ctx: Ctx, x_BT, cache: KVCache, cols_BR, kind_BR, W: int):
    """All layers for the query rows against the cache (the last layer's attention,
    projection and MLP for the W window rows only, `cache.HEAD_ROWS_ONLY`: no other row's
    output is read); returns (window logits [B, W, V] fp32, importance [B, T] fp32, cache
    with every query row's K/V rewritten)."""
    params, cfg, cv = ctx.params, ctx.cfg, ctx.canvas
    T = x_BT.shape[1]
    used = kind_BR != UNUSED
    write_BR = jnp.where(used, cols_BR, T)  # unused budget rows: past the cache, dropped
    tok_BR = jnp.take_along_axis(x_BT, cols_BR, axis=-1)
    cos, sin = cv.rope_at(cols_BR)
    # Weights of the window rows in the importance: the mean over the window rows present
    # (fewer than W near the end) and the query heads.
    win_BW = (kind_BR[:, :W] == WINDOW).astype(jnp.float32)
    weight_BW = win_BW / (jnp.maximum(win_BW.sum(-1, keepdims=True), 1.0) * cfg.n_heads)
    x_BRD = params.embed[tok_BR]
    importance_BT = jnp.zeros((x_BT.shape[0], T), jnp.float32)
    ks, vs = [], []
    for i, layer in enumerate(params.layers):
        h = rms_norm(x_BRD, layer.attn_norm, cfg.norm_eps)
        q, k_c, v_c = flash_cache(h, layer.w_qkv, cos, sin, write_BR, cache.k[i], cache.v[i],
                                  n_heads=cfg.n_heads, tp=layer.tp)
        ks.append(k_c)
        vs.append(v_c)
        if i == cfg.n_layers - 1 and policies.HEAD_ROWS_ONLY:  # only the window's reach the head
            q, x_BRD = q[:, :W], x_BRD[:, :W]
        with jax.named_scope("attention"):
            if i >= IMPORTANCE_FIRST_LAYER:  # the scores of the same pass, summed per key
                attn, scores_BT = window_attention(q, k_c, v_c, cv.valid_BT, weight_BW)
                importance_BT += scores_BT
            else:
                attn = window_attention(q, k_c, v_c, cv.valid_BT)
        x_BRD = finish_block(x_BRD, attn, layer, cfg)
    return cv.logits(params, cfg, x_BRD[:, :W]), importance_BT, KVCache(ks, vs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Drafted:
    """A step between its acceptance passes: what the re-ranking and the verify pass need."""
    order_BT: jax.Array    # [B, T] int32: place in the reference's `decoded` list (T: pending)
    last_BT: jax.Array     # [B, T] bool: accepted last (ranked last, the rest by importance)
    any_BT: jax.Array      # [B, T] bool: accepted at this step by either pass
    active_B: jax.Array    # [B] bool: the row was not done before this step
    revealed_B: jax.Array  # [B] tokens accepted at this step


def accept(gen: GenerationConfig, st: FlashState, valid_BT, cols_BR, kind_BR, logits_BWV,
           keys_B):
    """Threshold acceptance in the window and EOS bookkeeping (the draft pass's acceptance).

    Returns (state with the accepted tokens, Drafted, candidate index [B, W] of each window
    slot among the rejects in confidence order (-1 elsewhere), drafts [B, W], n_below [B]:
    window positions before the predicted length as it was before this step)."""
    B, T = st.x_BT.shape
    W = logits_BWV.shape[1]
    b = jnp.arange(B)[:, None]
    active_B = ~st.done_B
    wcols = cols_BR[:, :W]
    in_win = kind_BR[:, :W] == WINDOW
    with jax.named_scope("sample"):
        # The row's own step count: a row draws the same keys alone, in a batch, or in a
        # slot it entered late (flash_slots.py).
        step_keys = jax.vmap(jax.random.fold_in)(keys_B, st.steps_B)
        x0 = sampling.sample(logits_BWV, gen.temperature, step_keys)
        conf = sampling.confidence(logits_BWV, x0, "low_confidence", None)
    beyond = st.eos_seen_B[:, None] & (wcols >= st.pred_len_B[:, None])
    conf = jnp.where(in_win, jnp.where(beyond, sampling.LOG_ODDS_FLOOR, conf), -jnp.inf)
    wkey = jnp.take_along_axis(st.wkey_BT, wcols, axis=-1)
    order = jnp.lexsort((wkey, -conf), axis=-1)  # descending confidence, ties: window order
    rank_W = jnp.argsort(order, axis=-1).astype(jnp.int32)
    keep_B = jnp.maximum(1, (sampling.at_least(conf, gen.threshold) & in_win).sum(-1))
    keep_B = keep_B.astype(jnp.int32)
    acc_W = in_win & (rank_W < keep_B[:, None]) & active_B[:, None]
    rejected_W = in_win & ~acc_W & active_B[:, None]

    def scatter(base, where_W, values):
        return base.at[b, jnp.where(where_W, wcols, T)].set(values, mode="drop")
    x = scatter(st.x_BT, acc_W, x0)
    acc_BT = scatter(jnp.zeros((B, T), bool), acc_W, True)
    wkey_BT = scatter(st.wkey_BT, rejected_W, rank_W - keep_B[:, None])
    pred_len, eos_seen = note_eos(gen, st.pred_len_B, st.eos_seen_B, acc_W & (x0 == gen.eos_id),
                                  wcols)
    # The reference's `decoded` list: older decoded positions in rank order, then this
    # step's accepted in confidence order.
    n_old = st.decoded_BT.sum(-1, keepdims=True).astype(jnp.int32)
    acc_order = scatter(jnp.zeros((B, T), jnp.int32), acc_W, n_old + rank_W)
    order_BT = jnp.where(st.decoded_BT, st.rank_BT, jnp.where(acc_BT, acc_order, T))
    st = dataclasses.replace(st, x_BT=x, decoded_BT=st.decoded_BT | acc_BT, wkey_BT=wkey_BT,
                             pred_len_B=pred_len, eos_seen_B=eos_seen)
    drafted = Drafted(order_BT.astype(jnp.int32), acc_BT, acc_BT, active_B, acc_W.sum(-1))
    cand_W = jnp.where(rejected_W, rank_W - keep_B[:, None], -1)
    n_below_B = (in_win & ~beyond).sum(-1) - keep_B
    return st, drafted, cand_W, x0, n_below_B


def note_eos(gen: GenerationConfig, pred_len_B, eos_seen_B, hit_BN, cols_BN):
    """The first pass that accepts EOS sets the predicted length (its last EOS + 1)."""
    new_eos = hit_BN.any(-1) & ~eos_seen_B & gen.stop_at_eos
    pred_len = jnp.where(new_eos, jnp.max(jnp.where(hit_BN, cols_BN, -1), -1) + 1, pred_len_B)
    return pred_len, eos_seen_B | new_eos


def finish(gen: GenerationConfig, st: FlashState, d: Drafted, valid_BT,
           importance_BT) -> FlashState:
    """Re-rank (positions accepted last keep their order at the end, the other decoded ones
    by ascending importance, ties in list order), done rows filled with EOS, counters."""
    B, T = st.x_BT.shape
    col = jnp.arange(T, dtype=jnp.int32)[None, :]
    old = st.decoded_BT & ~d.last_BT
    by = jnp.lexsort((jnp.where(old, d.order_BT, T), jnp.where(old, importance_BT, jnp.inf)),
                     axis=-1)
    old_rank = jnp.argsort(by, axis=-1).astype(jnp.int32)
    n_old = old.sum(-1, keepdims=True).astype(jnp.int32)
    # `last` holds a contiguous tail of the list: its order minus the first of it.
    first_last = jnp.min(jnp.where(d.last_BT, d.order_BT, T), -1, keepdims=True)
    rank = jnp.where(old, old_rank, jnp.where(d.last_BT, n_old + d.order_BT - first_last, T))
    pending = valid_BT & ~st.decoded_BT
    newly_done = d.active_B & ~(pending & (col < st.pred_len_B[:, None])).any(-1)
    x = st.x_BT
    if gen.stop_at_eos:
        x = jnp.where(newly_done[:, None] & pending, gen.eos_id, x)
    passes = 2 if gen.flash.verify else 1  # the verify forward runs even with no candidate
    return dataclasses.replace(
        st, x_BT=x, rank_BT=rank.astype(jnp.int32), accepted_BT=d.any_BT,
        importance_BT=importance_BT, done_B=st.done_B | newly_done,
        nfe_B=st.nfe_B + passes * d.active_B, steps_B=st.steps_B + d.active_B,
        revealed_B=st.revealed_B + d.revealed_B)


# Verify-slot kinds (a row's 2 * window query slots: [tracked | unused | drafts | masks]).
V_TRACKED, V_DRAFT, V_MASK, V_UNUSED = 0, 1, 2, 3


def verify_slots(ncand_B, ntrk_B, R: int):
    """Kind [B, R] and candidate index [B, R] of each verify slot: `ntrk` tracked rows, unused
    rows up to R - 2 ncand, then the ncand draft-view and the ncand mask-view rows."""
    r = jnp.arange(R, dtype=jnp.int32)[None, :]
    n, ntrk = ncand_B[:, None], ntrk_B[:, None]
    first_draft = R - 2 * n
    kind = jnp.where(r < ntrk, V_TRACKED, jnp.where(r < first_draft, V_UNUSED,
                     jnp.where(r < R - n, V_DRAFT, V_MASK)))
    idx = jnp.where(kind == V_DRAFT, r - first_draft, jnp.where(kind == V_MASK, r - R + n, -1))
    return kind.astype(jnp.int32), idx.astype(jnp.int32)


def verify_mask(kind_BR, idx_BR):
    """Bool [B, R, R]: may verify slot r attend to the fresh key of slot c (REFERENCE.md §8).
    Tracked rows see tracked and mask-view rows; draft row i sees draft j <= i and mask
    j > i; mask row i sees draft j < i and mask j >= i. Unused slots see only themselves
    (their output is never read) and no row sees them."""
    kr, kc = kind_BR[:, :, None], kind_BR[:, None, :]
    i, j = idx_BR[:, :, None], idx_BR[:, None, :]
    m = (kc == V_TRACKED) & (kr != V_UNUSED)
    m |= (kr == V_TRACKED) & (kc == V_MASK)
    m |= (kr == V_DRAFT) & (((kc == V_DRAFT) & (j <= i)) | ((kc == V_MASK) & (j > i)))
    m |= (kr == V_MASK) & (((kc == V_DRAFT) & (j < i)) | ((kc == V_MASK) & (j >= i)))
    R = kind_BR.shape[1]
    return m | ((kr == V_UNUSED) & jnp.eye(R, dtype=bool)[None])


def verify(ctx: Ctx, gen: GenerationConfig, st: FlashState, d: Drafted, cache: KVCache,
           cand_W, x0_BW, wcols_BW, n_below_B):
    """Flash-Verify's second forward and its acceptance; reads the cache, writes nothing."""
    params, cfg, cv = ctx.params, ctx.cfg, ctx.canvas
    B, T = st.x_BT.shape
    f = gen.flash
    C, R = f.window // 2, 2 * f.window
    b = jnp.arange(B)[:, None]
    col = jnp.arange(T, dtype=jnp.int32)[None, :]
    ncand_B = jnp.where(d.active_B, jnp.clip(n_below_B, 0, C), 0).astype(jnp.int32)
    slot = jnp.where((cand_W >= 0) & (cand_W < ncand_B[:, None]), cand_W, C)
    cand_BC = jnp.full((B, C), T, jnp.int32).at[b, slot].set(wcols_BW, mode="drop")
    draft_BC = jnp.full((B, C), gen.mask_id, jnp.int32).at[b, slot].set(x0_BW, mode="drop")
    # Tracked: the last R - 2 ncand entries of the `decoded` list (after the draft acceptance).
    n_dec = st.decoded_BT.sum(-1).astype(jnp.int32)
    trk_BT = st.decoded_BT & (d.order_BT >= (n_dec - (R - 2 * ncand_B))[:, None])
    ntrk_B = jnp.minimum(R - 2 * ncand_B, n_dec)
    trk_cols = jnp.argsort(jnp.where(trk_BT, col, T + col), axis=-1)[:, :R].astype(jnp.int32)
    # A canvas shorter than the R slots (T < 2 window): pad; slots past the T columns are never
    # tracked (ntrk_B <= n_dec <= T).
    trk_cols = jnp.pad(trk_cols, [(0, 0), (0, R - trk_cols.shape[1])])
    kind, idx = verify_slots(ncand_B, ntrk_B, R)
    is_cand = (kind == V_DRAFT) | (kind == V_MASK)
    ci = jnp.clip(idx, 0, C - 1)
    cols = jnp.where(kind == V_TRACKED, trk_cols,
                     jnp.where(is_cand, jnp.take_along_axis(cand_BC, ci, -1), 0))
    cols = jnp.minimum(cols, T - 1)  # unused slots: any column, they are masked
    tok = jnp.where(kind == V_TRACKED, jnp.take_along_axis(st.x_BT, cols, -1),
                    jnp.where(kind == V_DRAFT, jnp.take_along_axis(draft_BC, ci, -1),
                              gen.mask_id))
    queried_BT = trk_BT | jnp.zeros((B, T), bool).at[b, cand_BC].set(True, mode="drop")
    # Keys: every other cached position, then the fresh rows under the two-view mask.
    mask_BRS = jnp.concatenate(
        [jnp.broadcast_to((cv.valid_BT & ~queried_BT)[:, None, :], (B, R, T)),
         verify_mask(kind, idx)], axis=-1)[:, None]
    cos, sin = cv.rope_at(cols)
    x_BRD = params.embed[tok]
    for i, layer in enumerate(params.layers):
        h = rms_norm(x_BRD, layer.attn_norm, cfg.norm_eps)
        q, k, v = qkv(h, layer, cfg, cos, sin)
        with jax.named_scope("verify_attention"):
            attn = jax.nn.dot_product_attention(
                q, jnp.concatenate([cache.k[i], k.astype(cache.k[i].dtype)], axis=1),
                jnp.concatenate([cache.v[i], v.astype(cache.v[i].dtype)], axis=1),
                mask=mask_BRS, scale=1.0 / math.sqrt(cfg.head_dim),
                implementation=_attention_impl(q.dtype))
        x_BRD = finish_block(x_BRD, attn, layer, cfg)
    # Mask-view rows are the last ncand <= C = window // 2 slots: the LM head runs on those only.
    logits_BCV = cv.logits(params, cfg, x_BRD[:, R - C:])
    i_C = jnp.arange(C, dtype=jnp.int32)[None, :]
    row = jnp.clip(C - ncand_B[:, None] + i_C, 0, C - 1)
    logits_BCV = jnp.take_along_axis(logits_BCV, row[..., None], axis=1)
    z = sampling.confidence(logits_BCV, draft_BC, "low_confidence", None)
    z = jnp.where(st.eos_seen_B[:, None] & (cand_BC >= st.pred_len_B[:, None]),
                  sampling.LOG_ODDS_FLOOR, z)
    if f.accept == "cumprod":  # the product of p's as a sum of log p's
        log_p = jnp.where(i_C < ncand_B[:, None], sampling.log_prob(z), -jnp.inf)
        ok = jnp.cumsum(log_p, axis=-1) >= (math.log(f.gamma) if f.gamma <= 1 else jnp.inf)
    else:
        ok = (jnp.argmax(logits_BCV, axis=-1) == draft_BC) & sampling.at_least(z, f.gamma)
    acc_BC = jnp.cumprod(ok & (i_C < ncand_B[:, None]), axis=-1).astype(bool)  # leading run
    acc_BT = jnp.zeros((B, T), bool).at[b, jnp.where(acc_BC, cand_BC, T)].set(True, mode="drop")
    x = st.x_BT.at[b, jnp.where(acc_BC, cand_BC, T)].set(draft_BC, mode="drop")
    pred_len, eos_seen = note_eos(gen, st.pred_len_B, st.eos_seen_B,
                                  acc_BC & (draft_BC == gen.eos_id), cand_BC)
    order = st.decoded_BT.sum(-1, keepdims=True).astype(jnp.int32) + i_C
    order_BT = d.order_BT.at[b, jnp.where(acc_BC, cand_BC, T)].set(order, mode="drop")
    st = dataclasses.replace(st, x_BT=x, decoded_BT=st.decoded_BT | acc_BT, pred_len_B=pred_len,
                             eos_seen_B=eos_seen)
    return st, Drafted(order_BT, acc_BT, d.any_BT | acc_BT, d.active_B,
                       d.revealed_B + acc_BC.sum(-1))


def step(ctx: Ctx, gen: GenerationConfig, budget: Budget, st: FlashState, keys_B,
         prefill: bool) -> FlashState:
    """One decoding step of every row: query selection, forward, acceptance, and with
    `flash.verify` the verify pass over the remaining candidates."""
    cv = ctx.canvas
    T = st.x_BT.shape[1]
    everything = prefill or budget.full
    cols, kind = select_queries(st, cv.valid_BT, budget, T if everything else budget.rows(T),
                                everything)
    cache = st.cache
    if cache is None:  # full recompute: every real column is rewritten before it is read
        cache = KVCache.zeros(ctx.cfg, st.x_BT.shape[0], T, ctx.params.dtype)
    logits, importance, cache = query_forward(ctx, st.x_BT, cache, cols, kind, budget.W)
    st, drafted, cand_W, x0, n_below = accept(gen, st, cv.valid_BT, cols, kind, logits, keys_B)
    if gen.flash.verify:
        with jax.named_scope("verify"):
            st, drafted = verify(ctx, gen, st, drafted, cache, cand_W, x0, cols[:, :budget.W],
                                 n_below)
    st = finish(gen, st, drafted, cv.valid_BT, importance)
    return dataclasses.replace(st, cache=None if budget.full else cache)


def run(params: Params, cfg: ModelConfig, gen: GenerationConfig, x_BT: jax.Array,
        pad_B: jax.Array, keys_B: jax.Array, on_block: Callable | None = None) -> FlashState:
    """Decode the canvas (traced: call under jit): the prefill, then steps until every row is
    done. `on_block(1)` is called from the device once at the end when given."""
    T = x_BT.shape[1]
    ctx = Ctx.build(params, cfg, gen, pad_B, T)
    budget = Budget.build(gen.flash, gen.gen_length, T)
    st = step(ctx, gen, budget, init_state(ctx, x_BT, not budget.full), keys_B, prefill=True)
    # Every step of an unfinished row accepts a position, so gen_length steps bound the loop
    # (every running row has taken part in every step: the longest count is the step count).
    st = jax.lax.while_loop(
        lambda st: ~st.done_B.all() & (st.steps_B.max() < gen.gen_length),
        lambda st: step(ctx, gen, budget, st, keys_B, prefill=False), st)
    if on_block is not None:
        report_progress(on_block, jnp.int32(1), st.x_BT)
    return st
