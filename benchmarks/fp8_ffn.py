"""FP8 FFN on LLaDA-8B's shapes (D 4096, F 12288): layer time bf16 vs FP8, GEMM rates next to
XLA's FP8 dot (cuBLASLt, one scale per tensor: the ceiling), the FFN's parts (fused RMSNorm /
SwiGLU quantisation against their bandwidth floors, both GEMMs), the M = 32 FFN against its
FP8 weight-read floor, and the accuracy ablation (group / token / tensor activation scales).

    python -m benchmarks.fp8_ffn [--ms 32,256,1024,4096,16384] [--ablation-layers 32]
        [--quant-tiles 16x1,1x32x1,4x32x4] [--quant-ms 768,1024,4096] [--trace]
        [--settings SPEC [SPEC ...]]

--quant-tiles: the two quantisation kernels at each rows x groups[x warps] tile (32 groups =
LLaDA's whole 4096-wide rows: the RMSNorm kernel then computes its statistics itself; a tile
a kernel refuses is recorded as such), and XLA's fusion of each reference, at --quant-ms rows.
Times are per call with dependent calls chained in one jitted program (`time_chained`);
`--trace` adds the FFNs' and the quantisation tiles' device time per call from one profiled
run of that program (`device_chained`: without the program's dispatch, which the FFI GEMM
and Pallas calls enlarge; `TRACE_CALLS` chained calls above `TRACE_ALL_MAX_M` rows).
`--settings`: the FFN rows again under each SPEC of module-level kernel switches
(`module:NAME=int[,...]`, `common.parse_settings`), in this process.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import lacache_jax as lj
from benchmarks.common import (device_chained, exit_on_sigterm, measure_ceilings,
                               module_settings, parse_settings, time_chained, write_result)
from kernels.fp8_matmul import fp8_matmul
from kernels.fused_quant import (QuantTiles, rmsnorm_quant, rmsnorm_quant_pallas,
                                 rmsnorm_quant_ref, swiglu_quant, swiglu_quant_pallas,
                                 swiglu_quant_ref)
from lacache_jax.model import mlp


# The most rows whose profile holds all of a timing's chained calls, and the calls profiled
# above them: a margin under protobuf's 2 GB for the trace (its empty traces at 1,536 and
# 2,048 rows in the forty-fourth session were the programs' closed-over weights, not the
# calls: see `layer_times`)
TRACE_ALL_MAX_M = 1024
TRACE_CALLS = 5


def ffn_layer(cfg, key):
    """One bf16 FFN layer of LLaDA-8B's shape (random weights) with its FP8 copy."""
    params = lj.init_params(dataclasses.replace(cfg, n_layers=2), key, jnp.bfloat16)
    layer = lj.quantize_ffn(params).layers[1]
    return dataclasses.replace(layer, ffn8=None), layer


