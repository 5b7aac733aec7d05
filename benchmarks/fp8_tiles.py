"""Tile sweep for the FP8 GEMM (`kernels/fp8_matmul.py`) on LLaDA-8B's FFN shapes, next to
XLA's FP8 dot (cuBLASLt, one scale per tensor: the ceiling) and XLA's bf16 dot.

    python -m benchmarks.fp8_tiles [--ms 32,256,4096,16384] [--shapes gate_up,down]
        [--kernels pallas,mgpu,pallas_default,mgpu_swap] [--persistent]
        [--block-ns 32,64,128] [--splits 1,2,4,12]
        [--stages 3,4] [--warps 4,8] [--rounds 5] [--device-time]

Prints one row per (shape, M, kernel, tiles) and writes them all; the fastest per M is what
the kernels' defaults and `fp8_matmul`'s dispatch should pick. `--block-ns` / `--splits`
(Pallas only) sweep the column tile and the K splits instead, at the default row tile and
warps (or `--warps`), over `--stages` (default 3 and 4), tiles under 128 columns transposed
and not: at decode rows each program's K loop is short (down at M 32 in 128-column tiles: 96
K groups over 12 splits, 8 a program), and narrower column tiles give as many programs with
fewer splits (longer loops, fewer fp32 partials). `--rounds R` times every setting R times,
round by round (a setting's rounds spread over the run, not back to back; each compiled
once), and ranks the settings by their median: with one timing each, two pipeline depths of
one tile differed 1.7x in the sixteenth session's sweep (RESULTS.md), too much to rank
neighbours by. `--device-time` times each setting by the profiler's device span per call
(`common.device_chained`: the split-K partials' sum included, each program's dispatch not),
which at decode rows is where the chained wall times and the step's trace parted
(twenty-second session).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import statistics

import jax
import jax.numpy as jnp

from benchmarks.common import (device_chained, exit_on_sigterm, measure_ceilings, time_chained,
                               write_result)
from kernels.fp8_matmul import sm_count
from kernels.fp8_matmul_mgpu import MgpuConfig, fp8_matmul_mgpu, swap_stages_that_fit
from kernels.fp8_matmul_triton import GROUP, TritonTiles, fp8_matmul_pallas, k_splits, row_tile
from lacache_jax.quant import quantize_act, quantize_weight

SHAPES = {"gate_up": (4096, 2 * 12288), "down": (12288, 4096)}  # (K, N)
# --kernels: Triton's sweep, Mosaic GPU's, Triton's default tiles alone, Mosaic GPU's
# decode sweep with the weights on wgmma's M side (`swap_configs`)
KERNELS = ("pallas", "mgpu", "pallas_default", "mgpu_swap")


@dataclasses.dataclass(frozen=True)
class DecodeSweep:
    """The Pallas decode sweep's axes; without column tiles or splits there is none."""
    block_ns: tuple[int, ...] = ()
    splits: tuple[int, ...] = ()
    stages: tuple[int, ...] = (3, 4)
    warps: tuple[int, ...] = ()  # empty: the default tiles' warps

    def __bool__(self) -> bool:
        return bool(self.block_ns or self.splits)


