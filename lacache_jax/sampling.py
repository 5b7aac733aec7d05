"""What to reveal at a step: schedules, Gumbel sampling, confidence, parallel-decoding rules,
DPad's kept suffix. Pure functions over the current block's rows ([B, Q] with Q = block)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from lacache_jax.config import DPadConfig


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


def choose(conf_BQ: jax.Array, masked_BQ: jax.Array, k_B: jax.Array | None = None,
           threshold: float | None = None, factor: float | None = None) -> jax.Array:
    """Positions to reveal [B, Q] among `masked_BQ`, by confidence.

    - fixed: the `k_B` most confident;
    - threshold (Fast-dLLM): all with confidence >= threshold, and always the most confident;
    - factor (Fast-dLLM): sort the N masked confidences c_0 >= c_1 >= ...; with thr_0 = -1 and
      thr_i = 1 - factor / (i + 2), reveal the top i for the first i with c_i < thr_i, or all
      N if none fails. Released-code quirk kept on purpose: when the first failure is the last
      candidate (i = N - 1) all N are revealed, so two remaining masks always go together.
    Ties in confidence go to the lower position.
    """
    conf = jnp.where(masked_BQ, conf_BQ, -jnp.inf)
    order = jnp.argsort(-conf, axis=-1, stable=True)
    rank = jnp.argsort(order, axis=-1)  # rank[b, q]: 0 for the most confident
    n_B = masked_BQ.sum(-1)
    if threshold is not None:
        reveal = (rank == 0) | (conf >= threshold)
    elif factor is not None:
        Q = conf.shape[-1]
        i = jnp.arange(Q)
        sorted_conf = jnp.take_along_axis(conf, order, axis=-1)
        thr = jnp.where(i == 0, -1.0, 1.0 - factor / (i + 2.0))
        fails = (sorted_conf < thr) & (i < n_B[:, None])
        first = jnp.where(fails.any(-1), jnp.argmax(fails, axis=-1), n_B)
        count = jnp.where(first == n_B - 1, n_B, first)
        reveal = rank < count[:, None]
    else:
        reveal = rank < k_B[:, None]
    return reveal & masked_BQ


def dpad_keep(dpad: DPadConfig, keys_B: jax.Array, block_end: jax.Array, T: int) -> jax.Array:
    """Which canvas columns a block sees [B, T]: everything before `block_end`, and a random
    subset of the suffix at distance d = column - block_end < window."""
    d = jnp.arange(T) - block_end
    in_window = (d >= 0) & (d < dpad.window)
    # One draw per suffix distance (not per column), so left padding cannot shift the draws.
    u = jax.vmap(lambda k: jax.random.uniform(k, (dpad.window,)))(keys_B)
    u = u[:, jnp.clip(d, 0, dpad.window - 1)]
    if dpad.strategy == "gaussian":
        z = dpad.k * d / (dpad.window - 1)
        p = dpad.scale * jnp.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
        kept = in_window & (u < p)
    else:  # uniform: the `keep` window positions with the smallest draws
        score = jnp.where(in_window, u, jnp.inf)
        rank = jnp.argsort(jnp.argsort(score, axis=-1), axis=-1)
        kept = in_window & (rank < dpad.keep)
    return (d < 0) | kept
