"""Log-likelihoods of a masked diffusion LM: the Monte-Carlo ELBO of REFERENCE.md §9 and the
greedy check, batched over requests, for lm-eval's `loglikelihood` requests.

For a context c and a continuation y of L tokens, sample s masks k_s of its positions (the
context is never masked), run the model on [c | y with k_s masked] and score

    loss_s = sum over masked positions j of -log p(y_j | noisy) / (|k_s| / L)
    log-likelihood ~ -mean_s loss_s

(an upper bound on -log p(y | c) in expectation). Mask counts are stratified as LLaDA's
evaluation draws them: per group of `mc_batch` samples one offset k ~ U{1..L}, and the
group's counts spread evenly from it over 1..L (wrapping round). `mask_draws` makes the draws
injectable: a test hands the same draws to an independent reference.

`is_greedy` follows LLaDA's greedy check: start from the continuation fully masked and
reveal, one per forward pass, the masked position whose argmax is most confident (fp32
softmax); the continuation is greedy if the result equals it.

Rows are laid out [context | continuation | padding] (positions are the columns, padded keys
masked), one row per (request, sample); rows of one length bucket (T canvas, J continuation)
run `batch_size` at a time through one jitted program per bucket, so shapes stay static and
no host round-trip happens per request. Shape letters: R rows, T canvas, J continuation slots,
D d_model, V vocabulary.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from lacache_jax.config import ModelConfig
from lacache_jax.model import Params, forward_hidden, lm_head

# (pair index, context ids, continuation length) -> bool [mc_num, length]: the continuation
# positions each sample masks
MaskDraws = Callable[[int, Sequence[int], int], np.ndarray]

_HEAD_CHUNK = 128  # continuation positions per LM-head call: bounds the [R, J, V] logits


def stratified_masks(rng: np.random.Generator, length: int, mc_num: int,
                     mc_batch: int) -> np.ndarray:
    """Mask draws [mc_num, length] for one continuation, stratified as LLaDA's evaluation:
    group g of `mc_batch` samples takes an offset k ~ U{1..length}, counts
    round(linspace(k, k + (b - 1) length / b, b)) wrapped into 1..length, and each sample
    masks that many positions chosen uniformly at random."""
    if mc_num % mc_batch:
        raise ValueError(f"mc_batch={mc_batch} must divide mc_num={mc_num}")
    out = []
    b = mc_batch
    for _ in range(mc_num // b):
        k = int(rng.integers(1, length + 1))
        counts = np.round(np.linspace(k, k + (b - 1) * (length / b), b)).astype(np.int64)
        counts = (counts - 1) % length + 1
        # A random ranking of the positions per sample; the `count` lowest ranks are masked.
        ranks = rng.random((b, length)).argsort(axis=1).argsort(axis=1)
        out.append(ranks < counts[:, None])
    return np.concatenate(out)


def seeded_draws(seed: int, mc_num: int, mc_batch: int) -> MaskDraws:
    """Default draws, seeded by (seed, context, continuation length): a pair's draws do not
    depend on its batch or order, and the choices of one multiple-choice question (same
    context) that have the same length share their masks, so their comparison is paired
    (common random numbers: each estimate is unchanged in distribution, their difference
    far less noisy)."""
    def draws(index: int, context: Sequence[int], length: int) -> np.ndarray:
        digest = hashlib.sha256(np.asarray(context, np.int64).tobytes()).digest()
        rng = np.random.default_rng([seed, int.from_bytes(digest[:8], "little"), length])
        return stratified_masks(rng, length, mc_num, mc_batch)
    return draws


def bucket(n: int, hi: int) -> int:
    """A static length >= n from a coarse ladder: n rounded up to a multiple of
    max(16, next_pow2(n) / 8), capped at `hi`; 8 lengths per octave, so less than 1/4
    padding and few compilations."""
    step = max(16, (1 << max(n - 1, 1).bit_length()) // 8)
    return min(-(-n // step) * step, hi)


def loglikelihoods(params: Params, cfg: ModelConfig,
                   pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *, mc_num: int,
                   draws: MaskDraws, batch_size: int, mask_id: int, cfg_scale: float = 0.0,
                   check_greedy: bool = True,
                   progress: bool = False) -> list[tuple[float, bool]]:
    """(ELBO log-likelihood, is_greedy) of each (context ids, continuation ids) pair;
    is_greedy is False for all when `check_greedy` is off.

    Every pair must fit `cfg.max_seq_len`; a context may be empty (the continuation is then
    scored alone, as the reference does), an empty continuation has log-likelihood 0 (and
    is greedy). `progress` shows a bar per pass.
    """
    _check_pairs(pairs, cfg, mask_id)
    lls = _elbo(params, cfg, pairs, mc_num, draws, batch_size, mask_id, float(cfg_scale),
                progress)
    greedy = (_greedy(params, cfg, pairs, batch_size, mask_id, float(cfg_scale), progress)
              if check_greedy else [False] * len(pairs))
    return list(zip(lls, greedy))


def _check_pairs(pairs, cfg: ModelConfig, mask_id: int) -> None:
    for i, (ctx, cont) in enumerate(pairs):
        if len(ctx) + len(cont) > cfg.max_seq_len:
            raise ValueError(f"pairs[{i}]: context {len(ctx)} + continuation {len(cont)} "
                             f"tokens exceed max_seq_len={cfg.max_seq_len}")
        ids = np.asarray([*ctx, *cont], np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= cfg.vocab_size):
            raise ValueError(f"pairs[{i}] has token ids outside [0, {cfg.vocab_size})")
        if (ids == mask_id).any():
            raise ValueError(f"pairs[{i}] contains the mask id {mask_id}")


def _buckets(pairs, cfg: ModelConfig) -> dict[tuple[int, int], list[int]]:
    """Pair indices by (T, J) bucket; empty continuations are left out."""
    out: dict[tuple[int, int], list[int]] = {}
    for i, (ctx, cont) in enumerate(pairs):
        if len(cont):
            J = bucket(len(cont), cfg.max_seq_len)
            if J > _HEAD_CHUNK:  # the head runs in chunks of _HEAD_CHUNK positions
                J = -(-J // _HEAD_CHUNK) * _HEAD_CHUNK
            out.setdefault((bucket(len(ctx) + len(cont), cfg.max_seq_len), J), []).append(i)
    return out


def _canvas(pairs, idx: Sequence[int], T: int, J: int, pad_id: int):
    """Clean rows [R, T], continuation start [R], real length [R], targets [R, J]."""
    R = len(idx)
    x = np.full((R, T), pad_id, np.int32)
    tgt = np.full((R, J), pad_id, np.int32)
    start, length = np.zeros(R, np.int32), np.zeros(R, np.int32)
    for r, i in enumerate(idx):
        ctx, cont = pairs[i]
        x[r, :len(ctx)], x[r, len(ctx):len(ctx) + len(cont)] = ctx, cont
        tgt[r, :len(cont)] = cont
        start[r], length[r] = len(ctx), len(ctx) + len(cont)
    return x, start, length, tgt


def _fetch(results: list, desc: str, progress: bool) -> np.ndarray:
    """Device results of dispatched chunks, in order: the bar moves as they complete."""
    return np.concatenate([np.asarray(r) for r in tqdm(results, desc=desc, leave=False,
                                                          disable=not progress)])


def _elbo(params, cfg, pairs, mc_num, draws, batch_size, mask_id, cfg_scale,
          progress) -> list[float]:
    loss = np.zeros(len(pairs))
    for (T, J), idx in _buckets(pairs, cfg).items():
        # One row per (pair, sample), pair-major; a row's weight is 1 / mask ratio.
        x, start, length, tgt = _canvas(pairs, idx, T, J, cfg.pad_id)
        masks, weights = [], []
        for i in idx:
            ctx, cont = pairs[i]
            L = len(cont)
            m = np.asarray(draws(i, ctx, L))
            if m.shape != (mc_num, L) or m.dtype != bool:
                raise ValueError(f"mask_draws(pair {i}, length {L}) must return bool "
                                 f"[{mc_num}, {L}], got {m.dtype}{list(m.shape)}")
            counts = m.sum(-1)
            if (counts == 0).any():
                raise ValueError(f"mask_draws(pair {i}, length {L}) left a sample with no "
                                 "masked token")
            masks.append(np.pad(m, ((0, 0), (0, J - L))))
            weights.append(L / counts)
        row_pair = np.repeat(np.arange(len(idx)), mc_num)
        masks, weights = np.concatenate(masks), np.concatenate(weights)
        sums = []
        for lo in range(0, len(row_pair), batch_size):
            sel = row_pair[lo:lo + batch_size]
            m = _fill(masks[lo:lo + batch_size], batch_size, False)
            w = _fill(weights[lo:lo + batch_size], batch_size, 0.0)
            rows = [_fill(a[sel], batch_size, a[sel][-1]) for a in (x, start, length, tgt)]
            sums.append(_masked_nll(params, cfg, *rows, m, w, mask_id, cfg_scale))
        per_row = _fetch(sums, f"ELBO (canvas {T})", progress)[:len(row_pair)]
        loss[idx] = per_row.reshape(len(idx), mc_num).mean(-1)
    return [-float(v) for v in loss]


def _greedy(params, cfg, pairs, batch_size, mask_id, cfg_scale, progress) -> list[bool]:
    out = [True] * len(pairs)  # an empty continuation is trivially greedy
    for (T, J), idx in _buckets(pairs, cfg).items():
        x, start, length, tgt = _canvas(pairs, idx, T, J, cfg.pad_id)
        hits = []
        for lo in range(0, len(idx), batch_size):
            rows = [_fill(a[lo:lo + batch_size], batch_size, a[lo:lo + batch_size][-1])
                    for a in (x, start, length, tgt)]
            hits.append(_greedy_match(params, cfg, *rows, mask_id, cfg_scale))
        for i, hit in zip(idx, _fetch(hits, f"greedy check (canvas {T})", progress)):
            out[i] = bool(hit)
    return out


def _fill(a: np.ndarray, n: int, value) -> np.ndarray:
    """`a` padded to n rows with `value` (static batch shape for the last chunk)."""
    if len(a) == n:
        return a
    pad = np.broadcast_to(np.asarray(value, a.dtype), (n - len(a), *a.shape[1:]))
    return np.concatenate([a, pad])


def _model_hidden(params, cfg, noisy_RT, start_R, length_R, mask_id, cfg_scale):
    """Final hidden states [R or 2R, T, D]; with CFG the unconditional copies (context ->
    mask) follow as extra rows."""
    col = jnp.arange(noisy_RT.shape[1])
    keys_RT = col[None, :] < length_R[:, None]
    if cfg_scale > 0:
        uncond = jnp.where(col[None, :] < start_R[:, None], mask_id, noisy_RT)
        noisy_RT, keys_RT = jnp.concatenate([noisy_RT, uncond]), jnp.concatenate([keys_RT] * 2)
    return forward_hidden(params, cfg, noisy_RT, keys_RT)


def _head(params, cfg, h_MJD, cfg_scale, fn):
    """`fn(logits [R, j, V] fp32)` -> arrays [R, j] over the continuation slots, at most
    _HEAD_CHUNK slots per LM-head call; CFG combines the two halves' logits first
    (REFERENCE.md §4)."""
    def apply(h):
        logits = lm_head(params, cfg, h).astype(jnp.float32)
        if cfg_scale > 0:
            cond, uncond = jnp.split(logits, 2)
            logits = uncond + (cfg_scale + 1.0) * (cond - uncond)
        return fn(logits)
    M, J, D = h_MJD.shape
    if J <= _HEAD_CHUNK:
        return apply(h_MJD)
    chunks = h_MJD.reshape(M, J // _HEAD_CHUNK, _HEAD_CHUNK, D).swapaxes(0, 1)
    out = jax.lax.map(apply, chunks)  # leaves [J / chunk, R, chunk]
    return jax.tree.map(lambda a: a.swapaxes(0, 1).reshape(a.shape[1], J), out)


def _slots(h_MTD, start_R, J, cfg_scale):
    """Hidden states of the continuation slots [M, J, D]: columns start .. start + J - 1."""
    start_M = jnp.concatenate([start_R] * 2) if cfg_scale > 0 else start_R
    cols = jnp.minimum(start_M[:, None] + jnp.arange(J), h_MTD.shape[1] - 1)
    return jnp.take_along_axis(h_MTD, cols[..., None], axis=1)


@functools.partial(jax.jit, static_argnames=("cfg", "mask_id", "cfg_scale"))
def _masked_nll(params, cfg, x_RT, start_R, length_R, tgt_RJ, masked_RJ, weight_R, mask_id,
                cfg_scale):
    """Per row: weight * sum of -log p(target) over the masked continuation positions."""
    J = tgt_RJ.shape[1]
    col = jnp.arange(x_RT.shape[1])
    # Scatter the slot masks into canvas columns start .. start + J - 1.
    slot = col[None, :] - start_R[:, None]
    masked_RT = jnp.take_along_axis(masked_RJ, jnp.clip(slot, 0, J - 1), axis=1)
    masked_RT &= (slot >= 0) & (slot < J)
    noisy = jnp.where(masked_RT, mask_id, x_RT)
    h = _model_hidden(params, cfg, noisy, start_R, length_R, mask_id, cfg_scale)

    def nll(logits):
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, tgt_RJ[..., None], axis=-1)[..., 0]
    nll_RJ = _head(params, cfg, _slots(h, start_R, J, cfg_scale), cfg_scale, nll)
    return jnp.where(masked_RJ, nll_RJ, 0.0).sum(-1) * weight_R


@functools.partial(jax.jit, static_argnames=("cfg", "mask_id", "cfg_scale"))
def _greedy_match(params, cfg, x_RT, start_R, length_R, tgt_RJ, mask_id, cfg_scale):
    """Whether revealing the most confident argmax one position per pass reproduces each
    row's continuation. A row gets exactly as many passes as its continuation has tokens, as
    in LLaDA's check: a pass whose argmax is the mask token leaves its position masked, and
    the row then fails (unbounded, such a row kept its whole batch looping)."""
    R, J = tgt_RJ.shape
    col = jnp.arange(x_RT.shape[1])
    slot_J = jnp.arange(J)
    cont_R = length_R - start_R
    cols_RJ = jnp.minimum(start_R[:, None] + slot_J, x_RT.shape[1] - 1)
    x = jnp.where((col[None, :] >= start_R[:, None]) & (col[None, :] < length_R[:, None]),
                  mask_id, x_RT)

    def still_masked(x):
        return (jnp.take_along_axis(x, cols_RJ, axis=1) == mask_id) & (slot_J < cont_R[:, None])

    def step(state):
        i, x = state
        h = _model_hidden(params, cfg, x, start_R, length_R, mask_id, cfg_scale)
        x0_RJ, conf_RJ = _head(params, cfg, _slots(h, start_R, J, cfg_scale), cfg_scale, _top)
        masked = still_masked(x)
        pick_R = jnp.argmax(jnp.where(masked, conf_RJ, -jnp.inf), axis=-1)
        tok_R = jnp.take_along_axis(x0_RJ, pick_R[:, None], axis=1)[:, 0]
        col_R = jnp.take_along_axis(cols_RJ, pick_R[:, None], axis=1)[:, 0]
        write = masked.any(-1) & (i < cont_R)
        cur = jnp.take_along_axis(x, col_R[:, None], axis=1)[:, 0]
        return i + 1, x.at[jnp.arange(R), col_R].set(jnp.where(write, tok_R, cur))

    def more(state):
        i, x = state
        return (still_masked(x) & (i < cont_R)[:, None]).any()

    _, x = jax.lax.while_loop(more, step, (jnp.int32(0), x))
    got = jnp.take_along_axis(x, cols_RJ, axis=1)
    return ((got == tgt_RJ) | (slot_J >= cont_R[:, None])).all(-1)


def _top(logits_RJV):
    """Argmax token [R, J] and its softmax probability (fp32), as LLaDA's greedy check."""
    conf = jnp.exp(jnp.max(logits_RJV, -1) - jax.nn.logsumexp(logits_RJV, axis=-1))
    return jnp.argmax(logits_RJV, axis=-1).astype(jnp.int32), conf
