"""The tensor-parallel column layout of the FP8 FFN copies (sharding.tp_layout), on one device:
gate/up rows and their block scales regrouped like the bf16 gate/up columns, undone exactly,
the same as quantising the regrouped bf16 weights, and the same FFN wherever it runs. The
meshes themselves are in test_multi_device.py (fake devices, a subprocess)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lacache_jax as lj
from lacache_jax import quant, sharding

# d_ff 512: 2 shards of 256 FFN columns (two 128-blocks each), 4 of 128.
CFG = lj.tiny(d_model=128, n_heads=4, n_kv_heads=2, d_ff=512, n_layers=2)


@pytest.fixture(scope="module")
def params():
    return lj.init_params(CFG, jax.random.key(0), jnp.float32)


def assert_same_params(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


@pytest.mark.parametrize("n", [2, 4])
def test_fp8_rows_follow_the_bf16_columns(params, n):
    p8 = lj.quantize_ffn(params)
    laid = sharding.tp_layout(p8, CFG, n)
    lay, w8 = laid.layers[1], laid.layers[1].ffn8
    assert lay.tp == w8.tp == n and laid.layers[0].ffn8 is None
    F = CFG.d_ff
    # Row group j of gate/up: gate rows j*F/n ... then up rows F + j*F/n ..., each 128-row
    # block with its own scale row.
    f32 = lambda a: np.asarray(a, np.float32)
    src, w8 = jax.tree.map(f32, p8.layers[1].ffn8), jax.tree.map(f32, w8)
    for j in range(n):
        part = slice(j * 2 * F // n, (j + 1) * 2 * F // n)
        gate = slice(j * F // n, (j + 1) * F // n)
        up = slice(F + gate.start, F + gate.stop)
        np.testing.assert_array_equal(w8.gate_up[part],
                                      np.concatenate([src.gate_up[gate], src.gate_up[up]]))
        s = lambda sl: slice(sl.start // 128, sl.stop // 128)
        np.testing.assert_array_equal(
            w8.gate_up_scale[s(part)],
            np.concatenate([src.gate_up_scale[s(gate)], src.gate_up_scale[s(up)]]))
    # down's K columns are FFN columns in order in every layout: untouched.
    np.testing.assert_array_equal(w8.down, src.down)
    # Quantising the regrouped bf16 weights gives the regrouped FP8 copy (each 128 x 128
    # block lies inside one group), and the layout is undone exactly.
    assert_same_params(lj.quantize_ffn(sharding.tp_layout(params, CFG, n)), laid)
    assert_same_params(sharding.tp_layout(laid, CFG, 1), p8)
    assert_same_params(sharding.tp_layout(sharding.tp_layout(p8, CFG, 4), CFG, n), laid)


@pytest.mark.parametrize("granularity", ["group", "token"])
def test_fp8_ffn_in_any_layout_on_one_device(params, granularity):
    """A layout of 4 column groups run by one device (4 groups in its one shard): the FFN
    of the checkpoint layout, bit for bit (the same products, summed in the same order)."""
    p8 = lj.quantize_ffn(params, granularity=granularity)
    laid = sharding.tp_layout(p8, CFG, 4)
    x = jax.random.normal(jax.random.key(1), (2, 8, CFG.d_model), jnp.float32)
    ffn = jax.jit(lambda x, layer: quant.ffn_fp8(x, layer.ff_norm, CFG.norm_eps, layer.ffn8))
    np.testing.assert_array_equal(ffn(x, laid.layers[1]), ffn(x, p8.layers[1]))


def test_fp8_split_must_keep_whole_blocks(params):
    p8 = lj.quantize_ffn(params)
    with pytest.raises(ValueError, match=r"d_ff=512 over the mesh's model axis \(8\) gives 64"):
        sharding.tp_layout(p8, CFG, 8)
    with pytest.raises(ValueError, match="d_ff / model to be a multiple of 128"):
        lj.quantize_ffn(sharding.tp_layout(params, CFG, 8))
    # Checkpoint restore: FP8 groups split only where they can.
    assert sharding.group_specs(CFG, 4)["fp8_layer_001"]["down"] == sharding.fp8_specs()["down"]
    assert "fp8_layer_001" not in sharding.group_specs(CFG, 8)
    assert "fp8_layer_001" not in sharding.group_specs(CFG)


def test_group_columns_bad_input():
    with pytest.raises(ValueError, match="w_DN"):
        sharding.group_columns(jnp.zeros((4, 10)), (4, 4), 2)  # parts miss 2 columns
    with pytest.raises(ValueError, match="w_DN"):
        sharding.group_columns(jnp.zeros((4, 6)), (3, 3), 2)  # 3 does not split in 2
