"""Import Hugging Face / PyTorch LLaDA checkpoints: `python -m convert SRC DST`."""

from convert.llada import convert, export_hf, key_plan
from convert.sources import ConvertError

__all__ = ["convert", "export_hf", "key_plan", "ConvertError"]
