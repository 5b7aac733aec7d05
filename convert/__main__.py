"""python -m convert SRC DST [--dtype bfloat16|float32] [--force]"""

from __future__ import annotations

import argparse
import sys

from convert.llada import DTYPES, convert
from convert.sources import ConvertError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m convert",
        description="Convert a Hugging Face LLaDA checkpoint (config.json + safetensors, or a "
                    "PyTorch state dict) into a lacache_jax checkpoint directory.")
    parser.add_argument("src", help="HF LLaDA directory")
    parser.add_argument("dst", help="output checkpoint directory (must not exist)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                        help="stored weight dtype (default: bfloat16)")
    parser.add_argument("--force", action="store_true", help="replace an existing DST")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        cfg = convert(args.src, args.dst, dtype=args.dtype, force=args.force,
                      progress=not args.quiet)
    except ConvertError as e:
        print(f"convert: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("convert: interrupted; nothing was written", file=sys.stderr)
        return 130
    print(f"wrote {args.dst}: {cfg.n_layers} layers, d_model {cfg.d_model}, "
          f"{cfg.n_params / 1e6:.1f}M parameters, {args.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
