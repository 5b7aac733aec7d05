"""Kept for importers of `convert.safetensors_file`: the format now lives in the engine
(`lacache_jax.safetensors_file`), which the exporter needs without importing the converter."""

from lacache_jax.safetensors_file import (DTYPES, FormatError, TensorInfo, read_header,
                                          read_tensor, write_file)

__all__ = ["DTYPES", "FormatError", "TensorInfo", "read_header", "read_tensor", "write_file"]
