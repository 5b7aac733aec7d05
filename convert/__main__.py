"""python -m convert SRC DST [--dtype bfloat16|float32] [--fp8-ffn [--fp8-skip 0]] [--force]"""

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
    parser.add_argument("--fp8-ffn", action="store_true",
                        help="also store FP8 FFN weights (128x128 block scales) for "
                             "GenerationConfig(fp8_ffn=True)")
    parser.add_argument("--fp8-skip", default="0",
                        help="comma-separated layers kept in bf16 with --fp8-ffn (default: 0, "
                             "as LaCache); '' quantises every layer")
    parser.add_argument("--force", action="store_true", help="replace an existing DST")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        skip = None
        if args.fp8_ffn:
            try:
                skip = tuple(int(i) for i in args.fp8_skip.split(",") if i.strip())
            except ValueError:
                raise ConvertError(
                    f"--fp8-skip must list layer numbers, got {args.fp8_skip!r}") from None
        cfg = convert(args.src, args.dst, dtype=args.dtype, force=args.force,
                      progress=not args.quiet, fp8_skip=skip)
    except ConvertError as e:
        print(f"convert: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("convert: interrupted; nothing was written", file=sys.stderr)
        return 130
    print(f"wrote {args.dst}: {cfg.n_layers} layers, d_model {cfg.d_model}, "
          f"{cfg.n_params / 1e6:.1f}M parameters, {args.dtype}"
          + (f", FP8 FFN in layers other than {list(skip)}" if skip is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
