"""Train the small demo LLaDA on the arithmetic task with LLaDA's SFT objective, and export it
in the Hugging Face LLaDA layout (what `python -m convert` reads).

    python -m benchmarks.train_demo --out demo_model [--steps 3000 | --minutes 6] [--batch 512]

`--minutes` times the compiled step first and sets the step count to fit the budget, so the
learning-rate schedule still runs to its end. Batches are drawn fresh every step (with
replacement) from the training split; building one overlaps the previous step's device work.

Objective (SFT form): the prompt is never masked; each answer token (answers right-padded
with EOS to the canvas) is masked with probability p = (1 - eps) t + eps, t ~ U(0, 1) per
sample; cross-entropy on masked tokens, weighted 1/p and divided by the answer length.
Prompts are left-padded with masked keys and positions counted from the first real token,
exactly as `lj.generate` runs them.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

import lacache_jax as lj
from benchmarks import arith
from lacache_jax.model import forward_hidden, lm_head
from lacache_jax.tokenizer import Tokenizer

PROMPT_LEN = 16   # longest prompt: 2 markers + 5 + '+' + 5 + '=' = 14 tokens
GEN_LEN = 64      # longest answer: 5 columns of 11 chars ('9+9+1=19c1;') + '#' + 6 digits = 62
EPS = 1e-3


def demo_config(**overrides) -> lj.ModelConfig:
    ids = arith.special_ids()
    base = dict(d_model=256, n_layers=8, n_heads=4, n_kv_heads=4, d_ff=768, vocab_size=32,
                rope_theta=10000.0, norm_eps=1e-5, max_seq_len=PROMPT_LEN + GEN_LEN,
                mask_id=ids[arith.MASK], eos_id=ids[arith.EOS], pad_id=ids[arith.EOS])
    return lj.ModelConfig(**{**base, **overrides})


def encode_batch(problems, encode, eos_id: int):
    """Left-padded prompts + EOS-padded answers: tokens, prompt padding, answer mask."""
    B, T = len(problems), PROMPT_LEN + GEN_LEN
    tokens = np.full((B, T), eos_id, np.int32)
    pad = np.zeros(B, np.int32)
    for i, (a, b) in enumerate(problems):
        p, ans = encode(arith.prompt_text(a, b)), encode(arith.answer_text(a, b))
        if len(p) > PROMPT_LEN or len(ans) >= GEN_LEN:
            raise ValueError(f"problem {a}+{b} does not fit the canvas")
        pad[i] = PROMPT_LEN - len(p)
        tokens[i, pad[i]:PROMPT_LEN] = p
        tokens[i, PROMPT_LEN:PROMPT_LEN + len(ans)] = ans
    return tokens, pad


def sft_loss(params, cfg: lj.ModelConfig, tokens_BT, pad_B, key):
    B, T = tokens_BT.shape
    col = jnp.arange(T)
    answer = jnp.broadcast_to(col >= PROMPT_LEN, (B, T))
    t = jax.random.uniform(jax.random.fold_in(key, 0), (B, 1))
    p_mask = (1 - EPS) * t + EPS
    masked = answer & (jax.random.uniform(jax.random.fold_in(key, 1), (B, T)) < p_mask)
    noisy = jnp.where(masked, cfg.mask_id, tokens_BT)
    key_mask = col[None, :] >= pad_B[:, None]
    positions = jnp.maximum(col[None, :] - pad_B[:, None], 0)
    logits = lm_head(params, cfg, forward_hidden(params, cfg, noisy, key_mask, positions))
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens_BT)
    per_token = jnp.where(masked, ce / p_mask, 0.0) / GEN_LEN  # answer length: the whole gen
    return per_token.sum() / B


def make_train_step(cfg: lj.ModelConfig, optimizer):
    @jax.jit
    def step(params, opt_state, tokens, pad, key, lr):
        loss, grads = jax.value_and_grad(sft_loss)(params, cfg, tokens, pad, key)
        opt_state.hyperparams["learning_rate"] = lr
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step


def lr_at(i: int, steps: int, peak: float) -> float:
    """Linear warm-up over the first 5% (at most 200 steps), then cosine decay to 0."""
    warm = min(200, steps // 20 + 1)
    if i < warm:
        return peak * (i + 1) / warm
    return 0.5 * peak * (1 + np.cos(np.pi * (i - warm) / max(1, steps - warm)))


def train(cfg: lj.ModelConfig, steps: int | None, batch: int, lr: float, seed: int = 0,
          progress: bool = True, minutes: float | None = None):
    """Returns (params in fp32, losses every 50 steps, steps run). With `minutes`, `steps`
    is chosen to fit that much training time."""
    if (steps is None) == (minutes is None):
        raise ValueError("give exactly one of steps and minutes")
    with tempfile.TemporaryDirectory() as d:
        arith.write_tokenizer(d)
        encode = Tokenizer(d).encode
    rng = random.Random(seed)
    next_batch = lambda: encode_batch(arith.draw("train", batch, rng), encode, cfg.eos_id)
    params = lj.init_params(cfg, jax.random.key(seed), jnp.float32)
    optimizer = optax.inject_hyperparams(optax.adamw)(learning_rate=lr, b2=0.98,
                                                      weight_decay=0.01)
    opt_state = optimizer.init(params)
    step = make_train_step(cfg, optimizer)
    keys = lambda i: jax.random.fold_in(jax.random.key(seed + 1), i)
    if minutes is not None:  # time throwaway steps on copies (the first one compiles)
        p, o = params, opt_state
        for i in range(25):
            if i == 5:
                jax.block_until_ready(p)
                t0 = time.perf_counter()
            p, o, _ = step(p, o, *next_batch(), keys(2**31 - 1), 0.0)
        jax.block_until_ready(p)
        steps = max(1, int(minutes * 60 * 20 / (time.perf_counter() - t0)))
        rng = random.Random(seed)
    losses = []
    for i in tqdm(range(steps), desc="training", disable=not progress):
        params, opt_state, loss = step(params, opt_state, *next_batch(), keys(i),
                                       lr_at(i, steps, lr))
        if i % 50 == 0 or i == steps - 1:
            losses.append(float(loss))
    return params, losses, steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="HF-layout directory to write")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--minutes", type=float, default=None, help="training time budget")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--layers", type=int, default=None)
    args = ap.parse_args()
    cfg = demo_config() if args.layers is None else demo_config(n_layers=args.layers)
    t0 = time.perf_counter()
    if args.steps is None and args.minutes is None:
        args.steps = 3000
    params, losses, steps = train(cfg, args.steps, args.batch, args.lr, minutes=args.minutes)
    print(f"trained {cfg.n_params / 1e6:.1f}M params, {steps} steps of {args.batch} in "
          f"{time.perf_counter() - t0:.0f} s; loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    from convert import export_hf
    export_hf(args.out, cfg, params, dtype=jnp.bfloat16, force=True)
    arith.write_tokenizer(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
