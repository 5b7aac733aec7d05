"""benchmarks/hlo_moves.py: weight-sized copies, concatenates etc. found in optimised HLO text
and placed at the while-loop depth they run at (what profile_step reports per step)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from benchmarks.hlo_moves import array_bytes, weight_sized_moves

W = 64 * 64 * 2  # bytes of one bf16 [64, 64] "weight" in the snippet below

# Two nested loops as XLA prints them after optimisation. Weight-sized moves: a convert in the
# entry (depth 0), a transpose in the outer body (1); in the inner body (2) a fused
# concatenate, a plain copy and a dynamic-update-slice reached through a conditional branch.
# Not moves: a small copy, an add of weight size, a fusion that slices a weight but writes only
# 8 rows and a bitcast of weight size.
SNIPPET = """\
HloModule jit_f, is_scheduled=true, entry_computation_layout={(bf16[64,64]{1,0})->f32[8,64]{1,0}}

%fused_concat (p0: bf16[64,64], p1: bf16[64,64]) -> bf16[64,128] {
  %p0 = bf16[64,64]{1,0} parameter(0)
  %p1 = bf16[64,64]{1,0} parameter(1)
  ROOT %cat = bf16[64,128]{1,0} concatenate(%p0, %p1), dimensions={1}
}

%fused_rows (p0.1: bf16[64,64]) -> bf16[8,64] {
  %p0.1 = bf16[64,64]{1,0} parameter(0)
  %big = bf16[64,64]{0,1} copy(%p0.1)
  ROOT %rows = bf16[8,64]{1,0} slice(%big), slice={[0:8], [0:64]}
}

%bw (bp: (bf16[64,64], bf16[8,64])) -> bf16[64,64] {
  %bp = (bf16[64,64]{1,0}, bf16[8,64]{1,0}) parameter(0)
  %buf = bf16[64,64]{1,0} get-tuple-element(%bp), index=0
  %upd = bf16[8,64]{1,0} get-tuple-element(%bp), index=1
  %z = s32[] constant(0)
  ROOT %dus = bf16[64,64]{1,0} dynamic-update-slice(%buf, %upd, %z, %z)
}

%bk (kp: (bf16[64,64], bf16[8,64])) -> bf16[64,64] {
  %kp = (bf16[64,64]{1,0}, bf16[8,64]{1,0}) parameter(0)
  ROOT %same = bf16[64,64]{1,0} get-tuple-element(%kp), index=0
}

%ibody (ip: (s32[], bf16[64,64], /*index=2*/f32[8,64])) -> (s32[], bf16[64,64], f32[8,64]) {
  %ip = (s32[], bf16[64,64]{1,0}, /*index=2*/f32[8,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%ip), index=0
  %w = bf16[64,64]{1,0} get-tuple-element(%ip), index=1
  %acc = f32[8,64]{1,0} get-tuple-element(%ip), index=2
  %wkv = bf16[64,128]{1,0} fusion(%w, %w), kind=kLoop, calls=%fused_concat
  %wt = bf16[64,64]{0,1} copy(%w), metadata={op_name="jit(f)/while/body/copy"}
  %small = f32[8,64]{0,1} copy(%acc)
  %sum = bf16[64,64]{1,0} add(%w, %wt)
  %rows = bf16[8,64]{1,0} fusion(%w), kind=kLoop, calls=%fused_rows
  %flat = bf16[4096]{0} bitcast(%w)
  %pick = s32[] constant(0)
  %pair = (bf16[64,64]{1,0}, bf16[8,64]{1,0}) tuple(%sum, %rows)
  %new = bf16[64,64]{1,0} conditional(%pick, %pair, %pair), branch_computations={%bw, %bk}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], bf16[64,64]{1,0}, /*index=2*/f32[8,64]{1,0}) tuple(%next, %new, %small)
}

