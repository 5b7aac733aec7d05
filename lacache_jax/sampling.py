"""What to reveal at a step: schedules, Gumbel sampling, confidence (as log-odds, ordered as
the reference's float64 probabilities), the reveal rules (a name -> rule table: fixed,
threshold, factor), DPad's kept suffix. Pure functions over the
current block's rows ([B, Q] with Q = block_length), except DPad's, which speak in canvas
columns ([B, T]): the kept set, its static size bound (`dpad_capacity`) and the kept
columns as gather indices (`dpad_columns`) for the compact canvas (compact.py)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from lacache_jax.config import DPadConfig

_DPAD_STREAM = 1 << 20  # fold_in tag separating DPad draws from sampling draws
# A row keeps more suffix positions than `dpad_capacity` with at most this probability per
# block; the block then runs on the full masked canvas instead (compact.py), so the bound costs
# speed when exceeded, never tokens.
DPAD_TAIL = 1e-6


def transfer_schedule(n_masked_B: jax.Array, steps: int) -> jax.Array:
    """LLaDA's tokens per step [B, steps]: `n // steps` each, the remainder one extra first."""
    base, rem = n_masked_B // steps, n_masked_B % steps
    return base[:, None] + (jnp.arange(steps)[None, :] < rem[:, None]).astype(jnp.int32)


def sample(logits_BQV: jax.Array, temperature: float, keys_B: jax.Array) -> jax.Array:
    """argmax of the logits with Gumbel noise at temperature T (plain argmax at T = 0).

    The reference draws `argmax(exp(l) / (-log u)^T)` in float64, where float64 only guards
    the exp against overflow; its log form `argmax(l / T - log(-log u))` needs no exp and is
    computed in fp32, which can only change the winner on exact fp32 ties.
    """
    if temperature == 0:
        return jnp.argmax(logits_BQV, axis=-1).astype(jnp.int32)
    u = jax.vmap(lambda k: jax.random.uniform(k, logits_BQV.shape[1:], jnp.float32,
                                              minval=jnp.finfo(jnp.float32).tiny))(keys_B)
    gumbel = -jnp.log(-jnp.log(u))
    return jnp.argmax(logits_BQV / temperature + gumbel, axis=-1).astype(jnp.int32)


# Confidences are log-odds z = log(p / (1 - p)) of the chosen token's softmax probability p
# (monotone in p, so rules compare z against the log-odds of their thresholds). The reference
# takes p from a float64 softmax; an fp32 p loses ~4e-6 near 1 (exp(chosen - logsumexp) with
# logits ~32), which ties confident positions that float64 orders. z is computed from the
# other tokens' share r = (1 - p) / p = sum_{j != x0} exp(l_j - l_x0) instead, whose relative
# precision is fp32's at any p.
# float64 p is 1 / fl(1 + r) near 1: r rounds to a multiple of 2^-52 (so r <= 2^-53 is p == 1:
# z = +inf, ties in position order: see `_ranked`). Below the smallest float64 subnormal
# p is 0 there: z is floored there, above the -inf that marks positions not to reveal.
_ULP1 = 2.0 ** -52
_ROUNDED_BELOW = 2.0 ** -30  # r past this is far above float64's resolution near p = 1
LOG_ODDS_FLOOR = math.log(2.0 ** -1074)


def log_odds(p: float | jax.Array):
    """log(p / (1 - p)): -inf at p <= 0, +inf at p >= 1 (a threshold's value in z)."""
    if isinstance(p, (int, float)):
        return -math.inf if p <= 0 else math.inf if p >= 1 else math.log(p / (1 - p))
    p = jnp.asarray(p, jnp.float32)
    return jnp.log(p) - jnp.log1p(-p)


def at_least(z: jax.Array, p: float) -> jax.Array:
    """The reference's `p >= threshold` in log-odds (a threshold above 1 passes nothing, not
    even p == 1)."""
    return jnp.zeros(z.shape, bool) if p > 1 else z >= log_odds(p)


def log_prob(z: jax.Array) -> jax.Array:
    """log p from log-odds (0 exactly at p == 1, so a product of p's compares as float64's)."""
    return -jnp.log1p(jnp.exp(-z))


