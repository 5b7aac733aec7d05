"""Import Hugging Face / PyTorch LLaDA checkpoints: `python -m convert SRC DST`.

The names below load lazily, so `python -m convert` reaches its Ctrl-C handling before jax and
orbax are imported (an interrupt during those imports then also ends in one line, exit 130).
"""

from __future__ import annotations

import importlib

_EXPORTS = {"convert": "convert.llada", "ConvertWarning": "convert.llada",
            "ConvertError": "convert.sources", "export_hf": "lacache_jax.hf_export",
            "key_plan": "lacache_jax.hf_export"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'convert' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
