"""The chain task: multi-step arithmetic solved through a chain of intermediate results, the
harder trained yardstick that tells the decoding modes apart (issue 15). Exactly checkable.

A problem is a short program with the structure of a GSM8K word problem and none of its words:
two to four given numbers, then six to sixteen derived quantities, each one operation (+, -, *)
on earlier quantities or a small literal; the question is the last quantity. The answer works
out every derived quantity, restating its definition, then its operation with the operand
values, then the result, and gives the asked value after `#` (a shortened example):

    prompt  <|user|>a=47;b=8;c=b*3;d=a+c;e=d-19;f=e*c;f?<|assistant|>
    answer  c=b*3=8*3=24;d=a+c=47+24=71;e=d-19=71-19=52;f=e*c=52*24=1248;#1248

The "mark" form (`Spec.form`, tasks `chain-d2m` and `chain-d2ms`) writes every value right after
its name and a colon, in the prompt (`a:47;`) and in the answer (`c=b*3=8*3;c:24;`), so that
an operand's value is always one copy at a fixed offset from a `name:` pair; in the restated
form below a derived value stands at the end of its statement, after a definition and operands
of varying width, and copying it was still the first error of 47 of the 114 failures of a
`chain-d2` model at 43% (RESULTS.md, seventh session).

Restating the definition splits finding an operand's value into two lookups, each a copy: the
operand names from the prompt's definition, then each name's result from earlier in the
answer (or the prompt's givens). Without it (the format until 2026-12-01) the value had to
come from both at once; a `chain-d2` model trained so (17.5% at the fixed schedule) failed 21
of 24 held-out problems, 15 of them first at an operand value with the arithmetic right on it,
4 at the choice of statement, 2 at a result (`benchmarks/chain_errors.py`; RESULTS.md, sixth
session).

Why this task (the demo's column addition cannot separate the modes: a trained model works out
its whole scratchpad in one forward pass, so threshold 0.9 reveals a full 32-token block per
step and nearly every mode scores 100%):

- Depth. Most results need results that stand earlier in the answer itself, so a model that
  does one operation per forward pass confidently cannot reveal a block in one step: tokens
  per step is bounded by how much of the chain is settled, as in a GSM8K solution. A statement
  is 14-18 tokens (by difficulty), 2-4 of them result digits; if one takes 2-5 steps at
  threshold 0.9 (the choice of statement, the copies, a hard digit or two), threshold
  decoding reveals 3-8 tokens per step.
- Easy stretches beside hard digits. Names, '=', operators, literals and the restated operand
  values (copies of the prompt and of earlier results) are predictable once their statement is
  chosen, and the EOS padding once the answer ends: these are what parallel decoding can reveal
  several at a time. Results are mental arithmetic on up to four digits, products of two
  two-digit numbers included, which a model of ~10M parameters trained for minutes gets wrong
  now and then. Errors compound over 6-16 statements (11 on average): with a per-statement
  accuracy between 0.986 and 0.998 a problem is right 85-98% of the time, the regime of an 8B
  model on GSM8K.
- Genuine choice. Training answers work the quantities out in a random order that respects the
  dependencies (each statement picked uniformly among those whose operands are known: 2.0 on
  average, a single candidate for one statement in three), as different written solutions
  do. Where the next statement is such a choice no token reaches confidence 0.9, so threshold
  decoding slows down there; a low threshold can reveal tokens of two different orders in one
  step, the accuracy cost of aggressive parallel decoding that the demo never shows.
- Length. Answers are 64-255 tokens (problems outside are redrawn), so they fill two to eight
  32-token blocks of a 256-token canvas: DPad, the prefix and dual caches and early stopping
  all act on several blocks.

The tokenizer is the demo's (`arith.write_tokenizer`: same specials at the same ids, same chat
template) over this task's characters. The held-out split is fixed by a hash of the program,
so no test problem is ever drawn for training, whatever the seed; `check` reads the number
after the last `#` only, as GSM8K is scored. If a trained model lands above 98% at the fixed
schedule, raise `MAX_VALUE` (larger mental products); below 85%, lower it or train longer.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import NamedTuple

from benchmarks import arith

USER, ASSISTANT, MASK, EOS = arith.USER, arith.ASSISTANT, arith.MASK, arith.EOS
LETTERS = "abcdefghijklmnopqrstuvwxyz"
CHARS = "0123456789+-*=;#?" + LETTERS + ":"  # ':' last: the older tokenizers' ids stay
GIVENS = (2, 4)        # given numbers per problem (inclusive range)
STEPS = (6, 16)        # derived quantities per problem
LITERAL_P = 0.3        # chance that an operation's right operand is a literal 2..99


class Spec(NamedTuple):
    """How hard the arithmetic of one statement is: every quantity lies in [1, max_value], the
    operations are `ops`, a product's right operand is a literal 2..mul_max (None: any
    quantity or literal, as for + and -), the givens have 1..given_digits digits. `form` is
    how values are written: "restate" (`a=47;` in the prompt, `c=b*3=8*3=24;` in the answer)
    or "mark" (`a:47;`, and `c=b*3=8*3;c:24;`: every value stands right after its name and a
    ':', in the prompt and in the answer alike, so finding an operand's value is one copy at
    a fixed offset from a `name:` pair, where "restate" puts a derived value at the end of its
    statement, after a definition and operands of varying width). `steps`: the range of
    derived quantities per problem (answers outside `ANSWER_LEN` are redrawn, so short
    ranges lose their shortest problems). `asked_last`: training answers work the asked
    quantity out last (nothing depends on it, so any order of the rest still respects the
    dependencies), so that its statement says locally that the answer is complete; otherwise
    the model must check that every quantity is done before writing `#`, and a d2ms model
    that got every quantity right ran on instead (RESULTS.md, ninth session). `in_order`:
    training answers work the statements out in prompt order, one answer per problem, so the
    model copies each statement in turn instead of choosing among the ready ones and keeping
    track of which are done (the checker accepts any order either way)."""
    max_value: int
    ops: str
    mul_max: int | None
    given_digits: int
    form: str = "restate"
    steps: tuple[int, int] = STEPS
    asked_last: bool = False
    in_order: bool = False


# The difficulties tried, with the fixed-schedule accuracy of their first training runs (fp32,
# 5-6 minutes, 1,000-2,200 steps of 256: too short for any; RESULTS.md, 2026-12-01):
SPECS = {
    "d4": Spec(9999, "+-*", None, 3),  # products of two 2-digit numbers: 0%
    "d3x": Spec(999, "+-*", 9, 3),     # 3-digit sums and differences, products by one digit: 0%
    "d3": Spec(999, "+-", None, 3),    # 3-digit sums and differences only: 0%
    "d2": Spec(99, "+-*", 9, 2),       # 2-digit quantities, products by one digit: 1.7%
    # (restated, 10,982 steps on the H200: 43.0%, RESULTS.md 2026-12-02)
    # (7.5 minutes, 11,818 steps: 80.0% in bf16; its first errors: an operand value copied
    # wrong 24 of 40, a result 8, the final number 7, RESULTS.md 2026-12-02)
    "d2m": Spec(99, "+-*", 9, 2, "mark"),  # d2 with marked values
    # d2m with shorter chains: 4-9 statements (about 6.6 on average against 10.6). 8
    # minutes, 12,553 steps: 37.2%; on 24 problems (fp32, CPU) 13 of the 20 failures ran on
    # after every quantity was right, and 5 got a result wrong (RESULTS.md, ninth session).
    "d2ms": Spec(99, "+-*", 9, 2, "mark", (4, 9)),
    # The same two with the asked quantity worked out last. d2ml, 8 minutes, 12,538 steps:
    # 28.0% (loss 0.067, below d2m's 0.086); on 16 problems (fp32, CPU) malformed 3, a
    # statement not in the program 3, arith 3, run-on 2 (RESULTS.md, tenth session).
    "d2ml": Spec(99, "+-*", 9, 2, "mark", asked_last=True),
    "d2msl": Spec(99, "+-*", 9, 2, "mark", (4, 9), asked_last=True),
    # d2m in prompt order: not trained yet.
    "d2mo": Spec(99, "+-*", 9, 2, "mark", in_order=True),
}
SPEC = SPECS["d4"]  # `chain` itself: to be set to the difficulty whose model lands in range
MAX_VALUE, OPS = SPEC.max_value, SPEC.ops
ANSWER_LEN = (64, 255)  # one token per character; 255 leaves an EOS in a 256-token canvas
GEN_LEN = 256
# Longest prompt: 2 markers, 4 givens 'a=999;', 16 operations 'x=y*99;', the question 'q?'.
PROMPT_LEN = 2 + GIVENS[1] * 6 + STEPS[1] * 7 + 2


class Problem(NamedTuple):
    """Givens (named a, b, ...) and derived quantities (named after them, in prompt order),
    each (left name, op, right name or literal)."""
    givens: tuple[int, ...]
    ops: tuple[tuple[str, str, str], ...]

    @property
    def names(self) -> str:
        return LETTERS[:len(self.givens) + len(self.ops)]


def values(p: Problem) -> dict[str, int]:
    """Every quantity's value by name."""
    v = dict(zip(LETTERS, p.givens))
    for name, (left, op, right) in zip(p.names[len(p.givens):], p.ops):
        v[name] = _apply(v[left], op, _operand(v, right))
    return v


