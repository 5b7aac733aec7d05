"""Accuracy, tokens per step, NFE and tokens/s of every decoding mode on held-out problems of a
synthetic task (`benchmarks/tasks.py`), with a JSON record and a plot.

    python -m benchmarks.accuracy --checkpoint DIR [--task arith|chain] [--n 500]
        [--modes fixed,threshold,...] [--no-plot]

`DIR` is a converted checkpoint of the task's model (with its tokenizer); the task defaults to
`arith`, the shipped demo. All problems run as one ragged batch per mode; accuracy comes with
its Wilson 95% interval; tokens/s counts generated tokens up to each row's first EOS over the
wall time of the compiled run (compilation excluded). Lossless modes are compared token for
token with their baseline, which runs first when `--modes` leaves it out. The JSON goes to
benchmarks/results/ (or $OUT), stamped, and the plot (accuracy against tokens/s, one point per
mode) beside it as a PNG when matplotlib is installed (a benchmark-only dependency). A run
killed by `timeout` still writes the modes it finished; `--from-json A.json B.json` merges
records of several such runs into one table and plot without running anything.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import jax
import numpy as np

import lacache_jax as lj
from benchmarks import tasks
from benchmarks.common import exit_on_sigterm, write_result
from lacache_jax.tokenizer import Tokenizer

REFRESH = 4  # "dual+refresh": a full forward on every 4th step of a block refreshes the cache
# name -> (GenerationConfig settings, lossless baseline or None); `dpad=True` stands for the
# task's DPad settings. "threshold" is 0.9, Fast-dLLM's default.
MODES = {
    "fixed": (dict(), None),
    "threshold0.5": (dict(threshold=0.5), None),
    "threshold0.7": (dict(threshold=0.7), None),
    "threshold": (dict(threshold=0.9), None),
    "factor": (dict(factor=1.0), None),
    "exact": (dict(cache="exact"), "fixed"),
    "prefix": (dict(cache="prefix"), None),
    "dual": (dict(cache="dual"), None),
    "dual+refresh": (dict(cache="dual", refresh_interval=REFRESH), None),
    "dpad": (dict(dpad=True), None),
    "fp8_ffn": (dict(fp8_ffn=True), None),
    "fp8_ffn+exact": (dict(fp8_ffn=True, cache="exact"), "fp8_ffn"),
    "threshold+exact": (dict(threshold=0.9, cache="exact"), "threshold"),
    "threshold+prefix": (dict(threshold=0.9, cache="prefix"), None),
    "threshold+dual": (dict(threshold=0.9, cache="dual"), None),
    "threshold+dual+refresh": (dict(threshold=0.9, cache="dual", refresh_interval=REFRESH),
                               None),
    "threshold0.7+dual": (dict(threshold=0.7, cache="dual"), None),
    "factor+dual": (dict(factor=1.0, cache="dual"), None),
    "threshold+dpad": (dict(threshold=0.9, dpad=True), None),
    "threshold+dpad+dual": (dict(threshold=0.9, dpad=True, cache="dual"), None),
    "threshold+fp8_ffn": (dict(threshold=0.9, fp8_ffn=True), None),
    "threshold+dual+fp8_ffn": (dict(threshold=0.9, cache="dual", fp8_ffn=True), None),
    "threshold+dpad+dual+fp8_ffn": (dict(threshold=0.9, dpad=True, cache="dual", fp8_ffn=True),
                                    None),
}
# Flash-dLLM: GenerationConfig settings like any other mode (no blocks; see generation_config).
FLASH_MODES: dict[str, tuple[dict, str | None]] = {
    "flash": (dict(threshold=0.9, flash=lj.FlashConfig()), None),
    "flash+fp8_ffn": (dict(threshold=0.9, flash=lj.FlashConfig(), fp8_ffn=True), None),
    "flash+verify": (dict(threshold=0.9, flash=lj.FlashConfig(verify=True)), None),
    "flash+verify_agree": (dict(threshold=0.9, flash=lj.FlashConfig(verify=True,
                                                                     accept="agree")), None),
}
MODES.update(FLASH_MODES)

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


def wilson(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion: unlike the normal approximation it stays
    inside [0, 1] and keeps its coverage at 0 or n successes."""
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    if not 0 <= correct <= n:
        raise ValueError(f"correct must lie in [0, n={n}], got {correct}")
    p, z2 = correct / n, z * z
    center = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    # The bounds are exactly 0 at no success and 1 at all; rounding must not move them.
    lo = 0.0 if correct == 0 else max(0.0, center - half)
    hi = 1.0 if correct == n else min(1.0, center + half)
    return lo, hi


