"""Pallas GPU kernels, each beside a pure-jnp reference with the same signature.

Names follow the package legend (`lacache_jax/__init__.py`: B, T, L, S, H, G, K, ...) in the
attention and cache kernels. The FP8 GEMM and quantisation kernels (`fp8_*`, `fused_quant`)
speak in GEMM terms instead: M rows (tokens, flattened), N output columns, K the contracted
width, and G = K / 128 the per-group scales along it (not key/value heads); R and C there
are a tile's rows and groups.
"""