def confidence(logits_BQV: jax.Array, x0_BQ: jax.Array, remasking: str,
               keys_B: jax.Array) -> jax.Array:
    """Log-odds of `low_confidence` (softmax probability of the chosen token, ordered as the
    reference's float64) or of `random` (uniform in [0, 1))."""
    if remasking == "random":
        u = jax.vmap(lambda k: jax.random.uniform(k, x0_BQ.shape[1:]))(keys_B)
        return jnp.maximum(log_odds(u), LOG_ODDS_FLOOR)
    logits_BQV = logits_BQV.astype(jnp.float32)
    top_BQ = jnp.max(logits_BQV, axis=-1)
    chosen = jnp.take_along_axis(logits_BQV, x0_BQ[..., None], axis=-1)[..., 0]
    is_x0 = jnp.arange(logits_BQV.shape[-1]) == x0_BQ[..., None]
    others = jnp.sum(jnp.where(is_x0, 0.0, jnp.exp(logits_BQV - top_BQ[..., None])), axis=-1)
    log_r = jnp.log(others) + (top_BQ - chosen)  # log((1 - p) / p)
    r = jnp.exp(log_r)
    r_64 = jnp.round(r / _ULP1) * _ULP1  # float64's 1 + r, less one (round half to even)
    log_r = jnp.where(r < _ROUNDED_BELOW, jnp.log(r_64), log_r)
    z = jnp.where(chosen == -jnp.inf, LOG_ODDS_FLOOR, -log_r)
    return jnp.maximum(z, LOG_ODDS_FLOOR)


def without_eos_eot(logits_BQV: jax.Array, eos_id: int, eot_id: int,
                    temperature: float) -> jax.Array:
    """The logits `confidence_eos_eot_inf` takes the confidence from: EOS and EoT removed from
    the softmax, so they are revealed last.

    Released-code quirk kept on purpose: LLaDA writes `noisy[..., eos] = logits[..., eot] =
    -inf` and takes the softmax of `logits`. At T = 0 no noise is added and `noisy` is
    `logits` itself, so both tokens drop; at T > 0 `noisy` is a new tensor and only EoT drops.
    """
    for tok in ((eos_id, eot_id) if temperature == 0 else (eot_id,)):
        logits_BQV = logits_BQV.at[..., tok].set(-jnp.inf)
    return logits_BQV


def _ranked(conf_BQ: jax.Array, masked_BQ: jax.Array):
    """Confidences with unmasked positions at -inf, their descending order and each
    position's rank in it (0 = most confident; ties to the lower position). The released
    samplers pick with `torch.topk`, whose order among exactly equal confidences is its
    implementation's (not position order on the CPU; CUDA's differs again): REFERENCE.md §4's
    "ties break arbitrarily". Exact ties arise at p == 1 in float64 and at the 0 that
    `confidence_eos_eot_inf` gives EOS / EoT predictions; there the tokens may differ from a
    given torch build's, and position order is this engine's (and tests/reference_sampler.py's)
    deterministic choice."""
    conf = jnp.where(masked_BQ, conf_BQ, -jnp.inf)
    order = jnp.argsort(-conf, axis=-1, stable=True)
    return conf, order, jnp.argsort(order, axis=-1)


def reveal_fixed(conf_BQ, masked_BQ, quota_B, value=None) -> jax.Array:
    """LLaDA: the `quota_B` most confident masked positions (the step's schedule count)."""
    _, _, rank = _ranked(conf_BQ, masked_BQ)
    return (rank < quota_B[:, None]) & masked_BQ


def reveal_threshold(conf_BQ, masked_BQ, quota_B, threshold: float) -> jax.Array:
    """Fast-dLLM: every masked position with confidence >= threshold, and always the most
    confident one."""
    conf, _, rank = _ranked(conf_BQ, masked_BQ)
    return ((rank == 0) | at_least(conf, threshold)) & masked_BQ


def reveal_factor(conf_BQ, masked_BQ, quota_B, factor: float) -> jax.Array:
    """Fast-dLLM factor rule: sort the N masked confidences c_0 >= c_1 >= ...; with thr_0 = -1
    and thr_i = 1 - factor / (i + 2), reveal the top i for the first i with c_i < thr_i, or all
    N if none fails. Released-code quirk kept on purpose: when the first failure is the last
    candidate (i = N - 1) all N are revealed, so two remaining masks always go together."""
    conf, order, rank = _ranked(conf_BQ, masked_BQ)
    n_B = masked_BQ.sum(-1)
    i = jnp.arange(conf.shape[-1])
    sorted_conf = jnp.take_along_axis(conf, order, axis=-1)
    thr = [-math.inf] + [log_odds(1.0 - factor / (j + 2.0)) for j in range(1, conf.shape[-1])]
    fails = (sorted_conf < jnp.asarray(thr, jnp.float32)) & (i < n_B[:, None])
    first = jnp.where(fails.any(-1), jnp.argmax(fails, axis=-1), n_B)
    count = jnp.where(first == n_B - 1, n_B, first)
    return (rank < count[:, None]) & masked_BQ


# name -> rule(conf_BQ, masked_BQ, quota_B, value) -> reveal_BQ: which masked positions of the
# block to reveal. `quota_B` is the fixed schedule's count for this step (None for the
# parallel rules); `value` the rule's setting (GenerationConfig.reveal_value).
REVEAL_RULES = {"fixed": reveal_fixed, "threshold": reveal_threshold, "factor": reveal_factor}