def paired_difference(first, second, z: float = Z95) -> tuple[float, float, float]:
    """(difference, lower, upper) of accuracy `second` - `first` over the same problems, from
    per-problem correctness: Newcombe's hybrid score interval for paired proportions (his
    1998 method 10: each accuracy's Wilson interval, combined with the pairs' correlation
    phi, whose numerator both * neither - only1 * only2 he shrinks by n / 2 when positive;
    phi 0 where a margin is empty). Pairing is what narrows small differences: two modes that
    agree on most problems differ by far less than either accuracy's own interval."""
    a1, a2 = np.asarray(first, bool), np.asarray(second, bool)
    if a1.shape != a2.shape or a1.ndim != 1 or a1.size == 0:
        raise ValueError(f"need two equal, non-empty 1-D outcome lists, got shapes {a1.shape} "
                         f"and {a2.shape}")
    n = a1.size
    both, only1 = int(np.sum(a1 & a2)), int(np.sum(a1 & ~a2))
    only2, neither = int(np.sum(~a1 & a2)), int(np.sum(~a1 & ~a2))
    p1, p2 = (both + only1) / n, (both + only2) / n
    (l1, u1), (l2, u2) = wilson(both + only1, n, z), wilson(both + only2, n, z)
    denom = (both + only1) * (only2 + neither) * (both + only2) * (only1 + neither)
    agree = both * neither - only1 * only2
    if agree > 0:
        agree = max(agree - n / 2, 0.0)
    phi = agree / math.sqrt(denom) if denom else 0.0
    theta = p2 - p1
    lower = math.sqrt(max(0.0, (p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2))
    upper = math.sqrt(max(0.0, (u2 - p2) ** 2 - 2 * phi * (u2 - p2) * (p1 - l1) + (p1 - l1) ** 2))
    return theta, max(-1.0, theta - lower), min(1.0, theta + upper)


def generation_config(task: str | tasks.Task, settings: dict) -> lj.GenerationConfig:
    """The task's canvas (one token per step at the fixed schedule) with a mode's settings."""
    t = tasks.get(task)
    if settings.get("dpad") is True:
        settings = {**settings, "dpad": t.dpad}
    if settings.get("flash") is not None:  # no blocks: the window slides over the canvas
        return lj.GenerationConfig(gen_length=t.gen_len, **settings)
    return lj.GenerationConfig(gen_length=t.gen_len, block_length=t.block_length,
                               steps=t.gen_len, **settings)


def evaluate(params, cfg: lj.ModelConfig, tok: Tokenizer, problems, settings: dict,
             key=jax.random.key(0), task: str | tasks.Task = "arith",
             slots: int | None = 256, warmup: bool = False) -> dict:
    """One mode on `problems`: accuracy (Wilson 95%), `solved` (which problems, in order, as
    a "0"/"1" string for paired comparisons), tokens per step, NFE, tokens/s of one timed run
    (`warmup`: after an untimed one, which may still carry one-time costs) and the tokens."""
    t = tasks.get(task)
    gen = generation_config(t, settings)
    prompts = [tok.encode(t.prompt(p)) for p in problems]
    keys = jax.random.split(key, len(prompts))
    refill = slots or None  # slot refill (`slots` rows in flight), Flash-dLLM included
    run = lj.compile_generate(params, cfg, prompts, gen, key=keys, slots=refill)
    if warmup:
        jax.block_until_ready(run())
    t0 = time.perf_counter()
    out = jax.block_until_ready(run())
    seconds = time.perf_counter() - t0
    answers = out.answers(t.gen_len)
    solved = [bool(t.check(p, tok.decode(ans))) for p, ans in zip(problems, answers)]
    correct = sum(solved)
    return {"accuracy": correct / len(problems), "ci95": list(wilson(correct, len(problems))),
            "correct": correct, "n": len(problems),
            "solved": "".join("1" if ok else "0" for ok in solved),
            "tokens_per_step": float(np.mean(np.asarray(out.tokens_per_step))),
            "nfe": float(np.mean(np.asarray(out.nfe))),
            "tokens_per_s": float(np.sum(np.asarray(out.gen_lengths)) / seconds),
            "seconds": seconds, "tokens": np.asarray(out.tokens)}


def compare(r: dict, base: dict, baseline: str) -> None:
    """Token identity of a lossless mode against its baseline, whole canvas per row."""
    same = (r["tokens"] == base["tokens"]).all(axis=-1)
    r["identical_to_" + baseline] = bool(same.all())
    r["identical_rows"] = float(same.mean())


def with_baselines(names: list[str]) -> list[str]:
    """`names` in order, each lossless mode's baseline inserted before it when missing."""
    out: list[str] = []
    for name in names:
        if name not in MODES:
            raise ValueError(f"--modes: unknown mode {name!r}; known: {', '.join(MODES)}")
        baseline = MODES[name][1]
        if baseline is not None and baseline not in out:
            out.append(baseline)
        if name not in out:
            out.append(name)
    return out


def table(rows: dict) -> str:
    """The rows as a markdown table, as RESULTS.md shows them."""
    lines = ["| mode | accuracy (95% CI) | tokens / step | NFE | tokens/s | lossless check |",
             "|---|---|---|---|---|---|"]
    baselines = {MODES[name][1] for name in rows}
    for name, r in rows.items():
        lo, hi = r["ci95"]
        baseline = MODES[name][1]
        check = ("baseline" if name in baselines else "") if baseline is None else (
            f"identical to {baseline}" if r.get("identical_to_" + baseline)
            else f"{100 * r.get('identical_rows', 0.0):.1f}% of rows identical to {baseline}")
        lines.append(f"| {name} | {100 * r['accuracy']:.1f}% ({100 * lo:.1f}-{100 * hi:.1f}) "
                     f"| {r['tokens_per_step']:.2f} | {r['nfe']:.1f} | {r['tokens_per_s']:,.0f} "
                     f"| {check} |")
    return "\n".join(lines)


def plot(rows: dict, path: Path, title: str) -> Path | None:
    """Accuracy (with its 95% interval) against tokens/s, one point per mode: colour = cache,
    marker = decoding rule. None, with a message, when matplotlib is absent."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    colors = {"none": "tab:blue", "exact": "tab:green", "prefix": "tab:orange",
              "dual": "tab:red"}
    markers = {"fixed": "o", "threshold": "s", "factor": "^"}
    fig, ax = plt.subplots(figsize=(10, 6.5))
    for i, (name, r) in enumerate(rows.items()):
        settings = MODES[name][0]
        rule = ("threshold" if "threshold" in settings else
                "factor" if "factor" in settings else "fixed")
        acc, (lo, hi) = 100 * r["accuracy"], r["ci95"]
        ax.errorbar(r["tokens_per_s"], acc, yerr=[[acc - 100 * lo], [100 * hi - acc]],
                    fmt=markers[rule], color=colors[settings.get("cache", "none")],
                    mfc="none" if settings.get("fp8_ffn") else None, capsize=3)
        ax.annotate(name, (r["tokens_per_s"], acc), textcoords="offset points",
                    xytext=(5, (3, -10, 16)[i % 3]), fontsize=7)  # staggered: ties overlap
    ax.set_xscale("log")
    ax.set_xlabel("tokens/s (generated tokens up to EOS, compiled run)")
    ax.set_ylabel("accuracy, % (bars: Wilson 95% interval)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    handles = [Line2D([], [], color=c, marker="o", ls="", label=f"cache {k}")
               for k, c in colors.items()]
    handles += [Line2D([], [], color="gray", marker=m, ls="", label=k)
                for k, m in markers.items()]
    handles.append(Line2D([], [], color="gray", marker="o", mfc="none", ls="",
                          label="FP8 FFN (hollow)"))
    ax.legend(handles=handles, fontsize=8, loc="best")
    fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)
    return path


def redraw(files: list[str], draw: bool = True) -> int:
    """Merge saved records (a later file wins for a mode it repeats) into one table and plot:
    modes measured over several time-boxed runs end up on one picture."""
    records = [json.loads(Path(f).read_text()) for f in files]
    names = {r.get("task", "arith") for r in records}
    if len(names) != 1:
        raise ValueError(f"--from-json: records of different tasks {sorted(names)}")
    merged: dict[str, dict] = {}
    for record in records:
        for name, row in record["modes"].items():
            if "ci95" not in row:  # records before issue 15 kept n in the payload only
                n = record["n"]
                row = {**row, "n": n, "ci95": list(wilson(round(row["accuracy"] * n), n))}
            merged[name] = row
    unknown = sorted(set(merged) - set(MODES))
    if unknown:
        print(f"modes no longer in the table, left out: {', '.join(unknown)}")
    rows = {name: merged[name] for name in MODES if name in merged}
    print(table(rows))
    if draw:
        first = Path(files[0])
        png = first.with_suffix(".png") if len(files) == 1 else first.with_name(
            first.stem + "-merged.png")
        title = (f"{names.pop()}: {records[0]['n']} held-out problems, {records[0]['device']} "
                 f"({', '.join(Path(f).stem for f in files)})")
        if plot(rows, png, title) is not None:
            print(f"-> {png}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint")
    ap.add_argument("--task", default="arith", choices=sorted(tasks.TASKS))
    ap.add_argument("--n", type=int, default=500, help="held-out problems")
    ap.add_argument("--slots", type=int, default=256,
                    help="rows in flight (slot refill); 0: all problems as one ragged batch")
    ap.add_argument("--seed", type=int, default=0, help="which held-out problems")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated; default: all")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--from-json", nargs="+", metavar="JSON",
                    help="run nothing: merge these saved records into one table and plot")
    args = ap.parse_args(argv)
    if args.from_json:
        return redraw(args.from_json, draw=not args.no_plot)
    if args.checkpoint is None:
        ap.error("--checkpoint is required (unless --from-json)")
    if args.n < 1:
        ap.error(f"--n must be positive, got {args.n}")
    try:
        names = with_baselines([m for m in args.modes.split(",") if m])
    except ValueError as e:
        ap.error(str(e))
    task = tasks.get(args.task)
    cfg, params = lj.load(args.checkpoint)
    if any(MODES[m][0].get("fp8_ffn") for m in names):
        # FP8 copies of the FFN weights; modes without fp8_ffn leave them unused.
        params = lj.quantize_ffn(params)
    tok = Tokenizer(args.checkpoint)
    problems = task.sample("test", args.n, seed=args.seed)
    results: dict[str, dict] = {}
    exit_on_sigterm()
    try:
        for name in names:
            settings, baseline = MODES[name]
            r = evaluate(params, cfg, tok, problems, settings, task=task,
                         slots=args.slots or None)
            if baseline is not None:
                compare(r, results[baseline], baseline)
            results[name] = r
            lo, hi = r["ci95"]
            same = ("" if baseline is None else
                    f"  identical to {baseline}: {100 * r['identical_rows']:.1f}% of rows")
            print(f"{name:28s} acc {r['accuracy']:.3f} ({lo:.3f}-{hi:.3f})  "
                  f"tokens/step {r['tokens_per_step']:.2f}  NFE {r['nfe']:.1f}  "
                  f"{r['tokens_per_s']:.0f} tok/s{same}", flush=True)
    finally:
        rows = {k: {"settings": repr(generation_config(task, MODES[k][0])),
                    **{kk: vv for kk, vv in v.items() if kk != "tokens"}}
                for k, v in results.items()}
        if rows:
            path = write_result("accuracy" if task.name == "arith" else f"accuracy_{task.name}",
                                {"task": task.name, "n": args.n, "seed": args.seed,
                                 "checkpoint": args.checkpoint, "n_params": cfg.n_params,
                                 "modes": rows})
            print(f"-> {path}")
            redraw([str(path)], draw=not args.no_plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
