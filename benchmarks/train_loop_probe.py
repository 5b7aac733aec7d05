"""Where a chain training step's time goes outside the device (issue 15): the training loop
ran at 3.9 steps/s where the same step on one batch ran 8.6 and the workers supplied 455
batches/s. Times `--steps` steps of each variant, adding one ingredient of the real loop at a
time:

  device   one batch already on the device, one key, lr 0 (train_demo.device_rate)
  numpy    the same batch as NumPy arrays (a host-to-device copy per step)
  keys     + a fresh key per step (keys(i): two eager ops)
  lr       + the schedule's learning rate per step
  stream   + batches from the worker processes (train_demo.prefetched)
  loss     + float(loss) every 50 steps (a sync)

    python -m benchmarks.train_loop_probe [--task chain-d2] [--workers 14] [--steps 60]
                                          [--order device,numpy,keys,lr,stream,loss]

Each variant's line also gives the GPU's SM clock, power draw, temperature and active
throttle reasons after it (nvidia-smi), the weights' largest magnitude and whether all are
finite, and `--order` may repeat a variant: a rate that falls with time whatever the variant
is the GPU (or the process), not the ingredient. `--profile N` then traces N more steps
(jax.profiler) and prints per step the device's kernel time, its largest kernels, and the
host's largest events: whether a slower step is more device work or a device left waiting.
"""

from __future__ import annotations

import argparse
import gc
import subprocess
import time

import jax
import jax.numpy as jnp
import optax

import lacache_jax as lj
from benchmarks import tasks, train_demo
from benchmarks.common import profile


def gpu_state() -> str:
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu,"
             "clocks_throttle_reasons.active", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "(no nvidia-smi)"


@jax.jit
def weight_stats(params):
    leaves = jax.tree.leaves(params)
    return (jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in leaves])),
            jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="chain-d2")
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--attention", default="cudnn", choices=("cudnn", "xla"))
    ap.add_argument("--order", default="device,numpy,keys,lr,stream,loss")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after each variant, trace N more of its steps")
    args = ap.parse_args()
    t = tasks.get(args.task)
    cfg = tasks.model_config(t)
    params = lj.init_params(cfg, jax.random.key(0), jnp.float32)
    opt = optax.inject_hyperparams(optax.adamw)(learning_rate=t.lr, b2=0.98, weight_decay=0.01)
    state = opt.init(params)
    step = train_demo.make_train_step(cfg, opt, t.prompt_len, jnp.bfloat16, args.attention)
    fixed = train_demo.numbered_batch(t.name, t.batch, cfg.eos_id, 0, 0)
    on_device = jax.device_put(fixed)
    keys = lambda i: jax.random.fold_in(jax.random.key(1), i)
    const = keys(2**31 - 1)
    stream = train_demo.prefetched(t.name, t.batch, cfg.eos_id, 0, args.workers)
    variants = {
        "device": lambda i: (*on_device, const, 0.0),
        "numpy": lambda i: (*fixed, const, 0.0),
        "keys": lambda i: (*fixed, keys(i), 0.0),
        "lr": lambda i: (*fixed, keys(i), train_demo.lr_at(i, 3000, t.lr)),
        "stream": lambda i: (*next(stream), keys(i), train_demo.lr_at(i, 3000, t.lr)),
        "loss": lambda i: (*next(stream), keys(i), train_demo.lr_at(i, 3000, t.lr)),
    }
    p, o = params, state
    try:
        for name in args.order.split(","):
            inputs = variants[name]
            for i in range(5 if name not in ("stream", "loss") else 5 + 2 * args.workers):
                p, o, loss = step(p, o, *inputs(i))
            jax.block_until_ready(p)
            t0 = time.perf_counter()
            for i in range(args.steps):
                p, o, loss = step(p, o, *inputs(1000 + i))
                if name == "loss" and i % 50 == 0:
                    float(loss)
            jax.block_until_ready(p)
            dt = time.perf_counter() - t0
            cache = getattr(step, "_cache_size", lambda: "?")()
            top, finite = weight_stats(p)
            print(f"{name:7s} {args.steps / dt:6.2f} steps/s  {gpu_state()}; jit cache "
                  f"{cache}, live arrays {len(jax.live_arrays())}, gc objects "
                  f"{len(gc.get_objects())}, max |w| {float(top):.3g}, finite "
                  f"{bool(finite)}", flush=True)
            if args.profile:
                def run():
                    nonlocal p, o
                    for i in range(args.profile):
                        p, o, _ = step(p, o, *inputs(5000 + i))
                    jax.block_until_ready(p)
                print(profile(run, args.profile), flush=True)
    finally:
        stream.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
