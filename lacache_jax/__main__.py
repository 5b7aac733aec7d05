"""Command line: `python -m lacache_jax generate|demo`.

Owns turning a checkpoint directory and prompts (flags or a file) into printed or JSONL answers,
with errors as one line and exit 1. It never imports the converter (`convert`): the demo runs
`python -m convert` as a program, and exports through `lacache_jax.hf_export`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Iterator

import lacache_jax
from lacache_jax import config as lj_config


class CLIError(ValueError):
    """Bad command-line input: printed as one line, exit status 1."""


class Interrupt:
    """The SIGINT handler while a command runs: the first Ctrl-C is recorded and honoured at
    the next safe point (`check`: before loading, before compiling, before and after
    generating), never inside jax's tracing, compilation or a running program, where an
    exception left the process to crash at exit (-11 on the CPU); a second stops at once:
    with `exit_at_once` (the process entry point) by ending the process, exit status 130,
    since an exception raised there could crash it the same way or be swallowed (a
    KeyboardInterrupt raised inside a garbage-collection callback is only printed); else
    (`main` called in-process) by raising. After the last check (`check(last=True)`) the
    output is written whole: Ctrl-C is ignored."""

    def __init__(self, exit_at_once: bool = False):
        self.pending = False
        self.closed = False
        self.exit_at_once = exit_at_once

    def __call__(self, signum, frame) -> None:
        if self.closed:
            return
        if self.pending:
            if self.exit_at_once:  # nothing is half-written: the output is written last
                os.write(2, b"\ninterrupted\n")
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                os._exit(130)
            raise KeyboardInterrupt
        self.pending = True
        message = "stopping at the next safe point (Ctrl-C again: at once)"
        if sys.stderr.isatty():  # below the progress bar's line, which redraws over its own
            message = "\n" + message
        try:
            print(message, file=sys.stderr, flush=True)
        except RuntimeError:  # the press landed inside a write to stderr (the progress bar's):
            os.write(2, f"\n{message.lstrip()}\n".encode())  # "reentrant call"; the fd takes it

    def check(self, last: bool = False) -> None:
        if self.pending:
            raise KeyboardInterrupt
        self.closed = last


@dataclasses.dataclass(frozen=True)
class Prompt:
    text: str
    where: str  # for messages: "--prompt 2" or "prompts.jsonl:7"


# --- demo ---------------------------------------------------------------------------------

def cmd_demo(args) -> int:
    """Build a tiny random LLaDA in the HF layout, convert it with `python -m convert`, load it
    and run a bidirectional forward pass; check it against the weights it came from."""
    if args.workdir:
        return _demo(Path(args.workdir), args.seed, args.interrupt.check)
    with tempfile.TemporaryDirectory(prefix="lacache_demo_") as work:
        return _demo(Path(work), args.seed, args.interrupt.check)


def _demo(work: Path, seed: int, check) -> int:
    """`check()` between the stages: a Ctrl-C stops there (the temporary directory goes)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import lacache_jax as lj
    from lacache_jax.hf_export import export_hf

    cfg = lj.tiny(d_model=128, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=352)
    work.mkdir(parents=True, exist_ok=True)
    hf_dir, ckpt_dir = work / "hf_llada", work / "checkpoint"
    params = lj.init_params(cfg, jax.random.key(seed), jnp.bfloat16)
    export_hf(hf_dir, cfg, params, max_shard_bytes=200_000, force=True)
    shards = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    print(f"1. random LLaDA ({cfg.n_params / 1e6:.2f}M params, {cfg.n_layers} layers, "
          f"d_model {cfg.d_model}, GQA {cfg.n_heads}/{cfg.n_kv_heads}) written in the HF layout:"
          f"\n   {hf_dir} ({len(shards)} shards + index)")

    check()
    cmd = [sys.executable, "-m", "convert", str(hf_dir), str(ckpt_dir), "--force", "--quiet"]
    print(f"2. $ python -m convert {hf_dir} {ckpt_dir}")
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        print(done.stderr, file=sys.stderr)
        return done.returncode
    print("   " + done.stdout.strip())

    check()
    config, loaded = lj.load(ckpt_dir)
    same = all(jax.tree.leaves(jax.tree.map(lambda a, b: bool((a == b).all()), loaded, params)))
    print(f"3. lj.load: config matches: {config == cfg}; weights bit-identical: {same}")

    check()
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, cfg.mask_id - 2, (2, 24)).astype(np.int32)
    canvas = np.concatenate([prompt, np.full((2, 8), cfg.mask_id, np.int32)], axis=1)
    key_mask = np.ones_like(canvas, bool)
    key_mask[1, :5] = False  # row 1 is left-padded by 5
    logits = lj.forward(loaded, config, canvas, attention_mask=key_mask)
    jax.block_until_ready(logits)
    t0 = time.perf_counter()
    for _ in range(10):
        logits = lj.forward(loaded, config, canvas, attention_mask=key_mask)
    jax.block_until_ready(logits)
    ms = (time.perf_counter() - t0) / 10 * 1e3
    probs = jax.nn.softmax(logits[:, -8:].astype(jnp.float32), axis=-1)
    print(f"4. lj.forward on a [2, 32] canvas (24 prompt + 8 masks; row 1 left-padded): logits "
          f"{list(logits.shape)} {logits.dtype}, {ms:.2f} ms/pass on {jax.default_backend()}")
    print(f"   argmax at the masked positions: {np.asarray(probs.argmax(-1)).tolist()}")
    print(f"   their confidence (random weights, so near 1/V = {1 / cfg.vocab_size:.4f}): "
          f"{float(probs.max(-1).mean()):.4f} on average")
    return 0


