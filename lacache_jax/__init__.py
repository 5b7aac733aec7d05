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

import signal as _signal
import sys as _sys
import threading as _threading

# `python -m lacache_jax ...` imports this package (and jax, a second or more) before its
# command can install a handler: Python's own SIGINT handler then raises wherever the main
# thread is, and a KeyboardInterrupt raised inside one of jax's garbage-collection callbacks
# is only printed, the press lost (seen 3 of 3 times at 0.3 s). Under `-m` (argv[0] is "-m"
# while the module is located) a press is recorded instead: our commands (`python -m
# lacache_jax`, `python -m lacache_jax.lm_eval`) take it over (`take_early_interrupt`) once
# their imports are done; for any other module it is raised when this package's imports end.
_import_interrupted = False
_COMMANDS = ("lacache_jax", "lacache_jax.lm_eval")


def _record_interrupt(signum, frame) -> None:
    global _import_interrupted
    _import_interrupted = True


def take_early_interrupt() -> bool:
    """Whether Ctrl-C was pressed while `python -m` imported this package and its command
    (then cleared: a press is taken once); hands SIGINT back to Python's handler if the
    recorder still holds it."""
    global _import_interrupted
    if _signal.getsignal(_signal.SIGINT) is _record_interrupt:
        _signal.signal(_signal.SIGINT, _signal.default_int_handler)
    pressed, _import_interrupted = _import_interrupted, False
    return pressed


def _m_target() -> str | None:
    """The module `python -m X` (or `-mX`) runs, from the interpreter's own command line."""
    argv, i = getattr(_sys, "orig_argv", []), 1
    while i < len(argv) and argv[i].startswith("-") and not argv[i].startswith("--"):
        flags, i = argv[i][1:], i + 1
        if "m" in flags:  # -m X, -mX, -Bm X
            rest = flags[flags.index("m") + 1:]
            return rest or (argv[i] if i < len(argv) else None)
        if flags in ("X", "W"):  # options that take the next argument
            i += 1
    return None


_guard = (_sys.argv[:1] == ["-m"]
          and _threading.current_thread() is _threading.main_thread()  # signal.signal's rule
          and _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler)
if _guard:
    _signal.signal(_signal.SIGINT, _record_interrupt)

try:
    from lacache_jax.checkpoint import CheckpointError, load, save
    from lacache_jax.config import (ConfigError, DPadConfig, FlashConfig, GenerationConfig,
                                    ModelConfig, llada_8b, tiny)
    from lacache_jax.generate import GenerateOutput, compile_generate, generate
    from lacache_jax.model import LLaDA, Layer, Params, forward, init_params
    from lacache_jax.quant import quantize_ffn
    from lacache_jax.sharding import make_mesh
except BaseException:
    if _guard:  # a failed import (a caller may catch it) must not leave Ctrl-C recorded only
        take_early_interrupt()
    raise

if _guard and _m_target() not in _COMMANDS:
    if take_early_interrupt():  # no command of ours to honour it: Python reports it
        raise KeyboardInterrupt

__all__ = [
    "CheckpointError", "ConfigError", "DPadConfig", "FlashConfig", "GenerateOutput",
    "GenerationConfig", "LLaDA", "Layer", "ModelConfig", "Params", "compile_generate", "forward",
    "generate", "init_params", "llada_8b", "load", "make_mesh", "quantize_ffn", "save", "tiny",
]
