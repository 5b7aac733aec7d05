"""python -m convert SRC DST [--dtype bfloat16|float32] [--fp8-ffn [--fp8-skip 0]] [--force]
    [--quiet]

Ctrl-C (and SIGTERM, what `timeout` and job schedulers send): the handler installed first
thing only records the signal; the conversion stops at its next safe point (between weight
groups, never inside an orbax write), removes its temporary directory and the command prints
one line and exits 130 (143 for SIGTERM). An interrupt that arrives
after DST was put in place changes nothing: the conversion is complete, reported as such. Once
the command has returned, SIGINT is ignored for the rest of the process (jax's atexit clean-up,
the interpreter's shutdown): the default handler would turn a late Ctrl-C into a traceback, and
a Python handler is reset to the default at shutdown, where a late Ctrl-C killed a finished
conversion (exit -2, seen under CI's parallel test run); an ignored signal stays ignored.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import warnings


class _DeferredInterrupt:
    """A SIGINT / SIGTERM handler that records the signal; `check()` raises KeyboardInterrupt
    where it is safe."""

    def __init__(self):
        self.pending = 0  # the signal number recorded, 0 for none

    def __call__(self, signum, frame) -> None:
        self.pending = self.pending or signum

    def check(self) -> None:
        if self.pending:
            raise KeyboardInterrupt


def main(argv: list[str] | None = None, *, keep_handler: bool = False) -> int:
    """The command; `keep_handler` (the process entry points) leaves the recording SIGINT and
    SIGTERM handler installed after returning, for the rest of the process's life."""
    interrupt = _DeferredInterrupt()
    in_main = threading.current_thread() is threading.main_thread()
    previous = ({sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
                if in_main else {})
    try:
        if keep_handler:  # the process's; imported once the handler is in (it loads jax)
            from lacache_jax.checkpoint import drop_late_tensorstore_errors
            drop_late_tensorstore_errors()  # a failed write stays one line
        return _run(argv, interrupt)
    except KeyboardInterrupt:
        terminated = interrupt.pending == signal.SIGTERM
        print(f"convert: {'terminated' if terminated else 'interrupted'}; nothing was written",
              file=sys.stderr)
        return 143 if terminated else 130
    finally:
        for sig, handler in previous.items():
            if not keep_handler:  # None: a handler not set from Python; the default stands in
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def cli() -> None:
    """The `lacache-convert` console script and `python -m convert`."""
    rc = main(keep_handler=True)
    for sig in (signal.SIGINT, signal.SIGTERM):  # nothing left to interrupt (docstring)
        signal.signal(sig, signal.SIG_IGN)
    sys.exit(rc)


def _run(argv: list[str] | None, interrupt: _DeferredInterrupt) -> int:
    script = os.path.basename(sys.argv[0])  # the `lacache-convert` console script names itself
    parser = argparse.ArgumentParser(
        prog="python -m convert" if script in ("__main__.py", "-m", "") else script,
        description="Convert a Hugging Face LLaDA checkpoint (config.json + safetensors, or a "
                    "PyTorch state dict) into a lacache_jax checkpoint directory.")
    parser.add_argument("src", help="HF LLaDA directory")
    parser.add_argument("dst", help="output checkpoint directory (must not exist, unless "
                                    "--force)")
    # The keys of convert.llada.DTYPES, not imported here: jax comes with it.
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="stored weight dtype (default: bfloat16)")
    parser.add_argument("--fp8-ffn", action="store_true",
                        help="also store FP8 FFN weights (128x128 block scales) for "
                             "GenerationConfig(fp8_ffn=True)")
    parser.add_argument("--fp8-skip", default=None,
                        help="comma-separated layers kept in bf16 with --fp8-ffn (default: 0, "
                             "as LaCache); '' quantises every layer")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing DST that is a checkpoint (or an empty "
                             "directory; anything else is refused), once the new one is "
                             "complete")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bar (there is none when stderr is not a terminal)")
    args = parser.parse_args(argv)
    interrupt.check()
    from convert.llada import ConvertWarning, convert  # jax, orbax: seconds of imports
    from convert.sources import ConvertError
    interrupt.check()
    # orbax's writer threads log a failed write (a full disk) with its traceback, twice,
    # before the same error reaches `convert` and becomes its one line: not printed here.
    logging.getLogger("absl").setLevel(logging.CRITICAL)
    try:
        skip = None
        if args.fp8_skip is not None and not args.fp8_ffn:
            raise ConvertError("--fp8-skip without --fp8-ffn: it names the layers --fp8-ffn "
                               "leaves in bf16")
        if args.fp8_ffn:
            listed = "0" if args.fp8_skip is None else args.fp8_skip
            try:
                skip = tuple(int(i) for i in listed.split(",") if i.strip())
            except ValueError:
                raise ConvertError(f"--fp8-skip must list layer numbers, got {listed!r}") from None
        with warnings.catch_warnings():
            warnings.simplefilter("always", ConvertWarning)
            warnings.showwarning = _one_line_warning
            cfg = convert(args.src, args.dst, dtype=args.dtype, force=args.force,
                          progress=not args.quiet and sys.stderr.isatty(), fp8_skip=skip,
                          safe_point=interrupt.check)
    except ConvertError as e:
        print(f"convert: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.dst}: {cfg.n_layers} layers, d_model {cfg.d_model}, "
          f"{cfg.n_params / 1e6:.1f}M parameters, {args.dtype}"
          + (f", FP8 FFN in layers other than {list(skip)}" if skip is not None else ""))
    return 0


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"convert: warning: {message}", file=sys.stderr)


if __name__ == "__main__":
    cli()