# --- generate -----------------------------------------------------------------------------

def cmd_generate(args) -> int:
    """Load a checkpoint and its tokenizer, generate for the prompts (one ragged batch), print
    the answers (text or JSONL) and, on stderr, the speed."""
    import jax

    import lacache_jax as lj
    from lacache_jax.checkpoint import read_meta
    from lacache_jax.tokenizer import Tokenizer

    ckpt = Path(args.checkpoint)
    if not ckpt.is_dir():
        raise CLIError(f"--checkpoint {ckpt}: directory does not exist")
    if args.out is not None:
        _check_out(args.out)
    if args.slots is not None and args.slots < 1:
        raise CLIError(f"--slots must be a positive integer, got {args.slots}")
    prompts = [Prompt(p, f"--prompt {i}") for i, p in enumerate(args.prompt or [], 1)]
    if args.prompts_file is not None:
        prompts += read_prompts_file(args.prompts_file)
    if not prompts:
        raise CLIError("no prompt: pass --prompt TEXT (repeatable) or --prompts-file PATH")

    config, _, _ = read_meta(ckpt)  # cheap: every check below runs before the weights load
    tok = Tokenizer(ckpt, reserved_ids={config.eos_id, config.mask_id, config.pad_id})
    gen = _settings(args, config, tok)
    ids = [_encode(tok, p, args.chat) for p in prompts]
    for p, row in zip(prompts, ids):  # (generate's own message names prompts[i] and a position)
        if config.mask_id in row:
            raise CLIError(f"{p.where}: holds the mask token (id {config.mask_id}), a position "
                           "for the model to fill: remove it")
    longest = max(range(len(ids)), key=lambda i: len(ids[i]))
    if len(ids[longest]) + gen.gen_length > config.max_seq_len:
        raise CLIError(f"{prompts[longest].where}: {len(ids[longest])} prompt tokens + "
                       f"--gen-length {gen.gen_length} exceed the model's max_sequence_length "
                       f"{config.max_seq_len}")

    check = args.interrupt.check
    check()
    _start_backend()
    config, params = lj.load(ckpt, dtype=args.dtype, progress=False if args.quiet else None)
    if args.fp8_ffn and not lj.quant.has_fp8_ffn(params):
        _note(args, "[quantising the FFN weights to FP8 at load; `python -m convert --fp8-ffn` "
                    "stores them]")
        params = lj.quantize_ffn(params)
    progress = None if args.quiet or not sys.stderr.isatty() else BlockProgress()
    check()
    out, compile_s, run_s = run_batch(params, config, ids, gen, jax.random.key(args.seed),
                                      progress, args.slots, check)
    check(last=True)
    answers = [tok.decode(a) for a in out.answers(gen.gen_length)]
    if args.output == "jsonl":
        text = "".join(json.dumps({
            "prompt": p.text, "text": a, "gen_length": int(out.gen_lengths[i]),
            "nfe": int(out.nfe[i]), "steps": int(out.steps[i]),
            "tokens_per_step": float(out.tokens_per_step[i])}, ensure_ascii=False) + "\n"
            for i, (p, a) in enumerate(zip(prompts, answers)))
    elif len(prompts) > 1:
        text = "".join(f"--- {i}: {p.text}\n{a}\n"
                       for i, (p, a) in enumerate(zip(prompts, answers)))
    else:
        text = answers[0] + "\n"
    if args.out is None:
        sys.stdout.write(text)
    else:
        try:
            write_atomically(Path(args.out), text)
        except OSError as e:  # a full or failing disk: the answers go to stdout, not lost
            sys.stdout.write(text)
            raise CLIError(f"--out {args.out}: {e.strerror or e}; the answers went to stdout "
                           "instead") from None
    n = int(out.gen_lengths.sum())
    rows = f"{len(prompts)} prompts, " if len(prompts) > 1 else ""
    _note(args, f"\n[{rows}{n} tokens in {run_s:.2f} s = {n / run_s:.1f} tokens/s (up to the "
                f"first EOS); NFE {int(out.nfe.max())}; {float(out.tokens_per_step.mean()):.2f} "
                f"tokens per step; compile {compile_s:.1f} s; {jax.default_backend()}]"
                + (f"; wrote {args.out}" if args.out is not None else ""))
    return 0


