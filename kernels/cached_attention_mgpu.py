"""FACache's uncached modes (`full`, `fill`; contract: `kernels/cached_attention.py`) lowered
through Pallas' Mosaic GPU backend at FlashAttention-3's recipe (Hopper only).

Why a second kernel: the Triton-lowered loop (one 64-row query tile per program, no wgmma
pipelining) runs at 40% of cuDNN's rate from L 1024 up (RESULTS.md, "FACache kernel vs full
attention"). Reuse mode stays there: it is latency-bound, not a wgmma pipeline. Measured on
the H200 (RESULTS.md, eighteenth session, LLaDA's head shape): 1.8-2.1x the Triton kernel;
full 1.07-1.18x cuDNN's time at L 1024-4096 in the last run, fill 1.15-1.42x (the fp32
state's writes); the masks cost 3-12%.

The recipe (FlashAttention-3's forward, rewritten here for FACache's two phases):
- A CTA owns 128 query rows of one (batch, head): two consumer warpgroups of 64 rows each
  (one wgmma M) and a producer warpgroup issuing TMA copies of K, V and the keys' additive
  bias into a ring of `stages` slots (`set_max_registers`: 232 for the consumers, 40 for it).
- The consumers take turns on the tensor cores (a shared `schedule` barrier): while one
  runs its QK^T / PV wgmmas the other does its softmax.
- Masks as data: the keys' bias is 0 (kept) or -inf (masked), so `s = qk * scale + bias`
  is one FMA and exp2(s - m) is exactly 0 where the reference writes `where(ok, ., 0)`. The
  running max starts at the reference's finite MASKED, so a row that has seen no kept key
  keeps the reference's (m, l, acc) = (MASKED, 0, 0).
- FACache's two phases (REFERENCE.md §7): phase A streams every key tile with the bias of
  "valid and outside the block"; phase B streams a static window of `n_window` =
  ceil(block_len / block_kv) tiles starting at s (gathered into its own small K/V/bias arrays
  by XLA before the kernel, so the kernel has no run-time bounds and one static step count,
  and a block never straddles two of its tiles), with the bias of "valid and in the block";
  a block within one tile gets a tile of ceil(block_len / 64) * 64 keys (a 32-key block: 64,
  in the slot's first rows).
  `fill` writes (m, l, acc) after phase A; `full` is the same loop without that store, so it
  sums in fill's order (as the Triton kernel's `full` does). Unlike the reference's `where`,
  the bias assumes finite keys (a NaN or inf key is not masked away: the engine's are
  finite), and keys of the block past `block_len` would be in neither phase (the caller's
  bound: generate's exact cache passes e = s + block_len).

Shared memory (K 128, `stages` 2, block_kv 128): Q 32 KiB, K and V 2 x 2 x 32 KiB, bias 1
KiB, the state's fp32 staging 32 KiB (fill: acc written in 64-column halves) and m/l 1 KiB:
about 194 KiB of Hopper's 227.

Shapes as the Triton kernel's: q [B, L, H, K], k/v [B, L, G, K] (GQA), key_mask [B, L];
bf16/f16 only (fp32 takes the Triton kernel), K a multiple of 64 up to 256 (a wgmma N), L
padded to a multiple of 128 here.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels import hopper
from kernels.cached_attention import LOG2E, MASKED, FAState, _check

BLOCK_Q = 64    # rows per consumer warpgroup: Hopper's wgmma M
CONSUMERS = 2   # consumer warpgroups per CTA
STATE_COLS = 64  # columns of the fp32 accumulator staged per TMA store
PROBES = ("", "no_bias")  # timing probes of the compiled kernel (results not meant to be right)


def _rem(t, n: int):
    """t mod n for a loop index (traced) or a Python int (the pipeline's unrolled first fill)."""
    return t % n if isinstance(t, int) else jax.lax.rem(t, jnp.asarray(n, t.dtype))


def refusal(dtype, K: int, mode: str, block_kv: int = 128, stages: int = 2) -> str | None:
    """Why this kernel cannot take these settings, or None: the one support check, used by
    the kernel and by the dispatch (`kernels/cached_attention.py::takes_row_bounds`)."""
    if mode not in ("full", "fill"):
        return f"{mode!r} mode is the Triton kernel's (cached_attention_pallas)"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"bf16 or f16 only (fp32 takes the Triton kernel), got {dtype}"
    if K % 64 or K > 256:
        return f"head dim must be a multiple of 64 up to 256, got {K}"
    if block_kv % 64 or block_kv > 256:
        return f"block_kv must be a multiple of 64 up to 256, got {block_kv}"
    if stages < 2:
        return f"stages must be at least 2, got {stages}"
    need = smem_bytes(K, block_kv, stages, jnp.dtype(dtype).itemsize, mode == "fill")
    return hopper.smem_refusal(need, "fewer stages or a smaller block_kv")


def smem_bytes(K: int, block_kv: int, stages: int, itemsize: int, write_state: bool) -> int:
    """Shared memory the kernel asks for (barriers aside)."""
    q = CONSUMERS * BLOCK_Q * K * itemsize
    kv = 2 * stages * block_kv * K * itemsize + stages * block_kv * 4
    state = CONSUMERS * (BLOCK_Q * STATE_COLS * 4 + 2 * BLOCK_Q * 4) if write_state else 0
    return q + kv + state


def _window(x, lo_B, width: int):
    """Rows [lo_B[b], lo_B[b] + width) of each x[b] (axis 1). A gather, not a vmapped
    dynamic slice: that form, in one program with the interpreter's callbacks, hung the CPU
    run 4 times in 6 (jax 0.10.2, 2 cores); this one 0 in 6."""
    idx = lo_B[:, None] + jnp.arange(width)[None]
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def _biases(key_mask, s, e, Lp, win):
    """Additive key biases (0 kept, -inf masked) of phase A [B, Lp] and of the phase-B window
    [B, win], and each row's first window key [B]. Bounds: scalars or [B]."""
    B, L = key_mask.shape
    valid = jnp.pad(key_mask.astype(bool), [(0, 0), (0, Lp - L)])
    s_B, e_B = (jnp.broadcast_to(jnp.asarray(x, jnp.int32), (B,)) for x in (s, e))
    pos = jnp.arange(Lp)[None]
    in_c = (pos >= s_B[:, None]) & (pos < e_B[:, None])
    bias = lambda ok: jnp.where(ok, 0.0, -jnp.inf).astype(jnp.float32)
    # a gathered copy needs no tile alignment: the window starts at s (pulled back where it
    # would run past the canvas), so a block within block_kv keys is one tile, not two
    lo_B = jnp.clip(s_B, 0, Lp - win)
    return bias(valid & ~in_c), _window(bias(valid & in_c), lo_B, win), lo_B


@functools.partial(jax.jit, static_argnames=("mode", "block_len", "block_kv", "stages",
                                             "probe", "interpret"))
def cached_attention_mgpu(q, k, v, key_mask, s, e, state: FAState | None = None, *,
                          mode: str = "fill", block_len: int | None = None,
                          block_kv: int = 128, stages: int = 2, probe: str = "",
                          interpret: bool = False):
    """FACache `full` / `fill` (module docstring): `cached_attention_ref`'s contract, and
    `s`, `e` may also be per-row bounds [B] (slot refill), which only the biases and the
    window's gather (XLA, before the kernel) read: one launch either way.
    `probe="no_bias"` (timing only) drops the masks' load and add: what they cost.
    `block_len`: a static bound on e - s, which sizes phase B's window (without it the window
    is the whole canvas: correct, twice the work). `interpret`: Pallas' Mosaic GPU
    interpreter on the CPU (TMA, barriers and warpgroups simulated; each wgmma an fp32 dot of
    the same bf16 operands, and vectors read without the wgmma layouts, which it does not
    model)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    _check(q, k, v, key_mask, mode, state)
    if probe not in PROBES or (probe and interpret):
        raise ValueError(f"probe must be one of {PROBES} (compiled kernel only), got {probe!r}")
    B, L, H, K = q.shape
    G = k.shape[2]
    rep = H // G
    dtype = q.dtype
    if block_len is not None and block_len < 1:
        raise ValueError(f"block_len must be at least 1, got {block_len}")
    write_state = mode == "fill"
    tq = CONSUMERS * BLOCK_Q
    step = math.lcm(tq, block_kv)  # the canvas in whole query and key tiles
    Lp = pl.cdiv(L, step) * step
    n = Lp // block_kv
    n_window = n if block_len is None else min(pl.cdiv(block_len, block_kv), n)
    # a block within one tile takes a narrower window tile: 64 keys for a 32-key block (one
    # wgmma of N 64 on the slot's first rows), not a 128-key step that is 3/4 masked
    wk = block_kv
    if block_len is not None and n_window == 1:
        wk = min(block_kv, pl.cdiv(block_len, 64) * 64)
    total = n + n_window
    stages = min(stages, total)
    if (why := refusal(dtype, K, mode, block_kv, stages)) is not None:
        raise ValueError(why)

    pad = [(0, 0), (0, Lp - L), (0, 0), (0, 0)]
    q_p, k_p, v_p = (jnp.pad(x, pad) for x in (q, k, v))
    bias_a, bias_c, lo_B = _biases(key_mask, s, e, Lp, n_window * wk)
    k_c, v_c = (_window(x, lo_B, n_window * wk) for x in (k_p, v_p))
    scale = LOG2E / math.sqrt(K)

    def kernel(q_ref, k_ref, v_ref, ba_ref, kc_ref, vc_ref, bc_ref, o_ref, *rest):
        state_refs, scoped = rest[:-1], rest[-1]
        b = jax.lax.axis_index("batch")
        h = jax.lax.axis_index("heads")
        wg = jax.lax.axis_index("wg")
        (qo_smem2, k_smem, v_smem, b_smem, st_smem2, ml_smem2), bars, consumed, sched = scoped
        k_bars, v_bars, b_bars, q_bars = bars
        k_consumed, v_consumed = consumed

        def schedule():
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(sched)

        @pl.when(wg < CONSUMERS)
        def _consumer():
            if not interpret:
                plgpu.set_max_registers(232, action="increase")
            qo_smem = qo_smem2.at[wg]
            row0 = jax.lax.axis_index("q_seq") * tq + wg * BLOCK_Q
            rows = pl.ds(row0, BLOCK_Q)
            plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], qo_smem, q_bars.at[wg])
            plgpu.barrier_wait(q_bars.at[wg])

            rows_layout = plgpu.Layout.WGMMA.reduce(1)
            m_i = hopper.layout_cast(jnp.full((BLOCK_Q,), MASKED, jnp.float32), rows_layout,
                                     interpret)
            l_i = hopper.layout_cast(jnp.zeros((BLOCK_Q,), jnp.float32), rows_layout, interpret)
            acc = hopper.layout_cast(jnp.zeros((BLOCK_Q, K), jnp.float32), plgpu.Layout.WGMMA,
                                     interpret)
            plgpu.barrier_wait(k_bars.at[0])
            pl.when(wg == 1)(schedule)

            def kv_step(t, carry, nk=block_kv):  # nk: the step's keys (the window's: wk)
                acc, m_i, l_i = carry
                slot = _rem(t, stages)
                k_tile, v_tile = k_smem.at[slot, pl.ds(0, nk)], v_smem.at[slot, pl.ds(0, nk)]
                b_tile = b_smem.at[slot, pl.ds(0, nk)]
                if probe != "no_bias":
                    plgpu.barrier_wait(b_bars.at[slot])
                if interpret:
                    bias = b_tile[...]
                    qk = jax.lax.dot_general(qo_smem[...], k_tile[...],
                                             (((1,), (1,)), ((), ())),
                                             preferred_element_type=jnp.float32)
                    schedule()
                else:
                    if probe != "no_bias":
                        bias = hopper.load_whole(b_tile, plgpu.Layout.WGMMA.reduce(0))

                    def qk_of(acc_ref):
                        plgpu.wgmma(acc_ref, qo_smem, k_tile.transpose((1, 0)))
                        schedule()
                        return acc_ref[...]
                    qk = pl.run_scoped(qk_of, plgpu.ACC((BLOCK_Q, nk), jnp.float32))
                plgpu.barrier_arrive(k_consumed.at[slot])
                # base-2 online softmax, as `online_softmax_step` (the bias masks)
                if probe == "no_bias":  # timing only: what the masks cost (wrong results)
                    sc = qk * scale
                else:
                    sc = qk * scale + jax.lax.broadcast_in_dim(bias, qk.shape, [1])
                m_new = jnp.maximum(m_i, sc.max(axis=1))
                corr = jnp.exp2(m_i - m_new)
                p = jnp.exp2(sc - jax.lax.broadcast_in_dim(m_new, sc.shape, [0]))
                acc = acc * jax.lax.broadcast_in_dim(corr, acc.shape, [0])
                l_i = l_i * corr + p.sum(axis=1)
                p16 = p.astype(dtype)
                if not interpret:  # FA3's order: the softmax's results fixed before the waits
                    acc, l_i, m_new, p16 = jax.lax.optimization_barrier((acc, l_i, m_new, p16))
                plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(v_bars.at[slot])
                plgpu.barrier_wait(sched)
                nxt = _rem(t + 1, stages)
                if interpret:
                    acc = acc + jnp.dot(p16, v_tile[...],
                                        preferred_element_type=jnp.float32)

                    @pl.when(t + 1 < total)
                    def _():
                        plgpu.barrier_wait(k_bars.at[nxt])
                else:
                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, p16, v_tile)

                        @pl.when(t + 1 < total)
                        def _():
                            plgpu.barrier_wait(k_bars.at[nxt])
                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_consumed.at[slot])
                return acc, m_new, l_i

            carry = jax.lax.fori_loop(0, n, kv_step, (acc, m_i, l_i))
            later = []  # the state's column chunks held back until phase B is done
            if write_state:  # phase A's state, staged through shared memory
                acc_out, m_out, l_out = state_refs
                st_smem, ml_smem = st_smem2.at[wg], ml_smem2.at[wg]
                acc, m_i, l_i = carry
                ml_smem.at[0][...] = m_i
                ml_smem.at[1][...] = l_i
                chunks = [(pl.ds(c * STATE_COLS, STATE_COLS),
                           acc[:, c * STATE_COLS:(c + 1) * STATE_COLS])
                          for c in range(K // STATE_COLS)]
                st_smem[...] = chunks[0][1]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(ml_smem.at[0], m_out.at[b, h, rows])
                plgpu.copy_smem_to_gmem(ml_smem.at[1], l_out.at[b, h, rows])
                plgpu.copy_smem_to_gmem(st_smem, acc_out.at[b, rows, h, chunks[0][0]])
                # The staging slot is busy until TMA has read it: the next chunk waits for
                # that after phase B (whose steps hide it), not here (waiting here, fill took
                # 1.22x full at L 2048 on the H200; after phase B 1.11x: RESULTS.md, s18).
                later = chunks[1:]
            acc, _, l_i = jax.lax.fori_loop(n, total, functools.partial(kv_step, nk=wk), carry)
            pl.when(wg == 0)(schedule)
            for cols, part in later:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                st_smem[...] = part
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(st_smem, acc_out.at[b, rows, h, cols])
            acc = acc / jax.lax.broadcast_in_dim(l_i, acc.shape, [0])
            qo_smem[...] = acc.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo_smem, o_ref.at[b, rows, h])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == CONSUMERS)
        def _producer():
            if not interpret:
                plgpu.set_max_registers(40, action="decrease")
            g = jax.lax.div(h, jnp.asarray(rep, h.dtype))

            def fetch(t, window: bool, wait: bool):
                kr, vr, br = (kc_ref, vc_ref, bc_ref) if window else (k_ref, v_ref, ba_ref)
                nk = wk if window else block_kv
                keys = pl.ds((t - n if window else t) * nk, nk)
                slot = _rem(t, stages)
                rows = pl.ds(0, nk)  # the slot's first rows (a narrow window tile: fewer)
                if wait:
                    plgpu.barrier_wait(k_consumed.at[slot])
                plgpu.copy_gmem_to_smem(kr.at[b, keys, g], k_smem.at[slot, rows], k_bars.at[slot])
                plgpu.copy_gmem_to_smem(br.at[b, keys], b_smem.at[slot, rows], b_bars.at[slot])
                if wait:
                    plgpu.barrier_wait(v_consumed.at[slot])
                plgpu.copy_gmem_to_smem(vr.at[b, keys, g], v_smem.at[slot, rows], v_bars.at[slot])
            for t in range(stages):  # the ring's first fill: no slot to wait for
                fetch(t, t >= n, wait=False)
            if stages < n:
                pl.loop(stages, n)(lambda t: fetch(t, False, True))
            pl.loop(max(stages, n), total)(lambda t: fetch(t, True, True))
            for slot in range(stages):  # drain: every slot's last release, so no phase is left
                plgpu.barrier_wait(k_consumed.at[slot])  # unobserved when the CTA ends
                plgpu.barrier_wait(v_consumed.at[slot])

    def entry(*refs):
        item = jnp.dtype(dtype).itemsize * 8
        sw = plgpu.find_swizzle(K * item)
        tiled = (plgpu.TilingTransform((8, sw * 8 // item)), plgpu.SwizzleTransform(sw))
        sw32 = plgpu.find_swizzle(STATE_COLS * 32)
        tiled32 = (plgpu.TilingTransform((8, sw32 * 8 // 32)), plgpu.SwizzleTransform(sw32))
        smem = [plgpu.SMEM((CONSUMERS, BLOCK_Q, K), dtype, transforms=tiled),
                plgpu.SMEM((stages, block_kv, K), dtype, transforms=tiled),
                plgpu.SMEM((stages, block_kv, K), dtype, transforms=tiled),
                plgpu.SMEM((stages, block_kv), jnp.float32),
                plgpu.SMEM((CONSUMERS, BLOCK_Q, STATE_COLS), jnp.float32, transforms=tiled32)
                if write_state else None,
                plgpu.SMEM((CONSUMERS, 2, BLOCK_Q), jnp.float32) if write_state else None]
        pl.run_scoped(
            lambda *scoped: kernel(*refs, scoped),
            smem,
            (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
             plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=CONSUMERS)),
            (plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),) * 2,
            plgpu.Barrier(num_arrivals=CONSUMERS),
            collective_axes="wg")

    out_type = [jax.ShapeDtypeStruct((B, Lp, H, K), dtype)]
    if write_state:
        out_type += [jax.ShapeDtypeStruct((B, Lp, H, K), jnp.float32),
                     jax.ShapeDtypeStruct((B, H, Lp), jnp.float32),
                     jax.ShapeDtypeStruct((B, H, Lp), jnp.float32)]
    outs = plgpu.kernel(
        entry, out_type=out_type, grid=(H, Lp // tq, B), grid_names=("heads", "q_seq", "batch"),
        num_threads=CONSUMERS + 1, thread_name="wg",
        compiler_params=None if interpret else plgpu.CompilerParams(approx_math=True),
        interpret=hopper.interpret_params() if interpret else None,
    )(q_p, k_p, v_p, bias_a, k_c, v_c, bias_c)
    o = outs[0][:, :L]
    if not write_state:
        return o
    acc, m, l = outs[1][:, :L], outs[2][..., :L], outs[3][..., :L]
    return o, FAState(m, l, acc)
