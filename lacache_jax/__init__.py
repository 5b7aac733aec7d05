"""lacache_jax: fast, exact-where-possible inference for diffusion LLMs (LLaDA) in JAX.

One legend of short names, used the same way in every file. Array names end in their axes
(`x_BT`, `logits_BQV`, `cos_MTk`):

  B  batch rows                    M  model rows (B, or 2B with CFG's unconditional copies)
  T  canvas columns (P + gen_length)  L  query rows of a forward   S  keys it attends to
  Q  the current block's columns (block_length)                  D  d_model
  H  query heads    G  key/value heads    K  head dim (k: K/2)    F  FFN hidden    V  vocab
  N  output columns of a matmul
  R  Flash-dLLM's query rows of a step (window, look-ahead, tracked; flash.py)
  C  Flash-Verify's candidates (window // 2 at most)

Scalars: `P` the padded prompt length, `s` / `e` a block's first / past-the-end column, `i` the
step within a block; a count of things is `n_` or `n` + the thing (`ncand_B`: per row).
`cfg` is a ModelConfig, `gen` a GenerationConfig; PartitionSpec is `PS`. `x0` is LLaDA's
predicted tokens (`x0_BQ`), never the embedding output (`emb`).
"""

from lacache_jax.checkpoint import CheckpointError, load, save
from lacache_jax.config import (ConfigError, DPadConfig, FlashConfig, GenerationConfig,
                                ModelConfig, llada_8b, tiny)
from lacache_jax.generate import GenerateOutput, compile_generate, generate
from lacache_jax.model import LLaDA, Layer, Params, forward, init_params
from lacache_jax.quant import quantize_ffn
from lacache_jax.sharding import make_mesh

__all__ = [
    "CheckpointError", "ConfigError", "DPadConfig", "FlashConfig", "GenerateOutput",
    "GenerationConfig", "LLaDA", "Layer", "ModelConfig", "Params", "compile_generate", "forward",
    "generate", "init_params", "llada_8b", "load", "make_mesh", "quantize_ffn", "save", "tiny",
]