def _check_out(out: str) -> None:
    """--out names a file in a writable directory (checked before anything runs)."""
    parent = Path(out).absolute().parent
    if not parent.is_dir():
        raise CLIError(f"--out {out}: directory {parent} does not exist")
    if Path(out).is_dir():
        raise CLIError(f"--out {out} is a directory: name a file")
    if not os.access(parent, os.W_OK):
        raise CLIError(f"--out {out}: directory {parent} is not writable")


def _settings(args, config, tok):
    """The generate command's GenerationConfig, resolved against the model (its ids checked
    against the vocabulary before the weights load); the library's errors in flag names."""
    eot_id = args.eot_id
    if eot_id is not None and not args.confidence_eos_eot_inf:
        raise CLIError("--eot-id without --confidence-eos-eot-inf, the only setting that uses it")
    if args.confidence_eos_eot_inf and eot_id is None:
        eot_id = tok.token_id("<|eot_id|>")  # LLaDA's end of turn
        if eot_id is None:
            raise CLIError("--confidence-eos-eot-inf needs --eot-id: this tokenizer has no "
                           "<|eot_id|>")
    try:
        gen = generation_config(args, eot_id)
        gen.resolve(config)
    except CLIError:
        raise
    except ValueError as e:  # the library's words for a setting are its fields' names
        raise CLIError(in_flags(str(e))) from None
    return gen


def _start_backend() -> None:
    """Start jax's backend: one that fails to (JAX_PLATFORMS naming one that is not
    installed: a bare AssertionError from jax) is one line naming the setting."""
    import jax
    try:
        jax.devices()
    except Exception as e:  # noqa: BLE001 (jax raises AssertionError or RuntimeError here)
        platforms = os.environ.get("JAX_PLATFORMS")
        named = f" (JAX_PLATFORMS={platforms})" if platforms else ""
        raise CLIError(f"jax could not start a backend{named}: {type(e).__name__}"
                       f"{f': {e}' if str(e) else ''}. For NVIDIA GPUs install jax's CUDA "
                       "plugin: pip install -e '.[cuda]'") from None