def layer_times(cfg, ceil, ms, rows, layers, traced: bool = False, settings: str = ""):
    """The FFN rows at each of `ms` rows for `layers` (`ffn_layer`'s pair), under `settings`
    (the caller has set them)."""
    bf16_layer, fp8_layer = layers
    w = fp8_layer.ffn8
    D, F = cfg.d_model, cfg.d_ff
    fp8_bytes = w.gate_up.size + w.down.size + 4 * (w.gate_up_scale.size + w.down_scale.size)
    # Weights are the timed programs' arguments, never closed-over constants: the profiler's
    # trace holds every live program's constants, and with a layer's (300 MB) closed over in
    # each program the second row count's traces passed protobuf's 2 GB and came back empty
    # (2.58 GB bf16, 2.73 FP8, whatever the rows: forty-fifth session)
    ffn = lambda x, layer: mlp(x, layer, cfg)  # noqa: E731
    for M in ms:
        x = jax.random.normal(jax.random.key(M), (1, M, D), jnp.bfloat16)
        n = 20 if M <= 4096 else 5
        t16 = time_chained(ffn, x, bf16_layer, n=n)["median_ms"]
        t8 = time_chained(ffn, x, fp8_layer, n=n)["median_ms"]
        y16, y8 = (mlp(x, lay, cfg).astype(jnp.float32) for lay in (bf16_layer, fp8_layer))
        fp8_err = float(jnp.linalg.norm(y8 - y16) / jnp.linalg.norm(y16))
        hq, _ = rmsnorm_quant(x[0], fp8_layer.ff_norm, cfg.norm_eps)
        parts, quant_x_floor = ffn_parts(cfg, fp8_layer, x[0], ceil, n)
        gemm = parts["gate_up_gemm"]
        try:
            xla8 = time_chained(lambda hq, wq: jax.lax.dot_general(
                hq, wq, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16),
                hq, w.gate_up, n=n)["median_ms"]
        except Exception as e:  # noqa: BLE001 (record why the ceiling is missing, go on)
            print(f"XLA FP8 dot at M={M} failed: {str(e)[:200]}", flush=True)
            xla8 = float("nan")
        xla16 = time_chained(jnp.matmul, x[0], bf16_layer.w_gate_up, n=n)["median_ms"]
        gemm_flops = 2.0 * M * D * 2 * F
        row = dict(M=M, settings=settings, ffn_bf16_ms=t16, ffn_fp8_ms=t8, fp8_speedup=t16 / t8,
                   fp8_rel_err_vs_bf16=fp8_err,
                   gate_up_gemm_ms=gemm, gate_up_tflops=gemm_flops / gemm / 1e9,
                   xla_fp8_per_tensor_ms=xla8, xla_fp8_tflops=gemm_flops / xla8 / 1e9,
                   xla_bf16_ms=xla16, of_xla_fp8=xla8 / gemm,
                   ffn_fp8_floor_ms=fp8_bytes / ceil["copy_tb_per_s"] / 1e9)
        row["ffn_fp8_x_floor"] = t8 / row["ffn_fp8_floor_ms"]
        row["ffn_fp8_tb_per_s"] = fp8_bytes / t8 / 1e9
        row["parts_ms"], row["quant_x_floor"] = parts, quant_x_floor
        if traced:  # the device's own time: without the chained program's dispatch
            nt = n if M <= TRACE_ALL_MAX_M else min(n, TRACE_CALLS)
            d16 = device_chained(ffn, x, bf16_layer, n=nt)["span_ms"]
            d8 = device_chained(ffn, x, fp8_layer, n=nt)["span_ms"]
            row.update(ffn_bf16_device_ms=d16, ffn_fp8_device_ms=d8,
                       fp8_speedup_device=d16 / d8)
        rows.append(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()},
              flush=True)


