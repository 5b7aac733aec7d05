"""The per-group FP8 GEMM side by side with cuBLASLt's per-tensor FP8 GEMM on LLaDA-8B's FFN
shapes (gate/up K 4096 N 24576; down K 12288 N 4096), in one run (issue 23's goal: >= 1150
TFLOP/s from M 1024), with a correctness check of the cuBLASLt path first.

    python -m benchmarks.fp8_gemm [--ms 1024,4096,768,256,32,16384] [--shapes gate_up,down]
        [--check-only] [--kernels cublaslt,xla_fp8_precise,mgpu_ws]
    python -m benchmarks.fp8_gemm --mgpu-ws-sweep gate_up:4096  (or swiglu:4608)
    python -m benchmarks.fp8_gemm --cublaslt-search gate_up:1024,down:1024 [--top 6]
        [--rounds 5] [--max-split-k 1] [--search-reps 5] [--chain 20]
    python -m benchmarks.fp8_gemm --cublaslt-harness gate_up:1024,down:1024 [--reps 5,500]
        [--rounds 5]
    python -m benchmarks.fp8_gemm --cublaslt-split down:768:2816 [--top 4] [--rounds 5]

Kernels per (shape, M): XLA's FP8 dot (cuBLASLt, one scale per tensor: cannot compute the
per-group product; the speed reference) with XLA's default fast accumulation (`xla_fp8_fast`)
and without it (`Precision.HIGHEST`: `xla_fp8_precise`); ours through cuBLASLt's block scaling
(`cublaslt`; `cublaslt_swap`: the other operand arrangement), the Mosaic GPU kernel (`mgpu`,
its default pipeline for the shape), the Mosaic GPU kernel at DeepGEMM's recipe (`mgpu_ws`,
`WsConfig.get_default`; `--mgpu-ws-sweep gate_up:4096` times only its knobs, `swiglu:4608`
those of its gate/up GEMM with the SwiGLU epilogue), the Triton
kernel (`triton`, M <= 256 only: 2x slower above), what `fp8_matmul` dispatches to
(`dispatch`); XLA's bf16 dot. ms per call with 20 dependent calls chained in one program.
`--cublaslt-split SHAPE:M:N1,...`: columns from N1 by a second cuBLASLt call
(`cublaslt_split`). `--cublaslt-search SHAPE:M,...`: every configuration of cuBLASLt's
block-scaled algorithm (K split at most `--max-split-k` ways, fp32 partials), timed by the
handler itself (`fp8_cublaslt.search`), then the `--top` fastest and the heuristic's choice
timed again inside jit beside XLA's per-tensor FP8 dot, `--rounds` rounds round by round
(median per kernel), each output compared bit for bit with the heuristic's.
`--cublaslt-harness SHAPE:M,...`: the per-group GEMM (the heuristic's choice) and
cuBLASLt's per-tensor FP8 GEMM (precise and fast accumulation) in the handler's own timing
harness, no XLA around them, in bursts of each `--reps` calls, the three alternating over
`--rounds` rounds (a short burst runs at the clocks a cool GPU allows, a long one at its power
limit's); then both in jit on the quantised operands and on the harness's kind. The check:
cuBLASLt (f32 and bf16 out) against `fp8_matmul_ref` on two fresh random draws
(N cut to 1024 to keep the fp32 reference small), relative L2 and max-abs error, so an
unwritten or stale tile shows even where the norm would hide it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (device_chained, exit_on_sigterm, rel_l2, time_chained,
                               write_result)
from kernels import fp8_cublaslt as lt
from kernels.fp8_matmul import fp8_matmul, fp8_matmul_ref, sm_count
from kernels.fp8_matmul_mgpu import MgpuConfig, fp8_matmul_mgpu
from kernels.fp8_matmul_mgpu_ws import WsConfig, fp8_matmul_mgpu_ws, gate_up_swiglu_mgpu_ws
from kernels.fp8_matmul_triton import fp8_matmul_pallas
from kernels.fused_quant import swiglu_quant
from lacache_jax.quant import quantize_act, quantize_weight

SHAPES = {"gate_up": (4096, 2 * 12288), "down": (12288, 4096)}  # (K, N)
XLA_FP8_ONLY_FROM = 16384  # the slow Pallas kernels are not timed at this M and above


def operands(M: int, K: int, N: int, seed: int):
    kx, kw = jax.random.split(jax.random.key(seed))
    xq, xs = quantize_act(jax.random.normal(kx, (M, K), jnp.bfloat16))
    wq, ws = quantize_weight(jax.random.normal(kw, (K, N), jnp.bfloat16) * K ** -0.5)
    return xq, xs, wq, ws


def exact_product(xq, xs, wq, ws) -> np.ndarray:
    """The per-group product in fp32 at the highest matmul precision, as float64."""
    with jax.default_matmul_precision("highest"):
        return np.asarray(fp8_matmul_ref(xq, xs, wq, ws, jnp.float32), np.float64)


def check(rows: list) -> bool:
    """cuBLASLt against the reference; True when every case is within its bound: f32 out
    2^-12 relative L2 (Hopper's FP8 MMA keeps ~14 bits of each group's sum: the Mosaic
    kernel's bound, tests/test_gpu.py), bf16 out 2^-8 (one bf16 rounding on top), and no
    element off by more than 2^-5 of the largest output (rounding leaves every element within
    ~2^-9 of it; a stale or unwritten tile is off by the outputs' own size)."""
    ok = True
    for M, K, draws in ((1024, 4096, 2), (200, 12288, 1), (32, 4096, 1)):
        seed = M
        for draw in range(draws):  # a second draw: a stale output of the first cannot pass
            xq, xs, wq, ws = operands(M, K, 1024, 100 * seed + draw)
            ref = exact_product(xq, xs, wq, ws)
            for dtype, bound in ((jnp.float32, 2.0 ** -12), (jnp.bfloat16, 2.0 ** -8)):
                if not lt.supports(M, 1024, K, dtype):
                    continue
                out = np.asarray(lt.fp8_matmul_cublaslt(xq, xs, wq, ws, dtype), np.float64)
                err = np.abs(out - ref)
                rel = rel_l2(out, ref)
                good = bool(np.isfinite(out).all() and rel <= bound
                            and err.max() <= 2.0 ** -5 * np.abs(ref).max())
                ok &= good
                rows.append(dict(M=M, K=K, N=1024, draw=draw, out=jnp.dtype(dtype).name,
                                 rel_err=rel, max_abs_err=float(err.max()),
                                 max_abs_ref=float(np.abs(ref).max()), ok=good))
                print("check", rows[-1], flush=True)
    return ok


def kernels_for(M: int, K: int, N: int) -> dict:
    big = M >= XLA_FP8_ONLY_FROM
    dot = functools.partial(jax.lax.dot_general, dimension_numbers=(((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.bfloat16)
    out = {
        "xla_fp8_fast": lambda xq, xs, wq, ws: dot(xq, wq),
        "xla_fp8_precise": lambda xq, xs, wq, ws: dot(xq, wq, precision="highest"),
        "cublaslt": lt.fp8_matmul_cublaslt,
        "cublaslt_swap": lambda xq, xs, wq, ws: lt.fp8_matmul_cublaslt(xq, xs, wq, ws,
                                                                       swap=not lt.SWAP),
    }
    if not big:
        cfg = MgpuConfig.get_default(M, N, K, sm_count())
        out["mgpu"] = functools.partial(fp8_matmul_mgpu, config=cfg)
        out["mgpu_ws"] = functools.partial(
            fp8_matmul_mgpu_ws, config=WsConfig.get_default(M, N, K, sm_count()),
            sm_count=sm_count())
        out["dispatch"] = fp8_matmul
    if M <= 256:
        out["triton"] = fp8_matmul_pallas
    return out


def sweep(shape: str, M: int, rows: list, only: set | None = None) -> None:
    K, N = SHAPES[shape]
    xq, xs, wq, ws = operands(M, K, N, M)
    flops = 2.0 * M * K * N
    n = 20 if M <= 4096 else 5
    base = dict(shape=shape, M=M, K=K, N=N)
    w16 = jax.random.normal(jax.random.key(1), (N, K), jnp.bfloat16)
    x16 = xq.astype(jnp.bfloat16)
    t = time_chained(lambda a: jax.lax.dot_general(a, w16, (((1,), (1,)), ((), ()))), x16, n=n)
    rows.append({**base, "kernel": "xla_bf16", "ms": t["median_ms"],
                 "tflops": flops / t["median_ms"] / 1e9})
    print(rows[-1], flush=True)
    for name, fn in kernels_for(M, K, N).items():
        if only and name not in only:
            continue
        try:
            t = time_chained(lambda a, s: fn(a, s, wq, ws), xq, xs, n=n)
        except Exception as e:  # noqa: BLE001 (record what failed, go on)
            rows.append({**base, "kernel": name, "error": str(e)[:300]})
        else:
            rows.append({**base, "kernel": name, "ms": t["median_ms"],
                         "tflops": flops / t["median_ms"] / 1e9})
        print(rows[-1], flush=True)


# Knobs of `fp8_matmul_mgpu_ws` timed by --mgpu-ws-sweep, each a change from the default: the
# cluster's shared operand, no cluster, one 64-row wave per warpgroup, the per-tile pipeline,
# 3 stages with a double-buffered epilogue (3 divides no gate/up K group count: per tile),
# wider snake bands, the other snake direction; both waves' scales loaded before the first
# wgmma; two K groups per pipeline step on 64-row warpgroups (each wave's first promotion
# under its second wgmma), 2 stages steady or 3 per tile; and a timing probe with wrong
# outputs (WsConfig.probe): no promotion (one accumulator per wave over all of K: what this
# pipeline gives without DeepGEMM's per-group FFMAs and the accumulator's zero-fill every
# group). Tiles of other widths (`block_n`: column scales where a tile spans two weight
# blocks): 256 x 96 (the down GEMM's wave-filling tile at 768 rows, `get_wave_filling`, which
# the sweep times too, right after the default) and 128 x 192 (132 tiles at 768 rows, over
# `REGISTER_BUDGET`: whether it spills). Gone since the tenth session: the consumers at 240
# registers (producer 32 hung the GPU), a no-epilogue probe (it ran above the FP8 peak) and
# the w scales read as stored (slower in the step, thirty-eighth session). In the order a box
# cut short should keep them: the default and the probe first.
WS_SWEEP = ({}, dict(probe="carry_acc"),
            dict(block_n=96, epi_cols=32, cluster=1),
            dict(wg_rows=64, block_n=192, cluster=1),
            dict(wg_rows=64, step_groups=2, stages=2),
            dict(wg_rows=64, step_groups=2, stages=3, steady=False), dict(wg_rows=64),
            dict(snake_dim="n"), dict(cluster_dim="m"), dict(cluster=1), dict(steady=False),
            dict(stages=3, epi_slots=2, steady=False), dict(snake_width=16),
            dict(early_scales=True))


# Knobs of `gate_up_swiglu_mgpu_ws` timed by `--mgpu-ws-sweep swiglu:M`, each a change from
# `WsConfig.get_default_swiglu` (its tile shape: the register budget leaves no larger):
# pairs of CTAs sharing x, or sharing their weight tiles (a CTA's step loads one x tile and
# two weight tiles, so sharing w halves the larger load), the other snake direction, wider
# and narrower bands, the per-tile pipeline, 3 stages per tile, 4 steady (the default's
# pipeline depends on the rows: one of the last three is it); half tiles of 64 rows with a
# warpgroup on each of gate and up (`split_parts`). Its GEMM ran 8% longer than cuBLASLt's
# gate/up in batch 8's step (RESULTS.md thirty-fifth session); the w scales read as stored
# were slower (thirty-eighth).
SWIGLU_SWEEP = ({}, dict(cluster=2), dict(cluster=2, cluster_dim="m"), dict(snake_dim="n"),
                dict(snake_width=16), dict(snake_width=4), dict(steady=False),
                dict(stages=3, steady=False), dict(stages=4, steady=True),
                dict(split_parts=True))


def ws_sweep(spec: str, rows: list) -> None:
    """`--mgpu-ws-sweep SHAPE:M`: `fp8_matmul_mgpu_ws` at one shape over `WS_SWEEP` (each a
    change from `WsConfig.get_default`) and `WsConfig.get_wave_filling`'s tile, beside
    cuBLASLt's block-scaled GEMM; `swiglu:M`:
    `gate_up_swiglu_mgpu_ws` at the gate/up shape over `SWIGLU_SWEEP`, beside the path it
    replaces (the dispatched GEMM, then the SwiGLU + quantisation kernel). Each row's
    `same_as_default` and `rel_l2_vs_default`: its first output against the swept kernel's
    default configuration's (a knob that breaks the kernel shows there, as the probe's wrong
    sums do; the knobs change no arithmetic, so a sound one is equal in every element)."""
    shape, M = spec.split(":")
    M = int(M)
    if shape == "swiglu":
        (K, N), kernel, knobs = SHAPES["gate_up"], gate_up_swiglu_mgpu_ws, SWIGLU_SWEEP
        base = WsConfig.get_default_swiglu(M, N // 2, K, sm_count())
        fns = {"gemm+swiglu_quant": lambda *ops: swiglu_quant(fp8_matmul(*ops))}
    else:
        (K, N), kernel, knobs = SHAPES[shape], fp8_matmul_mgpu_ws, WS_SWEEP
        base = WsConfig.get_default(M, N, K, sm_count())
        fns = {"cublaslt": lt.fp8_matmul_cublaslt} if lt.available() else {}
    for kw in knobs:
        fns[f"mgpu_ws {kw}"] = functools.partial(
            kernel, config=dataclasses.replace(base, **kw), sm_count=sm_count())
        if not kw and shape != "swiglu":
            fns["mgpu_ws wave-filling"] = functools.partial(
                kernel, config=WsConfig.get_wave_filling(M, N, K, sm_count()),
                sm_count=sm_count())
    xq, xs, wq, ws = operands(M, K, N, M)
    flops = 2.0 * M * K * N

    def first_output(fn):
        return jax.tree.leaves(fn(xq, xs, wq, ws))[0].astype(jnp.float32)
    default = first_output(fns["mgpu_ws {}"])
    for name, fn in fns.items():
        row = dict(shape=shape, M=M, K=K, N=N, kernel=name)
        try:
            out = first_output(fn)
            agree = dict(same_as_default=float(jnp.mean(out == default)),
                         rel_l2_vs_default=rel_l2(out, default))
            t = time_chained(lambda a, s: fn(a, s, wq, ws), xq, xs, n=20)
        except Exception as e:  # noqa: BLE001 (record what failed, go on)
            row["error"] = str(e)[:300]
        else:
            row.update(ms=t["median_ms"], tflops=flops / t["median_ms"] / 1e9, **agree)
        rows.append(row)
        print(row, flush=True)


def cublaslt_search(spec: str, top: int, rounds: int, rows: list, max_split_k: int = 1,
                    search_reps: int = 5, chain: int = 20) -> None:
    """`--cublaslt-search`: for each SHAPE:M, every configuration `lt.search` finds, each
    timed over `search_reps` calls (rows `kind` "search"), then the `top` fastest, the
    heuristic's and XLA's per-tensor FP8 dots timed in jit, `chain` calls a program, over
    `rounds` rounds (rows `kind` "jit", median and all round times), with whether each output
    has the heuristic's bits and its relative L2 error against the exact product (bf16 out:
    the heuristic's is one bf16 rounding, ~2^-9). Long bursts (`search_reps` in the hundreds)
    rank the configurations at the clocks of the GPU's power limit, where a full step runs
    (RESULTS.md, thirtieth session), not at a cool GPU's."""
    for item in spec.split(","):
        shape, M = item.split(":")
        M, (K, N) = int(M), SHAPES[shape]
        flops = 2.0 * M * K * N
        base = dict(shape=shape, M=M, K=K, N=N)
        found = lt.search(M, N, K, jnp.bfloat16, swap=False, max_split_k=max_split_k,
                          reps=search_reps)
        for config, ms in found:
            rows.append({**base, "kind": "search", "config": config, "ms": ms,
                         "tflops": flops / ms / 1e9, "reps": search_reps})
        ranked = sorted(found[1:], key=lambda r: r[1])
        print(f"{shape} M {M}: {len(found)} configurations; heuristic {found[0][0]} "
              f"{flops / found[0][1] / 1e9:.0f} TFLOP/s; best "
              + "; ".join(f"{c} {flops / ms / 1e9:.0f}" for c, ms in ranked[:top]), flush=True)
        xq, xs, wq, ws = operands(M, K, N, M)
        dot = functools.partial(jax.lax.dot_general, dimension_numbers=(((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.bfloat16)
        fns = {"xla_fp8_fast": lambda a, s: dot(a, wq),
               "xla_fp8_precise": lambda a, s: dot(a, wq, precision="highest")}
        configs = [lt.HEURISTIC] + [c for c, _ in ranked[:top]]
        for c in configs:
            fns[c] = functools.partial(lambda a, s, c: lt.fp8_matmul_cublaslt(
                a, s, wq, ws, swap=False, config=c), c=c)
        heuristic = np.asarray(fns[lt.HEURISTIC](xq, xs))
        outs = {c: np.asarray(fns[c](xq, xs)) for c in configs}
        same = {c: bool(np.array_equal(outs[c], heuristic)) for c in configs}
        ref = exact_product(xq, xs, wq, ws)  # split K sums in another order
        err = {c: rel_l2(outs[c], ref) for c in configs}
        times = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                times[name].append(time_chained(fn, xq, xs, n=chain)["median_ms"])
        for name, ts in times.items():
            ms = float(np.median(ts))
            row = {**base, "kind": "jit", "kernel": name if isinstance(name, str) else "cublaslt",
                   "ms": ms, "tflops": flops / ms / 1e9, "round_ms": ts, "chain": chain}
            if not isinstance(name, str):
                row.update(config=name, same_bits_as_heuristic=same[name],
                           rel_l2_vs_ref=err[name])
            rows.append(row)
            print(row, flush=True)


def cublaslt_split(spec: str, top: int, rounds: int, rows: list) -> None:
    """`--cublaslt-split SHAPE:M:N1,...`: the output's columns from N1 computed by a second
    cuBLASLt call in the same handler call (`fp8_cublaslt.SPLITS`), its configuration each of
    the `top` fastest that `lt.search` finds for the tail problem (M, N - N1, K) and the
    heuristic's, against one call; per kernel the median over `rounds` rounds of the chained
    wall time and, from one profiled run, the device's time per call (all kernels, the gaps
    between them included: `span_ms`) and its launches by name (memsets included), whether
    the output has one call's bits, and its relative L2 error against the exact product."""
    for item in spec.split(","):
        shape, M, n1 = item.split(":")
        M, n1, (K, N) = int(M), int(n1), SHAPES[shape]
        flops = 2.0 * M * K * N
        base = dict(shape=shape, M=M, K=K, N=N, n_split=n1)
        found = lt.search(M, N - n1, K, jnp.bfloat16, swap=False)
        tails = [lt.HEURISTIC] + [c for c, _ in sorted(found[1:], key=lambda r: r[1])[:top]]
        print(f"{shape} M {M} split at {n1}: tail searched over {len(found)} configurations; "
              f"timing {tails}", flush=True)
        xq, xs, wq, ws = operands(M, K, N, M)
        fns = {"one": lambda a, s: lt.fp8_matmul_cublaslt(a, s, wq, ws, swap=False,
                                                          split=lt.NO_SPLIT)}
        for c in tails:
            fns[c] = functools.partial(lambda a, s, c: lt.fp8_matmul_cublaslt(
                a, s, wq, ws, swap=False, split=(n1, c)), c=c)
        outs = {name: np.asarray(fn(xq, xs)) for name, fn in fns.items()}
        ref = exact_product(xq, xs, wq, ws)
        times = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                times[name].append(time_chained(fn, xq, xs, n=20)["median_ms"])
        for name, fn in fns.items():
            ms = float(np.median(times[name]))
            dev = device_chained(fn, xq, xs)
            row = {**base, "kind": "split", "tail": None if name == "one" else name,
                   "ms": ms, "tflops": flops / ms / 1e9, "round_ms": times[name],
                   "device_span_ms": dev["span_ms"], "device_kernels_ms": dev["kernels_ms"],
                   "device_tflops": flops / dev["span_ms"] / 1e9,
                   "device_launches": dev["launches"],
                   "same_bits_as_one_call": bool(np.array_equal(outs[name], outs["one"])),
                   "rel_l2_vs_ref": rel_l2(outs[name], ref)}
            rows.append(row)
            print(row, flush=True)


def narrow_operands(M: int, K: int, N: int, seed: int):
    """The handler harness's kind of operands: random FP8 bytes with exponent field <= 7 (|v|
    < 2; the quantised ones span the whole e4m3 range), scales in [0.5, 1)."""
    keys = jax.random.split(jax.random.key(seed), 4)
    fp8 = lambda k, shape: jax.lax.bitcast_convert_type(  # noqa: E731
        jax.random.bits(k, shape, jnp.uint8) & 0xBF, jnp.float8_e4m3fn)
    scales = lambda k, shape: jax.random.uniform(k, shape, jnp.float32, 0.5, 1.0)  # noqa: E731
    return (fp8(keys[0], (M, K)), scales(keys[1], (M, K // 128)), fp8(keys[2], (N, K)),
            scales(keys[3], (N // 128, K // 128)))


def cublaslt_harness(spec: str, reps: str, rounds: int, rows: list, trace: bool = False) -> None:
    """`--cublaslt-harness`: rows `kind` "harness" (scaling, reps, median and round ms); then
    the same two GEMMs timed in jit (`time_chained`) on the benchmark's quantised operands
    and on the harness's kind (`narrow_operands`), rows `kind` "jit", `operands`; with
    `trace`, each jit chain once more under the profiler: the GEMM kernel's own device time
    per call (`kernel_ms`, `kernel_tflops`: what a profiler-based benchmark such as DeepGEMM's
    reports), all kernels' and the idle device time per call, the wall time."""
    for item in spec.split(","):
        shape, M = item.split(":")
        M, (K, N) = int(M), SHAPES[shape]
        flops = 2.0 * M * K * N
        base = dict(shape=shape, M=M, K=K, N=N)
        for n in map(int, reps.split(",")):
            times = {scaling: [] for scaling in lt.SCALINGS}
            for _ in range(rounds):
                for scaling in lt.SCALINGS:
                    (_, ms), = lt.search(M, N, K, jnp.bfloat16, swap=False, reps=n,
                                         max_configs=1, scaling=scaling)
                    times[scaling].append(ms)
            for scaling, ts in times.items():
                ms = float(np.median(ts))
                rows.append({**base, "kind": "harness", "scaling": scaling, "reps": n,
                             "ms": ms, "tflops": flops / ms / 1e9, "round_ms": ts})
            print(f"{shape} M {M} bursts of {n}: " + ", ".join(
                f"{r['scaling']} {r['tflops']:.0f}" for r in rows[-3:]) + " TFLOP/s; "
                f"per-group / per-tensor precise {rows[-3]['tflops'] / rows[-2]['tflops']:.3f}, "
                f"/ fast {rows[-3]['tflops'] / rows[-1]['tflops']:.3f}", flush=True)
        dot = functools.partial(jax.lax.dot_general, dimension_numbers=(((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.bfloat16, precision="highest")
        times = {}
        for kind, make in (("quantised", operands), ("narrow", narrow_operands)):
            xq, xs, wq, ws = make(M, K, N, M)
            times[kind, "xla_fp8_precise"] = (lambda a, s, w=wq: dot(a, w), xq, xs, [])
            times[kind, "cublaslt"] = (functools.partial(
                lambda a, s, w, ws: lt.fp8_matmul_cublaslt(a, s, w, ws, swap=False,
                                                           config=lt.HEURISTIC),
                w=wq, ws=ws), xq, xs, [])
        for _ in range(rounds):
            for fn, xq, xs, ts in times.values():
                ts.append(time_chained(fn, xq, xs, n=20)["median_ms"])
        for (kind, kernel), (fn, xq, xs, ts) in times.items():
            ms = float(np.median(ts))
            rows.append({**base, "kind": "jit", "operands": kind, "kernel": kernel, "ms": ms,
                         "tflops": flops / ms / 1e9, "round_ms": ts})
            if trace:
                d = device_chained(fn, xq, xs, n=20)
                name, kernel_ms = d["largest"]  # the GEMM's kernel
                rows[-1].update(kernel_name=name, kernel_ms=kernel_ms,
                                kernel_tflops=flops / kernel_ms / 1e9,
                                device_ms=d["kernels_ms"], idle_ms=d["idle_ms"],
                                wall_ms=d["wall_ms"])
                print({k: rows[-1][k] for k in ("operands", "kernel", "ms", "kernel_name",
                                                "kernel_ms", "kernel_tflops", "device_ms",
                                                "idle_ms", "wall_ms")}, flush=True)
        print(f"{shape} M {M} in jit: " + ", ".join(
            f"{r['operands']} {r['kernel']} {r['tflops']:.0f}" for r in rows[-4:]), flush=True)


def table(rows: list) -> None:
    names = ["xla_fp8_fast", "xla_fp8_precise", "cublaslt", "cublaslt_swap", "mgpu", "mgpu_ws",
             "triton", "dispatch", "xla_bf16"]
    print("| shape | M | " + " | ".join(names) + " | cublaslt / xla_fp8_fast | "
          "cublaslt / xla_fp8_precise |")
    print("|" + "---|" * (len(names) + 4))
    by = {}
    for r in rows:
        if "ms" in r and "kernel" in r:
            by.setdefault((r["shape"], r["M"]), {})[r["kernel"]] = r
    for (shape, M), ks in by.items():
        cells = [f"{ks[k]['ms']:.4f} ({ks[k]['tflops']:.0f})" if k in ks else "" for k in names]
        ratios = [f"{ks['cublaslt']['tflops'] / ks[k]['tflops']:.2f}"
                  if "cublaslt" in ks and k in ks else "" for k in names[:2]]
        print(f"| {shape} | {M} | " + " | ".join(cells + ratios) + " |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1024,4096,768,256,32,16384")  # the goal's M first
    ap.add_argument("--shapes", default="gate_up,down")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--kernels", default=None,
                    help="comma-separated subset of the kernels (xla_bf16 always runs)")
    ap.add_argument("--mgpu-ws-sweep", default=None, metavar="SHAPE:M",
                    help="only time fp8_matmul_mgpu_ws's knobs at one shape, e.g. "
                         "gate_up:4096, or those of its SwiGLU variant: swiglu:4608")
    ap.add_argument("--cublaslt-search", default=None, metavar="SHAPE:M,...",
                    help="search cuBLASLt's configurations, e.g. gate_up:1024,down:1024")
    ap.add_argument("--cublaslt-harness", default=None, metavar="SHAPE:M,...",
                    help="per-group against per-tensor FP8 in cuBLASLt's own timing")
    ap.add_argument("--cublaslt-split", default=None, metavar="SHAPE:M:N1,...",
                    help="columns from N1 by a second cuBLASLt call, e.g. down:768:2816")
    ap.add_argument("--reps", default="5,500")
    ap.add_argument("--trace", action="store_true",
                    help="with --cublaslt-harness: profile each jit chain once")
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("--max-split-k", type=int, default=1,
                    help="with --cublaslt-search: also K split up to this many ways")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--search-reps", type=int, default=5,
                    help="with --cublaslt-search: calls per configuration in the search "
                         "(hundreds: ranked at the power limit's clocks)")
    ap.add_argument("--chain", type=int, default=20,
                    help="with --cublaslt-search: calls per jitted program in the jit timing")
    args = ap.parse_args()
    exit_on_sigterm()
    if args.cublaslt_search or args.cublaslt_harness or args.cublaslt_split:
        rows = []
        try:
            if args.cublaslt_split:
                cublaslt_split(args.cublaslt_split, args.top, args.rounds, rows)
            if args.cublaslt_harness:
                cublaslt_harness(args.cublaslt_harness, args.reps, args.rounds, rows,
                                 args.trace)
            if args.cublaslt_search:
                cublaslt_search(args.cublaslt_search, args.top, args.rounds, rows,
                                args.max_split_k, args.search_reps, args.chain)
        finally:
            print("->", write_result("fp8_gemm_search", {"rows": rows}))
        return
    if args.mgpu_ws_sweep:
        rows = []
        try:
            ws_sweep(args.mgpu_ws_sweep, rows)
        finally:
            print("->", write_result("fp8_gemm_ws_sweep", {"rows": rows}))
        return
    checks, rows = [], []
    built = lt.available()
    print("cublaslt arrangement: swap", lt.SWAP, "f32 out", lt.F32_OUT, flush=True)
    try:
        ok = built and check(checks)
        print("cublaslt built:", built, "checks pass:", ok, flush=True)
        if not args.check_only and ok:
            for shape in args.shapes.split(","):
                for M in map(int, args.ms.split(",")):
                    sweep(shape, M, rows, set(args.kernels.split(",")) if args.kernels
                          else None)
    finally:
        table(rows)
        print("->", write_result("fp8_gemm", {"checks": checks, "rows": rows}))
    raise SystemExit(0 if built and all(c["ok"] for c in checks) else 1)


if __name__ == "__main__":
    main()