def _operand(v: dict[str, int], token: str) -> int:
    return int(token) if token.isdigit() else v[token]


def _apply(x: int, op: str, y: int) -> int:
    return x + y if op == "+" else x - y if op == "-" else x * y


def program_text(p: Problem, spec: Spec = SPEC) -> str:
    """The user message: the program and its question (in the "restate" form whatever the
    spec: the held-out split's hash, `is_test`)."""
    g, mark = len(p.givens), ":" if spec.form == "mark" else "="
    given = [f"{n}{mark}{x}" for n, x in zip(p.names, p.givens)]
    derived = [f"{n}={left}{op}{right}" for n, (left, op, right) in zip(p.names[g:], p.ops)]
    return ";".join(given + derived) + f";{p.names[-1]}?"


def prompt_text(p: Problem, spec: Spec = SPEC) -> str:
    return f"{USER}{program_text(p, spec)}{ASSISTANT}"


def solve_order(p: Problem, rng: random.Random | None = None,
                asked_last: bool = False) -> list[int]:
    """Indices into `p.ops` in the order the answer works them out: prompt order without `rng`,
    else at each statement a uniform pick among those whose operands are all known (the asked
    quantity, the last, only when nothing else is left if `asked_last`)."""
    g = len(p.givens)
    if rng is None:
        return list(range(len(p.ops)))
    index = {name: i for i, name in enumerate(p.names[g:])}
    dependents: list[list[int]] = [[] for _ in p.ops]
    unknown = [0] * len(p.ops)  # operands not worked out yet
    for i, (left, _, right) in enumerate(p.ops):
        for d in {index[t] for t in (left, right) if t in index}:
            dependents[d].append(i)
            unknown[i] += 1
    ready = [i for i, n in enumerate(unknown) if n == 0]
    order = []
    asked = len(p.ops) - 1
    while ready:
        pool = [j for j in ready if j != asked] if asked_last and len(ready) > 1 else ready
        i = pool[rng.randrange(len(pool))]
        ready.remove(i)
        order.append(i)
        for j in dependents[i]:
            unknown[j] -= 1
            if unknown[j] == 0:
                ready.append(j)
    return order


