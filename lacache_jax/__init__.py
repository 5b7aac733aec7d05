"""lacache_jax: fast, exact-where-possible inference for diffusion LLMs (LLaDA) in JAX."""

from lacache_jax.checkpoint import CheckpointError, load, save
from lacache_jax.config import (ConfigError, DPadConfig, GenerationConfig, ModelConfig, llada_8b,
                                tiny)
from lacache_jax.generate import GenerateOutput, compile_generate, generate
from lacache_jax.model import LLaDA, Layer, Params, forward, init_params
from lacache_jax.quant import quantize_ffn
from lacache_jax.sharding import make_mesh

__all__ = [
    "CheckpointError", "ConfigError", "DPadConfig", "GenerateOutput", "GenerationConfig", "LLaDA",
    "Layer", "ModelConfig", "Params", "compile_generate", "forward", "generate", "init_params",
    "llada_8b", "load", "make_mesh", "quantize_ffn", "save", "tiny",
]
