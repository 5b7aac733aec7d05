"""What to reveal at a step: schedules, Gumbel sampling, confidence, the reveal rules (a
name -> rule table: fixed, threshold, factor), DPad's kept suffix. Pure functions over the
current block's rows ([B, Q] with Q = block_length)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from lacache_jax.config import DPadConfig

_DPAD_STREAM = 1 << 20  # fold_in tag separating DPad draws from sampling draws


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


def confidence(logits_BQV: jax.Array, x0_BQ: jax.Array, remasking: str,
               keys_B: jax.Array) -> jax.Array:
    """`low_confidence`: softmax probability of the chosen token (fp32, against the
    reference's float64: 1e-7 relative, immaterial except at exact threshold ties);
    `random`: uniform in [0, 1)."""
    if remasking == "random":
        return jax.vmap(lambda k: jax.random.uniform(k, x0_BQ.shape[1:]))(keys_B)
    chosen = jnp.take_along_axis(logits_BQV, x0_BQ[..., None], axis=-1)[..., 0]
    return jnp.exp(chosen - jax.nn.logsumexp(logits_BQV, axis=-1))


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
    position's rank in it (0 = most confident; ties to the lower position)."""
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
    return ((rank == 0) | (conf >= threshold)) & masked_BQ


def reveal_factor(conf_BQ, masked_BQ, quota_B, factor: float) -> jax.Array:
    """Fast-dLLM factor rule: sort the N masked confidences c_0 >= c_1 >= ...; with thr_0 = -1
    and thr_i = 1 - factor / (i + 2), reveal the top i for the first i with c_i < thr_i, or all
    N if none fails. Released-code quirk kept on purpose: when the first failure is the last
    candidate (i = N - 1) all N are revealed, so two remaining masks always go together."""
    conf, order, rank = _ranked(conf_BQ, masked_BQ)
    n_B = masked_BQ.sum(-1)
    i = jnp.arange(conf.shape[-1])
    sorted_conf = jnp.take_along_axis(conf, order, axis=-1)
    thr = jnp.where(i == 0, -1.0, 1.0 - factor / (i + 2.0))
    fails = (sorted_conf < thr) & (i < n_B[:, None])
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
    distance d = column - block_end < window."""
    per_row = jnp.ndim(block_end) == 1
    d = jnp.arange(T) - (block_end[:, None] if per_row else block_end)
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
    return (d < 0) | kept


def dpad_block_keys(keys_B: jax.Array, block: int | jax.Array) -> jax.Array:
    """Per-row keys of the DPad draw for block `block` (one index, or one per row [B])."""
    stream = jax.vmap(lambda k: jax.random.fold_in(k, _DPAD_STREAM))(keys_B)
    return jax.vmap(jax.random.fold_in)(stream, jnp.broadcast_to(block, stream.shape))