def run_batch(params, config, prompts: list[list[int]], gen, key,
              progress: BlockProgress | None, slots: int | None = None,
              check=lambda: None):
    """Generate for every prompt: (output, compile s, run s), answers and counters per prompt
    in input order. One ragged batch, or with `slots` at most that many rows in flight, each
    refilled with the next prompt as it finishes (slot refill). With `progress`, its bar is
    shown while the compiled program runs (blocks, or finished prompts with slots)."""
    import jax

    import lacache_jax as lj
    t0 = time.perf_counter()
    if progress is not None:  # a terminal: say what the seconds before the bar are
        print("compiling the generation program ...", end="\r", file=sys.stderr, flush=True)
    try:
        run = lj.compile_generate(params, config, prompts, gen, key=key, progress=progress,
                                  slots=slots)
    finally:
        if progress is not None:
            print(" " * 40, end="\r", file=sys.stderr, flush=True)
    compile_s = time.perf_counter() - t0
    check()
    t0 = time.perf_counter()
    total = len(prompts) if slots else gen.num_blocks
    with progress.showing(total) if progress is not None else contextlib.nullcontext():
        out = jax.block_until_ready(run())
    return out, compile_s, time.perf_counter() - t0


class BlockProgress:
    """`progress(blocks_done, num_blocks)` for `lj.compile_generate`: one host callback per
    finished block advances a tqdm bar on stderr (opened by `showing`, after compilation, so
    its clock counts generation only). Without it no callback is compiled in at all."""

    def __init__(self):
        self._bar = None

    def __call__(self, done: int, num_blocks: int) -> None:
        if self._bar is not None:
            self._bar.update(done - self._bar.n)

    @contextlib.contextmanager
    def showing(self, num_blocks: int) -> Iterator[None]:
        from tqdm.auto import tqdm
        # mininterval=0: draw every block; a block takes milliseconds at least, a draw microseconds
        try:
            with tqdm(total=num_blocks, unit="block", desc="generating", file=sys.stderr,
                      leave=False, mininterval=0) as self._bar:
                yield
        finally:
            self._bar = None


