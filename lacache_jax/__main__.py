"""Command line: python -m lacache_jax demo|generate ..."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def cmd_demo(args) -> int:
    """Build a tiny random LLaDA in the HF layout, convert it with `python -m convert`, load it
    and run a bidirectional forward pass; check it against the weights it came from."""
    import lacache_jax as lj
    from convert import export_hf

    cfg = lj.tiny(d_model=128, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=352)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="lacache_demo_"))
    work.mkdir(parents=True, exist_ok=True)
    hf_dir, ckpt_dir = work / "hf_llada", work / "checkpoint"
    params = lj.init_params(cfg, jax.random.key(args.seed), jnp.bfloat16)
    export_hf(hf_dir, cfg, params, max_shard_bytes=200_000, force=True)
    shards = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    print(f"1. random LLaDA ({cfg.n_params / 1e6:.2f}M params, {cfg.n_layers} layers, "
          f"d_model {cfg.d_model}, GQA {cfg.n_heads}/{cfg.n_kv_heads}) written in the HF layout:"
          f"\n   {hf_dir} ({len(shards)} shards + index)")

    cmd = [sys.executable, "-m", "convert", str(hf_dir), str(ckpt_dir), "--force", "--quiet"]
    print(f"2. $ python -m convert {hf_dir} {ckpt_dir}")
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        print(done.stderr, file=sys.stderr)
        return done.returncode
    print("   " + done.stdout.strip())

    config, loaded = lj.load(ckpt_dir)
    same = all(jax.tree.leaves(jax.tree.map(lambda a, b: bool((a == b).all()), loaded, params)))
    print(f"3. lj.load: config matches: {config == cfg}; weights bit-identical: {same}")

    rng = np.random.default_rng(args.seed)
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


def cmd_generate(args) -> int:
    """Load a checkpoint and its tokenizer, generate for the prompts (one ragged batch), print
    the answers and the speed."""
    import lacache_jax as lj
    from lacache_jax.tokenizer import Tokenizer

    tok = Tokenizer(args.checkpoint)
    eot_id = args.eot_id
    if args.confidence_eos_eot_inf and eot_id is None:
        eot_id = tok.token_id("<|eot_id|>")  # LLaDA's end of turn
    dpad = None
    if args.dpad:
        dpad = lj.DPadConfig(strategy=args.dpad, window=args.dpad_window, keep=args.dpad_keep)
    gen = lj.GenerationConfig(
        gen_length=args.gen_length, block_length=args.block_length, steps=args.steps or
        args.gen_length, temperature=args.temperature, remasking=args.remasking,
        threshold=args.threshold, factor=args.factor, cache=args.cache,
        refresh_interval=args.refresh_interval, dpad=dpad, fp8_ffn=args.fp8_ffn,
        stop_at_eos=not args.no_stop_at_eos, cfg_scale=args.cfg_scale,
        logits_eos_inf=args.logits_eos_inf, confidence_eos_eot_inf=args.confidence_eos_eot_inf,
        eot_id=eot_id)
    prompts = [tok.encode(tok.chat_prompt(p) if args.chat else p) for p in args.prompt]
    config, params = lj.load(args.checkpoint, dtype=args.dtype)
    if args.fp8_ffn and not lj.quant.has_fp8_ffn(params):
        print("[quantising the FFN weights to FP8 at load; `python -m convert --fp8-ffn` "
              "stores them]", file=sys.stderr)
        params = lj.quantize_ffn(params)
    t0 = time.perf_counter()
    run = lj.compile_generate(params, config, prompts, gen, key=jax.random.key(args.seed))
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = jax.block_until_ready(run())
    run_s = time.perf_counter() - t0
    for i, answer in enumerate(out.answers(gen.gen_length)):
        if len(prompts) > 1:
            print(f"--- {i}: {args.prompt[i]}")
        print(tok.decode(answer))
    n = int(out.gen_lengths.sum())
    rows = f"{len(prompts)} prompts, " if len(prompts) > 1 else ""
    print(f"\n[{rows}{n} tokens in {run_s:.2f} s = {n / run_s:.1f} tokens/s (up to the first "
          f"EOS); NFE {int(out.nfe.max())}; {float(out.tokens_per_step.mean()):.2f} tokens per "
          f"step; compile {compile_s:.1f} s; {jax.default_backend()}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lacache_jax")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="random tiny LLaDA: HF layout -> convert -> load -> forward")
    p.add_argument("--workdir", help="where to write the demo files (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=cmd_demo)

    p = sub.add_parser("generate", help="generate text from a prompt with a converted checkpoint")
    p.add_argument("--checkpoint", required=True, help="directory written by python -m convert")
    p.add_argument("--prompt", required=True, action="append",
                   help="repeat for several prompts: one ragged batch")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--gen-length", type=int, default=128)
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument("--steps", type=int, default=None, help="default: gen-length (1 per step)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--remasking", default="low_confidence", choices=["low_confidence", "random"])
    p.add_argument("--threshold", type=float, default=None, help="Fast-dLLM threshold decoding")
    p.add_argument("--factor", type=float, default=None, help="Fast-dLLM factor decoding")
    p.add_argument("--cache", default="none", choices=["none", "exact", "prefix", "dual"])
    p.add_argument("--refresh-interval", type=int, default=None)
    p.add_argument("--dpad", choices=["gaussian", "uniform"], default=None)
    p.add_argument("--dpad-window", type=int, default=256)
    p.add_argument("--dpad-keep", type=int, default=32)
    p.add_argument("--cfg-scale", type=float, default=0.0)
    p.add_argument("--no-stop-at-eos", action="store_true")
    p.add_argument("--fp8-ffn", action="store_true",
                   help="LaCache FP8 FFN (quantised at load unless the checkpoint stores it)")
    p.add_argument("--logits-eos-inf", action="store_true", help="never sample EOS")
    p.add_argument("--confidence-eos-eot-inf", action="store_true",
                   help="reveal EOS / end of turn last")
    p.add_argument("--eot-id", type=int, default=None,
                   help="end-of-turn id (default: the tokenizer's <|eot_id|>)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=cmd_generate)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ValueError as e:  # ConfigError, CheckpointError, TokenizerError, bad settings
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