def answer_text(p: Problem, rng: random.Random | None = None, spec: Spec = SPEC) -> str:
    """The worked answer; `rng` draws the order of the statements (see `solve_order`) unless
    `spec.in_order`."""
    v, g = values(p), len(p.givens)
    steps = []
    for i in solve_order(p, None if spec.in_order else rng, spec.asked_last):
        left, op, right = p.ops[i]
        name = p.names[g + i]
        work = f"{name}={left}{op}{right}={v[left]}{op}{_operand(v, right)}"
        steps.append(f"{work};{name}:{v[name]};" if spec.form == "mark"
                     else f"{work}={v[name]};")
    return "".join(steps) + f"#{v[p.names[-1]]}"


def answer_length(p: Problem, spec: Spec = SPEC) -> int:
    """Characters (= tokens) of the answer; the same for every order."""
    return len(answer_text(p, spec=spec))


def generate(rng: random.Random, spec: Spec = SPEC) -> Problem:
    """One problem from the task's distribution (before the split)."""
    while True:
        p = _attempt(rng, spec)
        if p is not None and ANSWER_LEN[0] <= answer_length(p, spec) <= ANSWER_LEN[1]:
            return p


def _attempt(rng: random.Random, spec: Spec) -> Problem | None:
    g, k = rng.randint(*GIVENS), rng.randint(*spec.steps)
    givens = []
    for _ in range(g):
        d = rng.randint(1, spec.given_digits)
        givens.append(rng.randint(max(2, 10 ** (d - 1)), 10 ** d - 1))
    vals, ops = list(givens), []
    for i in range(g, g + k):
        for _ in range(50):
            op = rng.choice(spec.ops)
            # Half the time the latest quantity: chains as deep as a word problem's.
            li = i - 1 if rng.random() < 0.5 else rng.randrange(i)
            if op == "*" and spec.mul_max is not None:
                ri, y = None, rng.randint(2, spec.mul_max)
            elif rng.random() < LITERAL_P:
                ri, y = None, rng.randint(2, 10 ** rng.randint(1, 2) - 1)
            else:
                ri = rng.randrange(i)
                y = vals[ri]
            if op == "-" and vals[li] < y:
                if ri is None:
                    continue
                li, ri, y = ri, li, vals[li]
            if op == "*" and min(vals[li], y) < 2:
                continue
            result = _apply(vals[li], op, y)
            if 1 <= result <= spec.max_value:
                ops.append((LETTERS[li], op, str(y) if ri is None else LETTERS[ri]))
                vals.append(result)
                break
        else:
            return None
    return Problem(tuple(givens), tuple(ops))