def configs(M: int, N: int, K: int, pallas: bool, persistent: bool = False,
            decode: DecodeSweep = DecodeSweep()):
    """With `decode`'s column tiles or splits (Pallas): the decode sweep of the module
    docstring.
    Otherwise Pallas (Triton): row tile from M up to 64, 128 columns, warps, pipeline stages
    (the first sweep, RESULTS.md, found 128-row and 256-column tiles slower), and from 64 rows
    down each tile transposed (`swap`: the weights on the MMA's wide side). Mosaic GPU (128
    columns: 256 was slower in the second sweep): warp-specialised or not (not at decode
    shapes, whose 64 rows fill one warpgroup), TMA stages, K groups per pipeline step, K
    splits (where the output tiles are fewer than 2 per SM)."""
    if pallas and decode:
        # column tile x K splits (default: k_splits' choice; splits not dividing the K groups
        # are left out) x stages x warps; a narrow tile also
        # untransposed: `swap` puts the weight rows on the MMA's M side, where fewer than 64
        # of them miss wgmma
        d, base, G = decode, TritonTiles.get_default(M, N, K), K // GROUP
        return [dataclasses.replace(base, block_n=bn, splits=sp, num_stages=ns, swap=sw,
                                    num_warps=nw)
                for bn in d.block_ns or (base.block_n,) if N % bn == 0
                for sp in d.splits or (k_splits(-(-M // base.block_m), N // bn, G),)
                if G % sp == 0
                for sw in ((base.swap, not base.swap) if bn < GROUP else (base.swap,))
                for ns in d.stages
                for nw in d.warps or (base.num_warps,)]
    if pallas:  # 128 columns, split-K as `k_splits` chooses it for each row tile
        base, G = TritonTiles.get_default(M, N, K), K // GROUP
        return [dataclasses.replace(base, block_m=bm, block_n=GROUP, num_warps=nw,
                                    splits=k_splits(-(-M // bm), N // GROUP, G),
                                    num_stages=ns, swap=sw)
                for sw, bm, nw, ns in itertools.product(
                    (False, True) if M <= 64 else (False,), sorted({row_tile(M), 64}), (4, 8),
                    (3, 4))]
    if persistent:  # warp-specialised, one CTA per tile vs one per SM looping over tiles
        return [MgpuConfig(stages=st, groups_per_step=gs, ctas=c) for st, gs, c in
                itertools.product((2, 4), (1, 2), (None, sm_count())) if st * gs <= 4]
    tiles = -(-M // 128) * (N // 128)
    splits = (1,) if tiles >= 2 * 132 else (1, 2, 4) if tiles >= 132 // 2 else (1, 4, 8)
    return [MgpuConfig(warp_specialized=w, stages=st, groups_per_step=gs, splits=sp)
            for w, st, gs, sp in itertools.product(
                (True, False) if M > 64 else (False,), (2, 4), (1, 2), splits)]


def swap_configs(M: int, N: int, K: int) -> list[MgpuConfig]:
    """The Mosaic GPU kernel at decode rows with the weights on wgmma's M side (`swap`): 64- or
    128-row weight tiles, K splits giving 1-3 CTAs an SM, pipelines up to 8 steps deep
    (at M 32 the CTA's compute is small: streaming the weights is the work), where they fit
    in shared memory (`swap_stages_that_fit`)."""
    G, out = K // GROUP, []
    for bn in (64, 128):
        tiles = N // bn
        for sp in (1, 2, 3, 4, 6, 8, 12):
            if G % sp or not 132 <= tiles * sp <= 3 * 132:
                continue
            for st, gs in ((4, 1), (8, 1), (4, 2)):
                if (G // sp) % gs or st > swap_stages_that_fit(bn, -(-M // 32) * 32, gs):
                    continue
                out.append(MgpuConfig(block_n=bn, stages=st, groups_per_step=gs, splits=sp,
                                      warp_specialized=False, swap=True))
    return out


def sweep(shape: str, M: int, rows: list, kernels: list[str], persistent: bool,
          copy_tb_s: float, decode: DecodeSweep = DecodeSweep(), rounds: int = 1,
          device_time: bool = False) -> None:
    K, N = SHAPES[shape]
    kx, kw = jax.random.split(jax.random.key(M))
    xq, xs = quantize_act(jax.random.normal(kx, (M, K), jnp.bfloat16))
    wq, ws = quantize_weight(jax.random.normal(kw, (K, N), jnp.bfloat16) * K ** -0.5)
    flops = 2.0 * M * K * N
    # the read floor: FP8 operands and bf16 out at the run's copy bandwidth (what bounds a
    # decode-shape GEMM; scales are < 1% of it)
    floor = (K * N + M * K + 2 * M * N) / copy_tb_s / 1e9
    n = 20 if M <= 4096 else 5
    base = dict(shape=shape, M=M, K=K, N=N, timing="device_span" if device_time else "chained")

    def time_ms(fn, *args):
        if device_time:  # the device's span per call: no dispatch, the partials' sum included
            return device_chained(fn, *args, n=n)["span_ms"]
        return time_chained(fn, *args, n=n)["median_ms"]
    x16 = jax.random.normal(kx, (M, K), jnp.bfloat16)
    w16 = jax.random.normal(kw, (K, N), jnp.bfloat16)
    for name, fn, args in (
            ("xla_fp8_per_tensor", lambda a: jax.lax.dot_general(
                a, wq, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16), (xq,)),
            ("xla_bf16", lambda a: a @ w16, (x16,))):
        t = time_ms(fn, *args)
        rows.append({**base, "kernel": name, "ms": t, "tflops": flops / t / 1e9,
                     "x_read_floor": t / floor})
        print(rows[-1], flush=True)
    def kernel_configs(kernel):
        if kernel == "mgpu_swap":
            return swap_configs(M, N, K)
        if kernel == "pallas_default":  # Triton's default tiles (dispatched off Hopper)
            return [TritonTiles.get_default(M, N, K)]
        return configs(M, N, K, kernel == "pallas", persistent, decode)
    cfgs = [(kernel, cfg) for kernel in kernels for cfg in kernel_configs(kernel)]
    # one function object per setting: `time_chained` compiles it once for every round
    fns = {cfg: functools.partial(timed, kernel, cfg, wq, ws) for kernel, cfg in cfgs}
    failed = set()
    for rnd, (kernel, cfg) in itertools.product(range(rounds), cfgs):
        if cfg in failed:
            continue
        settings = {**dataclasses.asdict(cfg), "round": rnd}
        try:
            t = time_ms(fns[cfg], xq, xs)
        except Exception as e:  # noqa: BLE001 (a tile that does not compile: go on)
            rows.append({**base, "kernel": kernel, **settings, "error": str(e)[:300]})
            print(rows[-1], flush=True)
            failed.add(cfg)
            continue
        rows.append({**base, "kernel": kernel, **settings, "ms": t,
                     "tflops": flops / t / 1e9, "x_read_floor": t / floor})
        print(rows[-1], flush=True)


def timed(kernel: str, cfg, wq, ws, xq, xs):
    if kernel.startswith("pallas"):
        return fp8_matmul_pallas(xq, xs, wq, ws, tiles=cfg)
    return fp8_matmul_mgpu(xq, xs, wq, ws, config=cfg)


def best_settings(rows: list) -> dict:
    """The fastest setting per shape, M and kernel by its median over rounds, with the
    rounds' spread ("ms" the median, "ms_rounds" every timing)."""
    timings: dict = {}
    for r in rows:
        if r["kernel"] in KERNELS and "ms" in r:
            setting = {k: v for k, v in r.items() if k not in ("round", "ms", "tflops",
                                                                "x_read_floor")}
            timings.setdefault(repr(sorted(setting.items())), []).append(r)
    best = {}
    for runs in timings.values():
        ms = statistics.median(r["ms"] for r in runs)
        r = {**runs[0], "ms": ms, "tflops": runs[0]["tflops"] * runs[0]["ms"] / ms,
             "x_read_floor": runs[0]["x_read_floor"] * ms / runs[0]["ms"],
             "ms_rounds": [r["ms"] for r in runs]}
        r.pop("round", None)
        key = f"{r['shape']}/{r['M']}/{r['kernel']}"
        if key not in best or ms < best[key]["ms"]:
            best[key] = r
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="32,256,4096,16384")
    ap.add_argument("--shapes", default="gate_up,down")
    ap.add_argument("--kernels", default="pallas,mgpu", help=", ".join(KERNELS))
    ap.add_argument("--persistent", action="store_true",
                    help="Mosaic GPU: per-tile vs persistent CTAs only")
    ap.add_argument("--block-ns", default="", help="Pallas: column tiles swept (e.g. 32,64,128)")
    ap.add_argument("--splits", default="", help="Pallas: K splits swept (divisors of K / 128)")
    ap.add_argument("--rounds", type=int, default=1, help="times each setting, round by round")
    ap.add_argument("--device-time", action="store_true",
                    help="time by the profiler's device span per call, not the chained wall "
                         "time (which holds each program's dispatch)")
    ap.add_argument("--stages", default="3,4", help="Pallas decode sweep: pipeline stages")
    ap.add_argument("--warps", default="", help="Pallas decode sweep: warps a program")
    args = ap.parse_args()
    ints = lambda text: tuple(int(v) for v in text.split(",") if v)
    decode = DecodeSweep(ints(args.block_ns), ints(args.splits), ints(args.stages),
                         ints(args.warps))
    if not decode.stages:
        ap.error("--stages needs at least one value")
    if not decode and (decode.stages, decode.warps) != (DecodeSweep.stages, DecodeSweep.warps):
        ap.error("--stages and --warps are axes of the decode sweep: "
                 "give --block-ns or --splits too")
    unknown = set(args.kernels.split(",")) - set(KERNELS)
    if unknown:
        ap.error(f"--kernels: unknown {sorted(unknown)}; known: {', '.join(KERNELS)}")
    rows: list = []
    exit_on_sigterm()
    ceilings = measure_ceilings()
    print("ceilings", ceilings, flush=True)
    try:
        for shape in args.shapes.split(","):
            for M in map(int, args.ms.split(",")):
                sweep(shape, M, rows, args.kernels.split(","), args.persistent,
                      ceilings["copy_tb_per_s"], decode, args.rounds, args.device_time)
    finally:
        best = best_settings(rows)
        for key, r in best.items():
            print("best", key, {k: v for k, v in r.items() if k not in ("shape", "M", "K", "N")})
        print("->", write_result("fp8_tiles", {"rows": rows, "best": best,
                                               "ceilings": ceilings}))


if __name__ == "__main__":
    main()
