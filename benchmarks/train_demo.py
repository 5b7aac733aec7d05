"""Train a small LLaDA on one of the synthetic tasks (`benchmarks/tasks.py`) with LLaDA's SFT
objective, and export it in the Hugging Face LLaDA layout (what `python -m convert` reads),
tokenizer files included.

    python -m benchmarks.train_demo --out demo_model [--steps 3000 | --minutes 6] [--batch 512]
    python -m benchmarks.train_demo --task chain --out chain_model --minutes 8

The task (default `arith`, the shipped demo) fixes the model size, the canvas and the default
batch, learning rate and steps; the flags override them.

`--minutes` times the compiled step first (with the data as the run will get it) and sets
the step count to fit the budget, so the learning-rate schedule still runs to its end; a run
that falls 15% behind stops there and says so. Batches are drawn fresh every step (with
replacement) from the training split; building one overlaps the previous step's device work.
Building a `chain` batch in Python takes longer than the GPU's step (0.13 s against ~0.03 s
on the H200: the first chain run was host-bound at 7.5 steps/s), so `--workers N` builds
them in N processes, batch i from its own seed (the same batches for any N; N = 0 keeps the
single stream the demo model was trained with). The same runs made ~8 steps/s together on the
GPU, about 50 TFLOP/s: fp32 matmuls at the CUDA-core rate; `chain` therefore runs its forward
pass in bf16 (fp32 master weights and loss; `--compute`), the demo stays fp32 as trained.
In bf16 the attention goes to cuDNN (the padded prompts' key mask as a full [B, 1, L, S]
bias), in fp32 to XLA's; on the GPU a bf16 run times a few steps of each on one batch, device
only, and trains with the faster (`--attention auto`; on the H200 cuDNN, 8.6 against 7.5
steps/s). With `--minutes` the step count comes from the slowest of that device-only rate,
20 timed steps with the batches streamed, and the workers' supply (their own seconds per
batch: 20 timed steps can see the queue filled during compilation drain at once), and the log
says whether the host or the device bounds the run. The step once slowed from ~9 to ~3-4
steps/s as the weights trained: the bf16 embedding gradient, a scatter-add, took most of it
and grew (benchmarks/RESULTS.md, sixth session); `embed_lookup` now takes that gradient as a
one-hot product.

Objective (SFT form): the prompt is never masked; each answer token (answers right-padded
with EOS to the canvas) is masked with probability p = (1 - eps) t + eps, t ~ U(0, 1) per
sample; cross-entropy on masked tokens, weighted 1/p and divided by the answer length.
Prompts are left-padded with masked keys and positions counted from the first real token,
exactly as `lj.generate` runs them. Tasks whose answers have free choices (`chain`: the
order of independent statements) draw them afresh for every sample.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import functools
import json
import multiprocessing
import os
import random
import re
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

import lacache_jax as lj
from benchmarks import tasks
from lacache_jax.model import attention_implementation, lm_head, rope_tables, run_blocks
from lacache_jax.tokenizer import Tokenizer

PROMPT_LEN = tasks.ARITH.prompt_len  # the demo's canvas: 16 + 64
GEN_LEN = tasks.ARITH.gen_len
EPS = 1e-3


def demo_config(**overrides) -> lj.ModelConfig:
    return tasks.model_config("arith", **overrides)


def encode_batch(problems, encode, eos_id: int, task: str | tasks.Task = "arith",
                 rng: random.Random | None = None):
    """Left-padded prompts + EOS-padded answers (`rng` draws the task's free choices):
    tokens [B, prompt_len + gen_len] and each row's prompt padding [B]."""
    t = tasks.get(task)
    B, T = len(problems), t.prompt_len + t.gen_len
    tokens = np.full((B, T), eos_id, np.int32)
    pad = np.zeros(B, np.int32)
    for i, problem in enumerate(problems):
        p, ans = encode(t.prompt(problem)), encode(t.answer(problem, rng))
        if len(p) > t.prompt_len or len(ans) >= t.gen_len:
            raise ValueError(f"problem {t.prompt(problem)!r} does not fit the {t.name} canvas")
        pad[i] = t.prompt_len - len(p)
        tokens[i, pad[i]:t.prompt_len] = p
        tokens[i, t.prompt_len:t.prompt_len + len(ans)] = ans
    return tokens, pad


def embed_lookup(embed_VD: jax.Array, tokens_BT: jax.Array) -> jax.Array:
    """`embed_VD[tokens_BT]`; in half precision with its gradient as a one-hot product summed
    in fp32. The gather's own gradient is XLA's scatter-add onto the few vocabulary rows: on
    the H200 it took 69 of a chain step's 106 ms and grew to 155 as the weights trained (its
    time depends on the values: how, we did not establish), and it sums in bf16 (RESULTS.md,
    sixth session). fp32 runs (the demo, as trained) keep XLA's gradient."""
    if embed_VD.dtype == jnp.float32:
        return embed_VD[tokens_BT]
    return _half_lookup(embed_VD, tokens_BT, embed_VD.shape[0], embed_VD.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _half_lookup(embed_VD, tokens_BT, V, dtype):
    return embed_VD[tokens_BT]


def _half_lookup_fwd(embed_VD, tokens_BT, V, dtype):
    return embed_VD[tokens_BT], tokens_BT


def _half_lookup_bwd(V, dtype, tokens_BT, g_BTD):
    one_hot_NV = jax.nn.one_hot(tokens_BT.reshape(-1), V, dtype=g_BTD.dtype)
    g_ND = g_BTD.reshape(one_hot_NV.shape[0], -1)
    g_VD = jnp.matmul(one_hot_NV.T, g_ND, preferred_element_type=jnp.float32)
    return g_VD.astype(dtype), None


_half_lookup.defvjp(_half_lookup_fwd, _half_lookup_bwd)


def sft_loss(params, cfg: lj.ModelConfig, tokens_BT, pad_B, key, prompt_len: int = PROMPT_LEN,
             compute=jnp.float32):
    """`compute`: the dtype the forward pass runs in (fp32 master weights are cast to it, so
    the gradients reach them in fp32; the cross-entropy is fp32 either way)."""
    params = jax.tree.map(lambda a: a.astype(compute), params)
    B, T = tokens_BT.shape
    col = jnp.arange(T)
    answer = jnp.broadcast_to(col >= prompt_len, (B, T))
    t = jax.random.uniform(jax.random.fold_in(key, 0), (B, 1))
    p_mask = (1 - EPS) * t + EPS
    masked = answer & (jax.random.uniform(jax.random.fold_in(key, 1), (B, T)) < p_mask)
    noisy = jnp.where(masked, cfg.mask_id, tokens_BT)
    key_mask = col[None, :] >= pad_B[:, None]
    positions = jnp.maximum(col[None, :] - pad_B[:, None], 0)
    cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
    x = run_blocks(embed_lookup(params.embed, noisy), params.layers, cfg, cos, sin, key_mask)[0]
    logits = lm_head(params, cfg, x)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens_BT)
    # Answer length: the whole gen, EOS padding included (what LLaDA's SFT divides by).
    per_token = jnp.where(masked, ce / p_mask, 0.0) / (T - prompt_len)
    return per_token.sum() / B


def make_train_step(cfg: lj.ModelConfig, optimizer, prompt_len: int = PROMPT_LEN,
                    compute=jnp.float32, attention: str | None = None):
    """`attention`: "cudnn" or "xla" forces the attention implementation (on the GPU in half
    precision; elsewhere it is XLA's anyway); None keeps the model's default."""
    @jax.jit
    def step(params, opt_state, tokens, pad, key, lr):
        with (contextlib.nullcontext() if attention is None
              else attention_implementation(attention)):  # while tracing, each retrace too
            loss, grads = jax.value_and_grad(sft_loss)(params, cfg, tokens, pad, key,
                                                       prompt_len, compute)
        opt_state.hyperparams["learning_rate"] = lr
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step


def lr_at(i: int, steps: int, peak: float) -> float:
    """Linear warm-up over the first 5% (at most 200 steps), then cosine decay to 0."""
    warm = min(200, steps // 20 + 1)
    if i < warm:
        return peak * (i + 1) / warm
    # A Python float both ways: a NumPy scalar would be a second jit signature (a recompile).
    return float(0.5 * peak * (1 + np.cos(np.pi * (i - warm) / max(1, steps - warm))))


class CharEncoder:
    """`Tokenizer.encode` of a task's character-level vocabulary (arith.write_tokenizer:
    specials matched whole, every other character one token) as a table lookup: 60% of a
    chain batch's build time was the tokenizer. Text with a character outside the
    vocabulary goes to the tokenizer itself, for its error."""

    def __init__(self, tokenizer_dir):
        self.tokenizer = Tokenizer(tokenizer_dir)
        vocab = self.tokenizer._tok.get_vocab()
        specials = sorted((t for t in vocab if len(t) > 1), key=len, reverse=True)
        self.special = {t: vocab[t] for t in specials}
        self.split = re.compile("(" + "|".join(map(re.escape, specials)) + ")")
        self.table = np.full(128, -1, np.int32)
        for t, i in vocab.items():
            if len(t) == 1 and ord(t) < 128:
                self.table[ord(t)] = i

    def __call__(self, text: str) -> list[int]:
        ids = []
        for piece in self.split.split(text):
            if piece in self.special:
                ids.append(self.special[piece])
            elif piece:
                if not piece.isascii():
                    return self.tokenizer.encode(text)
                chunk = self.table[np.frombuffer(piece.encode("ascii"), np.uint8)]
                if (chunk < 0).any():
                    return self.tokenizer.encode(text)
                ids.extend(chunk.tolist())
        return ids


@functools.cache
def _encoder(task: str) -> CharEncoder:
    with tempfile.TemporaryDirectory(prefix="lacache_tok_") as d:  # loads whole
        tasks.get(task).write_tokenizer(d)
        return CharEncoder(d)


def numbered_batch(task: str, batch: int, eos_id: int, seed: int, i: int):
    """Training batch i of a run with `seed`, from its own random stream (any process)."""
    rng = random.Random(f"{task}-{seed}-{i}")
    return encode_batch(tasks.get(task).draw("train", batch, rng), _encoder(task), eos_id,
                        task, rng)


def _cpu_only():  # the workers never touch the accelerator
    os.environ["JAX_PLATFORMS"] = "cpu"


def _timed_batch(*args):
    t0 = time.perf_counter()
    return numbered_batch(*args), time.perf_counter() - t0


class prefetched:
    """Batches start, start+1, ... built by `workers` processes, 2 per worker queued ahead.
    `supply()`: the batches per second the workers sustain, from the seconds each batch took
    to build inside its worker (a rate timed on the consumer's side over a few steps is
    bursty: it sees the queue filled during compilation drain at once)."""

    def __init__(self, task: str, batch: int, eos_id: int, seed: int, workers: int,
                 start: int = 0):
        self.args, self.workers, self.i = (task, batch, eos_id, seed), workers, start
        self.pool = concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"), initializer=_cpu_only)
        self.ahead: collections.deque = collections.deque()
        self.build_s: list[float] = []

    def __iter__(self):
        return self

    def __next__(self):
        while len(self.ahead) < 2 * self.workers:
            self.ahead.append(self.pool.submit(_timed_batch, *self.args, self.i))
            self.i += 1
        batch, seconds = self.ahead.popleft().result()
        self.build_s.append(seconds)
        return batch

    def supply(self) -> float:
        """Workers / mean build seconds over the last 4 x workers batches, leaving out the
        first 2 x workers (built while the main process compiled, on the same CPUs) once
        there are more; inf before any batch."""
        built = self.build_s[2 * self.workers:] or self.build_s
        recent = built[-4 * self.workers:]
        return self.workers * len(recent) / sum(recent) if recent else float("inf")

    def close(self):
        self.pool.shutdown(cancel_futures=True)


ATTENTION = ("auto", "cudnn", "xla")


def attention_candidates(attention: str, dtype) -> list[str]:
    """The implementations `auto` chooses between: both only where they differ (the GPU in
    half precision; elsewhere the model runs XLA's whatever is asked)."""
    if attention != "auto":
        return [attention]
    if jax.default_backend() == "gpu" and dtype != jnp.float32:
        return ["cudnn", "xla"]
    return ["auto"]


def device_rate(step, params, opt_state, batch, key, n: int = 10) -> float:
    """Steps per second of `step` on one batch already on the device (compiles first)."""
    tokens, pad = jax.device_put(batch)
    p, o, _ = step(params, opt_state, tokens, pad, key, 0.0)
    jax.block_until_ready(p)
    t0 = time.perf_counter()
    for _ in range(n):
        p, o, _ = step(p, o, tokens, pad, key, 0.0)
    jax.block_until_ready(p)
    return n / (time.perf_counter() - t0)


def train(cfg: lj.ModelConfig, steps: int | None, batch: int, lr: float, seed: int = 0,
          progress: bool = True, minutes: float | None = None,
          task: str | tasks.Task = "arith", log_every: int = 50, workers: int = 0,
          compute: str | None = None, attention: str = "auto", init=None):
    """Returns (params in fp32, losses every `log_every` steps and at the last, steps run).
    `init`: params to start from (a trained model to train on) instead of a random draw.
    With `minutes`, `steps` is chosen to fit that much training time. `workers` > 0 builds
    the batches in that many processes (a registered task by name only). `compute` ("fp32"
    or "bf16"; default: the task's) is the forward pass's dtype. `attention`: "cudnn", "xla"
    or "auto" (where the two differ, the faster on a few timed steps)."""
    if (steps is None) == (minutes is None):
        raise ValueError("give exactly one of steps and minutes")
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
    t = tasks.get(task)
    if cfg.max_seq_len < t.prompt_len + t.gen_len:
        raise ValueError(f"cfg.max_seq_len={cfg.max_seq_len} is shorter than the {t.name} "
                         f"canvas ({t.prompt_len} + {t.gen_len})")
    with tempfile.TemporaryDirectory() as d:
        t.write_tokenizer(d)
        encode = CharEncoder(d)
    rng = random.Random(seed)
    with contextlib.ExitStack() as cleanup:  # the worker pool goes whatever happens
        if workers:
            if tasks.TASKS.get(t.name) is not t:
                raise ValueError(f"workers need a registered task, not {t.name!r}")
            stream = prefetched(t.name, batch, cfg.eos_id, seed, workers)
            cleanup.callback(stream.close)
            next_batch = lambda: next(stream)
        else:
            next_batch = lambda: encode_batch(t.draw("train", batch, rng), encode, cfg.eos_id,
                                              t, rng)
        params = (lj.init_params(cfg, jax.random.key(seed), jnp.float32) if init is None
                  else jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), init))
        optimizer = optax.inject_hyperparams(optax.adamw)(learning_rate=lr, b2=0.98,
                                                          weight_decay=0.01)
        opt_state = optimizer.init(params)
        dtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16}[compute or t.compute]
        keys = lambda i: jax.random.fold_in(jax.random.key(seed + 1), i)
        steps_by = {a: make_train_step(cfg, optimizer, t.prompt_len, dtype,
                                       None if a == "auto" else a)
                    for a in attention_candidates(attention, dtype)}
        if len(steps_by) > 1 or minutes is not None:  # device-only rates on one batch
            # Its own draw: the training batches stay those of any other --attention.
            timing_rng = random.Random(f"{t.name}-timing")
            fixed = encode_batch(t.draw("train", batch, timing_rng), encode, cfg.eos_id, t,
                                 timing_rng)
            rates = {a: device_rate(f, params, opt_state, fixed, keys(2**31 - 1))
                     for a, f in steps_by.items()}
            attention = max(rates, key=rates.get)
            print(f"{t.name}: device only, one batch: "
                  + ", ".join(f"{a} attention {r:.1f} steps/s" for a, r in rates.items())
                  + (f"; training with {attention}" if len(rates) > 1 else ""), flush=True)
        step = steps_by[attention]
        deadline = None
        if minutes is not None:  # time throwaway steps on copies (compiled already)
            # Start the clock once the batches the workers queued during compilation are
            # used up: timing those ran a GPU-bound rate where the run is host-bound, and set
            # twice the steps the budget holds (issue 15's third run).
            warm = 5 + 2 * workers
            p, o = params, opt_state
            for i in range(warm + 20):
                if i == warm:
                    jax.block_until_ready(p)
                    t0 = time.perf_counter()
                p, o, _ = step(p, o, *next_batch(), keys(2**31 - 1), 0.0)
            jax.block_until_ready(p)
            rate = min(20 / (time.perf_counter() - t0), rates[attention])
            if workers:  # and the workers' supply, which 20 timed steps can overstate
                supply = stream.supply()
                print(f"{t.name}: {workers} workers ({len(os.sched_getaffinity(0))} CPUs "
                      f"usable) build a batch in {workers / supply:.2f} s: {supply:.1f} "
                      f"batches/s", flush=True)
                rate = min(rate, supply)
            steps = max(1, int(minutes * 60 * rate))
            print(f"{t.name}: {rate:.1f} steps/s ("
                  f"{'host' if rate < 0.9 * rates[attention] else 'device'}-bound), {steps} "
                  f"steps for {minutes} minutes", flush=True)
            rng = random.Random(seed)
            # A safety net, not the schedule: a run that falls behind its estimate stops
            # (short of its learning-rate schedule's end, and says so) rather than overrun
            # its box.
            deadline = time.perf_counter() + 1.15 * minutes * 60
        losses = []
        # Not on a terminal (a device log): a progress line every 30 s, not a bar redrawn
        # 10x/s.
        bar = tqdm(range(steps), desc="training", disable=not progress,
                   mininterval=0.1 if os.isatty(2) else 30)
        for i in bar:
            params, opt_state, loss = step(params, opt_state, *next_batch(), keys(i),
                                           lr_at(i, steps, lr))
            if i % log_every == 0 or i == steps - 1:
                losses.append(float(loss))
            if deadline is not None and time.perf_counter() > deadline:
                losses.append(float(loss))
                print(f"stopped at step {i + 1} of {steps}: 1.15x the time budget",
                      flush=True)
                steps = i + 1
                break
    return params, losses, steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="HF-layout directory to write")
    ap.add_argument("--task", default="arith", choices=sorted(tasks.TASKS))
    ap.add_argument("--steps", type=int, default=None, help="default: the task's")
    ap.add_argument("--minutes", type=float, default=None, help="training time budget")
    ap.add_argument("--batch", type=int, default=None, help="default: the task's")
    ap.add_argument("--lr", type=float, default=None, help="default: the task's")
    ap.add_argument("--layers", type=int, default=None, help="default: the task's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", default=None, metavar="HF_DIR",
                    help="go on training this model (an earlier run's --out: the task's model "
                         "and tokenizer) with a fresh optimizer and schedule; give another "
                         "--seed so the batches are new ones")
    ap.add_argument("--compute", choices=["fp32", "bf16"], default=None,
                    help="the forward pass's dtype (default: the task's)")
    ap.add_argument("--attention", choices=ATTENTION, default="auto",
                    help="attention in training (auto: on the GPU in bf16, the faster of "
                         "cudnn and xla on a few timed steps)")
    ap.add_argument("--workers", type=int, default=0,
                    help="processes building the batches (0: in this one, the demo's stream)")
    ap.add_argument("--eval", type=int, default=0, metavar="N",
                    help="then score N held-out problems (fixed schedule and threshold 0.9) "
                         "with the exported bf16 weights, to see at once where the model landed")
    args = ap.parse_args(argv)
    if args.eval < 0:
        ap.error(f"--eval must be >= 0, got {args.eval}")
    t = tasks.get(args.task)
    cfg = tasks.model_config(t, **({} if args.layers is None else {"n_layers": args.layers}))
    batch = t.batch if args.batch is None else args.batch
    lr = t.lr if args.lr is None else args.lr
    t0 = time.perf_counter()
    if args.steps is None and args.minutes is None:
        args.steps = t.steps
    init = None if args.init is None else load_init(args.init, cfg, t)
    params, losses, steps = train(cfg, args.steps, batch, lr, seed=args.seed,
                                  minutes=args.minutes, task=t, workers=args.workers,
                                  compute=args.compute, attention=args.attention, init=init)
    print(f"{t.name}: trained {cfg.n_params / 1e6:.1f}M params, {steps} steps of {batch} in "
          f"{time.perf_counter() - t0:.0f} s; loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    print("loss every 50 steps: " + " ".join(f"{x:.3f}" for x in losses))
    from convert import export_hf
    export_hf(args.out, cfg, params, dtype=jnp.bfloat16, force=True)
    t.write_tokenizer(args.out)
    print(f"wrote {args.out}")
    if args.eval:
        quick_eval(jax.tree.map(lambda a: a.astype(jnp.bfloat16), params), cfg, t, args.out,
                   args.eval)
    return 0


def load_init(hf_dir: str, cfg: lj.ModelConfig, task: tasks.Task):
    """An earlier run's exported model (HF layout) as fp32 params, refused unless it is this
    task's model (config and tokenizer), so training goes on from where that run ended (bf16
    weights: the fp32 master copy was not exported)."""
    from convert import convert
    vocab = lambda d: json.loads((Path(d) / "tokenizer.json").read_text())["model"]["vocab"]
    with tempfile.TemporaryDirectory() as d:
        task.write_tokenizer(d)
        if not (Path(hf_dir) / "tokenizer.json").exists() or vocab(hf_dir) != vocab(d):
            raise ValueError(f"{hf_dir}: its tokenizer is not the {task.name} task's")
        convert(hf_dir, f"{d}/ckpt", dtype="float32", progress=False)
        got, params = lj.load(f"{d}/ckpt", progress=False)
    if got != cfg:
        raise ValueError(f"{hf_dir}: its model is not the {task.name} task's: {got} != {cfg}")
    return params


def quick_eval(params, cfg: lj.ModelConfig, task: tasks.Task, tokenizer_dir, n: int) -> dict:
    """Accuracy and tokens per step of the fixed schedule and threshold 0.9 on `n` held-out
    problems (benchmarks/accuracy.py measures every mode)."""
    from benchmarks import accuracy
    tok = Tokenizer(tokenizer_dir)
    problems = task.sample("test", n, seed=0)
    out = {}
    for name in ("fixed", "threshold"):
        r = accuracy.evaluate(params, cfg, tok, problems, accuracy.MODES[name][0], task=task)
        lo, hi = r["ci95"]
        print(f"{task.name} held-out {name}: accuracy {r['accuracy']:.3f} ({lo:.3f}-{hi:.3f}), "
              f"{r['tokens_per_step']:.2f} tokens/step, NFE {r['nfe']:.1f}", flush=True)
        out[name] = r
    return out


if __name__ == "__main__":
    raise SystemExit(main())