def quant_bytes(M: int, width: int, out_width: int) -> int:
    """Fewest bytes a fused quantisation moves: bf16 input read once, fp8 out + fp32 scales."""
    return 2 * M * width + M * out_width + 4 * M * (out_width // 128)


def ffn_parts(cfg, fp8_layer, x, ceil, n: int) -> tuple[dict, dict]:
    """ms of each part of the FP8 FFN through the dispatch; the quantisations over their
    bandwidth floor at the run's copy bandwidth."""
    w = fp8_layer.ffn8
    M, D, F = x.shape[0], cfg.d_model, cfg.d_ff
    hq, hs = rmsnorm_quant(x, fp8_layer.ff_norm, cfg.norm_eps)
    gu = jax.random.normal(jax.random.key(7), (M, 2 * F), jnp.bfloat16)
    aq, as_ = swiglu_quant(gu)
    parts = {
        "rmsnorm_quant": time_chained(lambda x, norm: rmsnorm_quant(x, norm, cfg.norm_eps), x,
                                      fp8_layer.ff_norm, n=n)["median_ms"],
        "gate_up_gemm": time_chained(fp8_matmul, hq, hs, w.gate_up, w.gate_up_scale,
                                     n=n)["median_ms"],
        "swiglu_quant": time_chained(swiglu_quant, gu, n=n)["median_ms"],
        "down_gemm": time_chained(fp8_matmul, aq, as_, w.down, w.down_scale, n=n)["median_ms"]}
    floors = {"rmsnorm_quant": quant_bytes(M, D, D), "swiglu_quant": quant_bytes(M, 2 * F, F)}
    return parts, {k: parts[k] / (b / ceil["copy_tb_per_s"] / 1e9) for k, b in floors.items()}


def quant_tiles(cfg, ceil, tiles: list[QuantTiles], ms: list[int], rows: list,
                traced: bool = False) -> None:
    """Both fused quantisation kernels per tile at each M, and XLA's fusion of their
    references (`tiles` None), against their bandwidth floor; with `traced` also the device's
    time per call (`device_chained`: `_device_ms` all kernels, the chain's one-element update
    included; `_kernel_ms` the longest kernel alone, the quantisation itself)."""
    D, F = cfg.d_model, cfg.d_ff
    norm = jnp.ones((D,), jnp.bfloat16)
    # (name, reference, kernel at a tiling, bytes at M); XLA's references behind a barrier:
    # `time_chained` reads one element of the output, and XLA would otherwise compute only
    # what that element needs.
    kernels = (
        ("rmsnorm_quant", lambda x: rmsnorm_quant_ref(x, norm, cfg.norm_eps),
         lambda x, t: rmsnorm_quant_pallas(x, norm, cfg.norm_eps, tiles=t),
         lambda M: quant_bytes(M, D, D)),
        ("swiglu_quant", swiglu_quant_ref, lambda g, t: swiglu_quant_pallas(g, tiles=t),
         lambda M: quant_bytes(M, 2 * F, F)))
    for M in ms:
        x = jax.random.normal(jax.random.key(M), (M, D), jnp.bfloat16)
        gu = jax.random.normal(jax.random.key(M + 1), (M, 2 * F), jnp.bfloat16)
        for t in [None, *tiles]:
            row = dict(M=M, tiles="xla" if t is None else f"{t.rows}x{t.groups}x{t.warps}")
            for (name, ref, kernel, nbytes), arg in zip(kernels, (x, gu)):
                fn = ((lambda a, ref=ref: jax.lax.optimization_barrier(ref(a))) if t is None
                      else functools.partial(kernel, t=t))
                try:
                    ms_ = time_chained(fn, arg)["median_ms"]
                except ValueError as e:  # a tile this kernel refuses
                    row[f"{name}_refused"] = str(e)
                    continue
                row[f"{name}_ms"] = ms_
                floor = nbytes(M) / ceil["copy_tb_per_s"] / 1e9
                row[f"{name}_x_floor"] = ms_ / floor
                if traced:
                    d = device_chained(fn, arg)
                    kernel_ms = d["largest"] and d["largest"][1]  # None: no device kernels
                    row[f"{name}_device_ms"] = d["kernels_ms"]
                    row[f"{name}_kernel_ms"] = kernel_ms
                    row[f"{name}_kernel_x_floor"] = kernel_ms and kernel_ms / floor
            rows.append(row)
            print("quant tiles", {k: round(v, 4) if isinstance(v, float) else v
                                  for k, v in row.items() if not k.endswith("_refused")},
                  flush=True)


def ablation(cfg, n_layers: int):
    """Logits of random LLaDA-8B-shaped weights, bf16 vs FP8 FFN per activation scaling."""
    cfg = dataclasses.replace(cfg, n_layers=n_layers)
    params = lj.init_params(cfg, jax.random.key(1), jnp.bfloat16)
    tokens = np.random.default_rng(0).integers(0, cfg.mask_id, (2, 512))
    ref = lj.forward(params, cfg, tokens).astype(jnp.float32)
    out = {}
    for g in ("group", "token", "tensor"):
        logits = lj.forward(lj.quantize_ffn(params, granularity=g), cfg, tokens)
        logits = logits.astype(jnp.float32)
        out[g] = {"logits_rel_err": float(jnp.linalg.norm(logits - ref) / jnp.linalg.norm(ref)),
                  "top1_agreement": float((logits.argmax(-1) == ref.argmax(-1)).mean())}
        print(g, out[g], flush=True)
    return {"n_layers": n_layers, "tokens": [2, 512], **out}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="32,256,1024,4096,16384")
    ap.add_argument("--ablation-layers", type=int, default=32)
    ap.add_argument("--quant-tiles", default="", help="rows x groups [x warps], e.g. "
                    "16x1,1x32x1,4x32x4")
    ap.add_argument("--quant-ms", default="1024,4096")
    ap.add_argument("--trace", action="store_true",
                    help="also the FFNs' device time per call (one profiled run each)")
    ap.add_argument("--settings", nargs="+", default=[""], metavar="SPEC",
                    help="module:NAME=int[,...] switches, each SPEC a run of the FFN rows")
    args = ap.parse_args()
    for spec in args.settings:
        parse_settings(spec)  # a typo fails before the ceilings are measured
    cfg = lj.llada_8b()
    ceil = measure_ceilings()
    rows, abl, qrows = [], {}, []
    exit_on_sigterm()
    try:  # the ablation first: it is cheap, and a time-boxed run keeps what finished
        if args.ablation_layers:
            abl.update(ablation(cfg, args.ablation_layers))
        layers = ffn_layer(cfg, jax.random.key(0))  # built once: every setting times these
        for spec in args.settings:
            with module_settings(spec):
                layer_times(cfg, ceil, [int(m) for m in args.ms.split(",")], rows, layers,
                            args.trace, spec)
        if args.quant_tiles:
            tiles = [QuantTiles(*map(int, t.split("x"))) for t in args.quant_tiles.split(",")]
            quant_tiles(cfg, ceil, tiles, [int(m) for m in args.quant_ms.split(",")], qrows,
                        args.trace)
    finally:
        path = write_result("fp8_ffn", {"ceilings": ceil, "D": cfg.d_model, "F": cfg.d_ff,
                                        "rows": rows, "ablation": abl, "quant_tiles": qrows})
        print(f"-> {path}")


if __name__ == "__main__":
    main()