def read_prompts_file(path: str | os.PathLike) -> list[Prompt]:
    """One prompt per non-empty line; a `.jsonl` file holds one JSON object per line with a
    string "prompt" field (other fields are ignored)."""
    path = Path(path)
    if not path.is_file():
        raise CLIError(f"--prompts-file {path}: no such file")
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as e:
        raise CLIError(f"--prompts-file {path}: not UTF-8 text ({e})") from None
    jsonl = path.suffix.lower() in (".jsonl", ".ndjson")
    prompts = []
    for n, line in enumerate(lines, 1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        where = f"{path}:{n}"
        if jsonl:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise CLIError(f"{where}: not valid JSON ({e})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise CLIError(f'{where}: expected a JSON object with a string "prompt" field')
            line = obj["prompt"]
        prompts.append(Prompt(line, where))
    if not prompts:
        raise CLIError(f"--prompts-file {path}: holds no prompt")
    return prompts


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` through a hidden sibling renamed over it: a reader never sees a
    half-written file, and a failure leaves any old file as it was. The file gets the old
    one's permissions, or a new file's (mkstemp's own are 0600)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.absolute().parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        if path.exists():
            mode = path.stat().st_mode & 0o7777
        else:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _encode(tok, prompt: Prompt, chat: bool) -> list[int]:
    from lacache_jax.tokenizer import TokenizerError
    try:
        ids = tok.encode(prompt.text)  # alone first: an error's position is in the user's text
        ids = tok.encode(tok.chat_prompt(prompt.text)) if chat else ids
    except TokenizerError as e:
        raise CLIError(f"{prompt.where}: {e}") from None
    if not ids:
        raise CLIError(f"{prompt.where}: the prompt is empty (no token to condition on)")
    return ids


def _note(args, message: str) -> None:
    if not args.quiet:
        print(message, file=sys.stderr)


# --- arguments ----------------------------------------------------------------------------

class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in its help: appended by argparse, "off" for flags, or written in
    the help itself where the default is None (its meaning needs words)."""

    def _get_help_string(self, action):
        if isinstance(action.default, bool):
            return f"{action.help} (default: {'on' if action.default else 'off'})"
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lacache_jax", formatter_class=_HelpFormatter,
        description="Fast, exact-where-possible generation with diffusion LLMs (LLaDA).")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "demo", formatter_class=_HelpFormatter,
        help="random tiny LLaDA: HF layout -> convert -> load -> forward",
        description="Pipeline check on a random tiny LLaDA: export in the HF layout, "
                    "python -m convert, lj.load, lj.forward.")
    p.add_argument("--workdir", help="keep the demo files there (default: a temporary "
                                     "directory, removed at the end)")
    p.add_argument("--seed", type=int, default=0, help="random weights and prompt")
    p.set_defaults(run=cmd_demo)

    p = sub.add_parser(
        "generate", formatter_class=_HelpFormatter,
        help="generate answers to prompts with a converted checkpoint",
        description="Generate answers to prompts (one ragged batch) with a checkpoint written "
                    "by python -m convert; answers on stdout (or --out), speed on stderr.")
    _io_arguments(p.add_argument_group("input and output"))
    _decoding_arguments(p.add_argument_group("decoding"))
    _flash_arguments(p.add_argument_group(
        "Flash-dLLM (sliding-window decoding; --threshold is its acceptance epsilon)"))
    g = p.add_argument_group("model")
    g.add_argument("--fp8-ffn", action="store_true",
                   help="LaCache FP8 FFN (quantised at load unless the checkpoint stores it)")
    g.add_argument("--dtype", default=None, choices=lj_config.WEIGHT_DTYPES,
                   help="weight dtype (default: as stored)")
    p.set_defaults(run=cmd_generate)
    return parser


def _io_arguments(g) -> None:
    g.add_argument("--checkpoint", required=True,
                   help="directory written by python -m convert (required)")
    g.add_argument("--prompt", action="append",
                   help="a prompt; repeat for several (default: none; at least one of "
                        "--prompt, --prompts-file)")
    g.add_argument("--prompts-file", metavar="PATH",
                   help="one prompt per line, or .jsonl: one {\"prompt\": ...} object per line; "
                        "after any --prompt, in the same batch (default: none)")
    g.add_argument("--chat", action="store_true",
                   help="wrap each prompt in the tokenizer's chat template")
    g.add_argument("--output", choices=["text", "jsonl"], default="text",
                   help="text: the answers (under '--- i: prompt' when several); jsonl: one "
                        "object per prompt: prompt, text, gen_length, nfe, steps, "
                        "tokens_per_step")
    g.add_argument("--out", metavar="FILE",
                   help="write the output to FILE (atomically) instead of stdout "
                        "(default: stdout)")
    g.add_argument("--quiet", action="store_true",
                   help="no progress bar and no speed summary on stderr (the bar shows only "
                        "when stderr is a terminal)")
    g.add_argument("--slots", type=int, default=None,
                   help="slot refill: at most this many prompts in flight, a finished row "
                        "taking the next prompt (default: all prompts as one batch)")


def _decoding_arguments(g) -> None:
    g.add_argument("--gen-length", type=int, default=128, help="tokens generated per prompt")
    g.add_argument("--block-length", type=int, default=None,
                   help="semi-autoregressive block (default: 32; not with --flash)")
    g.add_argument("--steps", type=int, default=None,
                   help="decoding steps (default: --gen-length, one token per step; not with "
                        "--flash)")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--remasking", default="low_confidence", choices=["low_confidence", "random"],
                   help="which masked positions to reveal first")
    g.add_argument("--threshold", type=float, default=None,
                   help="Fast-dLLM threshold decoding: reveal every position at least this "
                        "confident (default: off)")
    g.add_argument("--factor", type=float, default=None,
                   help="Fast-dLLM factor decoding (default: off)")
    g.add_argument("--cache", default="none", choices=["none", "exact", "prefix", "dual"],
                   help="exact: LaCache (same tokens as none); prefix, dual: Fast-dLLM")
    g.add_argument("--refresh-interval", type=int, default=None,
                   help="dual cache: refresh every N steps too (default: once per block)")
    g.add_argument("--dpad", choices=["gaussian", "uniform"], default=None,
                   help="DPad suffix dropout (default: off)")
    d = lj_config.DPadConfig
    g.add_argument("--dpad-window", type=int, default=None,
                   help=f"DPad: suffix positions that may be kept (default: {d.window})")
    g.add_argument("--dpad-k", type=float, default=None,
                   help=f"DPad gaussian: how fast the keep probability falls with distance "
                        f"(default: {d.k})")
    g.add_argument("--dpad-scale", type=float, default=None,
                   help=f"DPad gaussian: the keep probability's scale (default: {d.scale})")
    g.add_argument("--dpad-keep", type=int, default=None,
                   help=f"DPad uniform: positions kept (default: {d.keep})")
    g.add_argument("--cfg-scale", type=float, default=0.0,
                   help="classifier-free guidance scale (0: off)")
    g.add_argument("--no-stop-at-eos", action="store_true",
                   help="decode the whole canvas even after a block holds EOS")
    g.add_argument("--logits-eos-inf", action="store_true", help="never sample EOS")
    g.add_argument("--confidence-eos-eot-inf", action="store_true",
                   help="reveal EOS / end of turn last")
    g.add_argument("--eot-id", type=int, default=None,
                   help="end-of-turn id (default: the tokenizer's <|eot_id|>)")
    g.add_argument("--seed", type=int, default=0, help="random key (temperature, DPad, random "
                                                       "remasking)")


ALL = "all"  # a Flash-dLLM budget without bound (FlashConfig's None)


def _count_or_all(text: str) -> int | str:
    """A Flash-dLLM budget: a count, or `all`."""
    if text == ALL:
        return ALL
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a count or 'all', got {text!r}") from None


def _flash_arguments(g) -> None:
    # Defaults None: given options are told apart from omitted ones (refused without
    # --flash); the defaults shown are the library's.
    f = lj_config.FlashConfig()
    shown = lambda v: ALL if v is None else v  # noqa: E731
    g.add_argument("--flash", action="store_true",
                   help="Flash-dLLM: decode from a sliding window, re-querying only the window, "
                        "a look-ahead of masks and tracked decoded positions (needs "
                        "--threshold; block, step and cache settings do not apply)")
    g.add_argument("--flash-window", type=int, default=None,
                   help=f"undecoded positions decoded from per step (default: {f.window})")
    g.add_argument("--flash-lookahead", type=_count_or_all, default=None,
                   help="masks after the window re-queried each step ('all': every one; "
                        f"default: {shown(f.lookahead)})")
    g.add_argument("--flash-track", type=_count_or_all, default=None,
                   help="decoded positions re-queried each step ('all': every one, a full "
                        f"recompute; default: {shown(f.track)})")
    g.add_argument("--flash-verify", action="store_true",
                   help="Flash-Verify: a second pass per step checks the drafts the threshold "
                        "rejected")
    g.add_argument("--flash-gamma", type=float, default=None,
                   help=f"Flash-Verify's acceptance level (default: {f.gamma})")
    g.add_argument("--flash-accept", choices=lj_config.ACCEPT_RULES, default=None,
                   help="Flash-Verify's rule: cumprod (the released code's) or agree (the "
                        f"paper's) (default: {f.accept})")


# Each has its `--flash-NAME` flag (`_flash_arguments`).
FLASH_OPTIONS = tuple(f.name for f in dataclasses.fields(lj_config.FlashConfig))
# Each has its `--dpad-NAME` flag; `--dpad STRATEGY` switches DPad on.
DPAD_OPTIONS = tuple(f.name for f in dataclasses.fields(lj_config.DPadConfig)
                     if f.name != "strategy")


def in_flags(message: str) -> str:
    """A GenerationConfig error in the command line's words, for settings that have a flag:
    `block_length=4` as `--block-length 4`, `dpad.scale` as `--dpad-scale`, and the setting
    a message starts with (`temperature must be ...`)."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {o for a in sub.choices["generate"]._actions for o in a.option_strings}

    def word(m: re.Match) -> str:
        name, eq = m[1], m[2]
        as_flag = "--" + name.replace("_", "-").replace(".", "-")
        if as_flag not in flags or not (eq or "." in name or m.start() == 0):
            return m[0]
        return as_flag + (" " if eq else "")
    return re.sub(r"(?<![-\w.])((?:flash\.|dpad\.)?[a-z][a-z_]*)(=?)", word, message)


def generation_config(args, eot_id: int | None):
    """The GenerationConfig of the generate command's flags."""
    import lacache_jax as lj
    dpad = None
    dpad_given = {n: v for n in DPAD_OPTIONS if (v := getattr(args, f"dpad_{n}")) is not None}
    if args.dpad:
        dpad = lj.DPadConfig(strategy=args.dpad, **dpad_given)
    elif dpad_given:
        raise CLIError(", ".join(f"--dpad-{n}" for n in dpad_given) + " without --dpad: add "
                       "--dpad gaussian|uniform")
    # Omitted: None, or False for --flash-verify; a 0 given (no look-ahead, no tracked
    # positions) is a value (`0 not in (None, False)` would be False: hence `is`).
    given = {n: v for n in FLASH_OPTIONS
             if (v := getattr(args, f"flash_{n}")) is not None and v is not False}
    kw = {}
    if args.flash:
        if not args.flash_verify and (alone := [n for n in ("gamma", "accept") if n in given]):
            raise CLIError(", ".join(f"--flash-{n}" for n in alone) + " without "
                           "--flash-verify: they set Flash-Verify's acceptance")
        for flag in ("block_length", "steps"):
            if getattr(args, flag) is not None:
                raise CLIError(f"--{flag.replace('_', '-')} does not apply with --flash (it "
                               "decodes from a sliding window until every position is "
                               "decoded): leave it out")
        kw["flash"] = lj.FlashConfig(**{n: None if v == ALL else v for n, v in given.items()})
    else:
        if given:
            raise CLIError(", ".join(f"--flash-{n}" for n in given) + " without --flash: add "
                           "--flash")
        kw["block_length"] = 32 if args.block_length is None else args.block_length
        kw["steps"] = args.gen_length if args.steps is None else args.steps
    return lj.GenerationConfig(
        gen_length=args.gen_length, temperature=args.temperature, remasking=args.remasking,
        threshold=args.threshold, factor=args.factor, cache=args.cache,
        refresh_interval=args.refresh_interval, dpad=dpad, fp8_ffn=args.fp8_ffn,
        stop_at_eos=not args.no_stop_at_eos, cfg_scale=args.cfg_scale,
        logits_eos_inf=args.logits_eos_inf, confidence_eos_eot_inf=args.confidence_eos_eot_inf,
        eot_id=eot_id, **kw)


def main(argv: list[str] | None = None, *, keep_handler: bool = False) -> int:
    """The command; `keep_handler` (the process entry point, `cli`) leaves the SIGINT handler,
    closed, installed after returning: restoring the default there opened a window in which a
    late Ctrl-C raised before `cli` could ignore it (exit -2, seen under CI's parallel run)."""
    args = build_parser().parse_args(argv)
    # Only generate writes its output last, so only there may a second press end the process.
    args.interrupt = Interrupt(exit_at_once=keep_handler and args.run is cmd_generate)
    if keep_handler and lacache_jax.take_early_interrupt():
        args.interrupt.pending = True  # pressed while the package imported jax
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, args.interrupt) if in_main else None
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warning
            return args.run(args)
    except ValueError as e:  # CLIError, ConfigError, CheckpointError, TokenizerError, settings
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        args.interrupt.closed = True  # from here on a press is dropped, never raised
        if previous is not None and not keep_handler:
            signal.signal(signal.SIGINT, previous)


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"warning: {message}", file=sys.stderr)


def cli() -> None:
    """`python -m lacache_jax`."""
    from lacache_jax.checkpoint import drop_late_tensorstore_errors
    drop_late_tensorstore_errors()  # an error stays one line
    rc = main(keep_handler=True)
    # Done: a late Ctrl-C (jax's atexit clean-up, the interpreter's shutdown, where a Python
    # handler is reset to the default and the signal killed the process) changes nothing.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(rc)


if __name__ == "__main__":
    cli()