%icond (cp: (s32[], bf16[64,64], f32[8,64])) -> pred[] {
  %cp = (s32[], bf16[64,64]{1,0}, f32[8,64]{1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%cp), index=0
  %four = s32[] constant(4)
  ROOT %lt = pred[] compare(%ci, %four), direction=LT
}

%obody (op: (s32[], bf16[64,64], f32[8,64])) -> (s32[], bf16[64,64], f32[8,64]) {
  %op = (s32[], bf16[64,64]{1,0}, f32[8,64]{1,0}) parameter(0)
  %ow = bf16[64,64]{1,0} get-tuple-element(%op), index=1
  %owt = bf16[64,64]{0,1} transpose(%ow), dimensions={1,0}
  ROOT %loop = (s32[], bf16[64,64]{1,0}, f32[8,64]{1,0}) while(%op), condition=%icond, body=%ibody
}

%ocond (oc: (s32[], bf16[64,64], f32[8,64])) -> pred[] {
  %oc = (s32[], bf16[64,64]{1,0}, f32[8,64]{1,0}) parameter(0)
  %oi = s32[] get-tuple-element(%oc), index=0
  %two = s32[] constant(2)
  ROOT %olt = pred[] compare(%oi, %two), direction=LT
}

ENTRY %main (arg: bf16[64,64]) -> f32[8,64] {
  %arg = bf16[64,64]{1,0} parameter(0)
  %wide = f32[64,64]{1,0} convert(%arg)
  %zero = s32[] constant(0)
  %acc0 = f32[8,64]{1,0} broadcast(%zero), dimensions={}
  %init = (s32[], bf16[64,64]{1,0}, f32[8,64]{1,0}) tuple(%zero, %arg, %acc0)
  %loop0 = (s32[], bf16[64,64]{1,0}, f32[8,64]{1,0}) while(%init), condition=%ocond, body=%obody
  ROOT %res = f32[8,64]{1,0} get-tuple-element(%loop0), index=2
}
"""


def test_array_bytes():
    assert array_bytes("bf16[4096,8192]{1,0}") == 4096 * 8192 * 2
    assert array_bytes("(s32[], f32[2,3]{1,0}, /*index=2*/bf16[5]{0})") == 2 * 3 * 4
    assert array_bytes("pred[10]{0}") == 10
    assert array_bytes("f8e4m3fn[128,4]{1,0}") == 512
    assert array_bytes("s4[8]{0}") == 4
    assert array_bytes("token[]") == 0
    assert array_bytes("f32[]") == 4


def test_moves_by_loop_depth_in_a_snippet():
    report = weight_sized_moves(SNIPPET, W)
    assert report.loop_depth == 2
    found = {(m.depth, m.opcode, m.name) for m in report.moves}
    assert found == {
        (0, "convert", "wide"),
        (1, "transpose", "owt"),
        (2, "fusion[concatenate]", "wkv"),
        (2, "copy", "wt"),
        (2, "dynamic-update-slice", "dus"),
    }
    assert report.by_depth() == {0: 1, 1: 1, 2: 3}
    # One byte more than a bf16 [64, 64] leaves only the results larger than it: the
    # convert to f32 and the concatenated [64, 128].
    bigger = weight_sized_moves(SNIPPET, W + 1)
    assert {m.name for m in bigger.moves} == {"wide", "wkv"}


def test_moves_in_a_compiled_program():
    """A concatenate of two weights that depends on the loop counter runs in the loop body;
    the same concatenate of loop-invariant weights outside it. The counter sees both (the
    copy-only count that profile_step used before could see neither)."""
    def inside(wk, wv, x):
        def body(i, acc):
            w = jnp.concatenate([wk * i.astype(wk.dtype), wv], axis=1)
            return acc + jnp.tanh(acc @ w)[:, :64]
        return jax.lax.fori_loop(0, 4, body, x)

    def outside(wk, wv, x):
        w = jnp.concatenate([wk, wv], axis=1)
        return jax.lax.fori_loop(0, 4, lambda i, acc: acc + jnp.tanh(acc @ w)[:, :64], x)

    w = jnp.ones((64, 64), jnp.float32)
    x = jnp.ones((2, 64), jnp.float32)
    for fn, expect in ((inside, {0: 0, 1: 1}), (outside, {0: 1, 1: 0})):
        report = weight_sized_moves(jax.jit(fn).lower(w, w, x).compile().as_text(), w.nbytes)
        assert report.by_depth() == expect, (fn.__name__, report.moves)
        assert all("concatenate" in m.opcode for m in report.moves)


def test_bad_input():
    with pytest.raises(ValueError, match="min_bytes"):
        weight_sized_moves(SNIPPET, 0)
    with pytest.raises(ValueError, match="hlo_text"):
        weight_sized_moves("HloModule empty", W)