def is_test(p: Problem) -> bool:
    """One problem in ten, fixed by a hash of the program: the held-out split."""
    return hashlib.sha256(program_text(p).encode()).digest()[0] < 26


def sample(split: str, n: int, seed: int, spec: Spec = SPEC) -> list[Problem]:
    """`n` distinct problems of `split` ("train" or "test")."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"chain-{split}-{seed}")
    out: dict[Problem, None] = {}
    while len(out) < n:
        p = generate(rng, spec)
        if is_test(p) == (split == "test"):
            out[p] = None
    return list(out)


def draw(split: str, n: int, rng: random.Random, spec: Spec = SPEC) -> list[Problem]:
    """`n` problems of `split` drawn with replacement (training batches), same distribution as
    `sample`."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    out = []
    while len(out) < n:
        p = generate(rng, spec)
        if is_test(p) == (split == "test"):
            out.append(p)
    return out


def check(p: Problem, generated: str) -> bool:
    """Exact match of the final number (text after the last '#', up to EOS)."""
    tail = generated.split(EOS)[0]
    if "#" not in tail:
        return False
    value = tail.rsplit("#", 1)[1].strip()
    return value.isdigit() and int(value) == values(p)[p.names[-1]]


def write_tokenizer(directory: str | Path) -> None:
    """The demo's tokenizer files (same specials and chat template) over this task's chars."""
    arith.write_tokenizer(directory, CHARS)


def special_ids() -> dict[str, int]:
    return arith.special_ids()
