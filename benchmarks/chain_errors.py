"""Where a chain model goes wrong (issue 15): the first wrong statement of each failed answer.

    python -m benchmarks.chain_errors --checkpoint DIR [--task chain-d2] [--n 24] [--slots 64]
                                      [--mode fixed]

Decodes `--n` held-out problems in one of the accuracy table's modes (`--mode`, default the
fixed schedule: one token per step, no cache; `flash+verify` shows what the verify pass lets
through) and prints one line per problem, then the count of each kind:

  ok          the answer checks
  malformed   a statement that is not `name=[definition=]x op y=result`
  statement   a name the program does not define, or its operator wrong (a wrong order or a
              wrong choice of the next statement)
  definition  the restated definition is not the prompt's (answers restate it since the sixth
              session; older models' answers have none, and are read without it)
  copy        an operand value is not that operand's value (a lookup gone wrong)
  arith       the operands are right, the result is not
  run-on      every quantity worked out right, then more statements instead of `#` (a model
              that cannot tell its answer is complete: chain-d2ms, RESULTS.md ninth session)
  final       every statement right, the number after `#` wrong or missing

The first kind found in an answer counts; statements are checked in the answer's own order.
"""

from __future__ import annotations

import argparse
import collections
import re

import jax
import jax.numpy as jnp

import lacache_jax as lj
from benchmarks import accuracy, chain, tasks
from lacache_jax.tokenizer import Tokenizer

STATEMENT = re.compile(r"([a-z])=(?:([a-z])([-+*])([a-z]|\d+)=)?(-?\d+)([-+*])(-?\d+)=(-?\d+)")
# The "mark" form (chain.Spec.form) writes `c=b*3=8*3;c:24;`: read as `c=b*3=8*3=24;`.
MARKED = re.compile(r"([a-z])=([^;:#]*);([a-z]):(-?\d+);")


def _restate(m: re.Match) -> str:
    name, work, again, value = m.groups()
    return f"{name}={work}={value};" if again == name else m.group(0)


def classify(p: chain.Problem, text: str) -> str:
    """The kind of the first error in answer `text` (the kinds above), with the statement."""
    if chain.check(p, text):
        return "ok"
    v = chain.values(p)
    defs = dict(zip(p.names[len(p.givens):], p.ops))
    body = MARKED.sub(_restate, text.split("#")[0])
    done: set[str] = set()
    for st in body.split(";")[:-1]:
        if done == defs.keys():
            return f"run-on {st!r} after every quantity"
        m = STATEMENT.fullmatch(st)
        if not m:
            return f"malformed {st!r}"
        name, *restated, x, op, y, result = m.groups()
        if name not in defs or defs[name][1] != op:
            return f"statement {st!r}"
        left, _, right = defs[name]
        if restated[0] is not None and tuple(restated) != defs[name]:
            return f"definition {st!r} want {name}={left}{op}{right}"
        want_x, want_y = v[left], chain._operand(v, right)
        if int(x) != want_x or int(y) != want_y:
            return f"copy {st!r} want {want_x}{op}{want_y}"
        if int(result) != v[name]:
            return f"arith {st!r} want {v[name]}"
        done.add(name)
    return f"final {text[text.find('#'):][:12]!r} want {v[p.names[-1]]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True, help="a converted chain model")
    ap.add_argument("--task", default="chain-d2", choices=sorted(tasks.CHAIN_SPECS) + ["chain"])
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--mode", default="fixed", choices=list(accuracy.MODES))
    args = ap.parse_args(argv)
    t = tasks.get(args.task)
    # fp32 on the CPU: its bf16 matmuls are emulated and several times slower.
    dtype = jnp.float32 if jax.default_backend() == "cpu" else None
    cfg, params = lj.load(args.checkpoint, dtype=dtype)
    tok = Tokenizer(args.checkpoint)
    problems = t.sample("test", args.n, seed=0)
    settings = accuracy.MODES[args.mode][0]
    if settings.get("fp8_ffn"):
        params = lj.quantize_ffn(params)
    gen = accuracy.generation_config(t, settings)
    prompts = [tok.encode(t.prompt(p)) for p in problems]
    keys = jax.random.split(jax.random.key(0), len(prompts))
    out = lj.generate(params, cfg, prompts, gen, key=keys, slots=args.slots)
    kinds = collections.Counter()
    for p, answer in zip(problems, out.answers(t.gen_len)):
        line = classify(p, tok.decode(answer))
        kinds[line.split()[0]] += 1
        print(line, flush=True)
    print("kinds: " + ", ".join(f"{k} {n}" for k, n in kinds.most_common()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