def dpad_keep(dpad: DPadConfig, keys_B: jax.Array, block_end: jax.Array, T: int) -> jax.Array:
    """Which canvas columns a block sees [B, T]: everything before `block_end` (a scalar, or
    one per row [B] when rows are at different blocks), and a random subset of the suffix at
    distance d = column - block_end < window. Uniform keeps the whole suffix where it holds
    at most `keep` columns, beyond the window too: DPad's sampler returns its input whole
    there (`UniformSampler.sample`: `if self.number >= src.shape[0]: return src`)."""
    per_row = jnp.ndim(block_end) == 1
    end = block_end[:, None] if per_row else block_end
    d = jnp.arange(T) - end
    in_window = (d >= 0) & (d < dpad.window)
    # One draw per suffix distance (not per column), so left padding cannot shift the draws.
    u = jax.vmap(lambda k: jax.random.uniform(k, (dpad.window,)))(keys_B)
    d_at = jnp.clip(d, 0, dpad.window - 1)
    u = jnp.take_along_axis(u, d_at, axis=1) if per_row else u[:, d_at]
    if dpad.strategy == "gaussian":
        z = dpad.k * d / (dpad.window - 1)
        p = dpad.scale * jnp.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
        kept = in_window & (u < p)
    else:  # uniform: the `keep` window positions with the smallest draws
        score = jnp.where(in_window, u, jnp.inf)
        rank = jnp.argsort(jnp.argsort(score, axis=-1), axis=-1)
        kept = in_window & (rank < dpad.keep)
        # DPad's quirk, kept: a suffix no longer than `keep` is kept whole, window or not.
        whole = dpad.keep >= T - end
        kept = jnp.where(whole, d >= 0, kept)
    return (d < 0) | kept


def dpad_block_keys(keys_B: jax.Array, block: int | jax.Array) -> jax.Array:
    """Per-row keys of the DPad draw for block `block` (one index, or one per row [B])."""
    stream = jax.vmap(lambda k: jax.random.fold_in(k, _DPAD_STREAM))(keys_B)
    return jax.vmap(jax.random.fold_in)(stream, jnp.broadcast_to(block, stream.shape))


def dpad_keep_probs(dpad: DPadConfig, n: int) -> list[float]:
    """Keep probability of each of the first n suffix distances (0 past the window), as
    `dpad_keep` draws them for gaussian DPad (`dpad_capacity` reads them); uniform: the share
    `keep / window` (its count is fixed anyway, and a suffix of at most `keep` columns is kept
    whole, which this does not describe)."""
    out = []
    for d in range(n):
        if d >= dpad.window:
            p = 0.0
        elif dpad.strategy == "gaussian":
            z = dpad.k * d / (dpad.window - 1)
            p = dpad.scale * math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
        else:
            p = dpad.keep / dpad.window
        out.append(min(1.0, p))
    return out


def dpad_most_kept(dpad: DPadConfig, n_suffix: int) -> int:
    """The most suffix positions a block can keep out of the `n_suffix` after it."""
    if dpad.strategy == "uniform":
        return n_suffix if dpad.keep >= n_suffix else min(dpad.keep, dpad.window)
    return min(dpad.window, n_suffix)


def dpad_capacity(dpad: DPadConfig, n_suffix: int, tail: float | None = None) -> int:
    """A static bound on the suffix positions a block keeps out of the `n_suffix` after it.

    Uniform keeps exactly min(keep, window), or the whole suffix where it holds at most
    `keep` columns: the bound is exact. Gaussian keeps a sum of independent draws, so any
    count up to min(window, n_suffix) can occur; the bound is the count's (1 - tail)
    quantile (`DPAD_TAIL` by default) from its exact distribution (a convolution over the
    distances, float64). A block whose count exceeds it falls back to the masked full canvas
    (compact.py): tokens never depend on the bound.
    """
    n = dpad_most_kept(dpad, n_suffix)
    if dpad.strategy == "uniform":
        return n
    tail = DPAD_TAIL if tail is None else tail
    pmf = [1.0]  # distribution of the kept count over the distances seen so far
    for p in dpad_keep_probs(dpad, n):
        pmf = [a * (1 - p) + b * p for a, b in zip(pmf + [0.0], [0.0] + pmf)]
    above = 1.0  # P(count > c) for c = -1, 0, 1, ...
    for c, q in enumerate(pmf):
        above -= q
        if above <= tail:
            return c
    return n


def dpad_columns(keep_BT: jax.Array, e, capacity: int) -> jax.Array:
    """The first `capacity` kept columns at or after the block end `e` (an int or a traced
    scalar), in column order, per row: [B, capacity] int32; empty slots hold T (past the
    canvas)."""
    T = keep_BT.shape[1]
    col = jnp.arange(T, dtype=jnp.int32)
    score = jnp.where(keep_BT & (col >= e), col, T)  # T: not a kept suffix column
    return jnp.sort(score, axis=-1)[:, :capacity]
