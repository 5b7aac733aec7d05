"""The demo task: multi-digit addition with a worked scratchpad, exactly checkable.

A problem is a pair (a, b) of non-negative integers with up to `MAX_DIGITS` digits. The prompt
asks for a + b; the answer works through the columns from the right, one `;`-separated step
per digit with its carry, then gives the sum after `#`:

    prompt  <|user|>407+96=<|assistant|>
    answer  7+6+0=13c1;0+9+1=10c1;4+0+1=5c0;#503

Answers vary in length with the digit count and are right-padded with EOS to the canvas, as
LLaDA's SFT data is. The held-out test split is fixed by a hash of (a, b), so no test problem
is ever drawn for training, whatever the seed. `check` reads the number after `#` only.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

MAX_DIGITS = 5
USER, ASSISTANT = "<|user|>", "<|assistant|>"
MASK, EOS = "<|mdm_mask|>", "<|endoftext|>"
SPECIALS = (EOS, MASK, USER, ASSISTANT)
CHARS = "0123456789+=;#c"


def prompt_text(a: int, b: int) -> str:
    return f"{USER}{a}+{b}={ASSISTANT}"


def answer_text(a: int, b: int) -> str:
    da, db = str(a)[::-1], str(b)[::-1]
    steps, carry = [], 0
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        total = x + y + carry
        steps.append(f"{x}+{y}+{carry}={total}c{total // 10}")
        carry = total // 10
    return ";".join(steps) + f";#{a + b}"


def is_test(a: int, b: int) -> bool:
    """One problem in ten, fixed by a hash: the held-out split."""
    return hashlib.sha256(f"{a}+{b}".encode()).digest()[0] < 26


def sample(split: str, n: int, seed: int) -> list[tuple[int, int]]:
    """`n` distinct problems of `split` ("train" or "test"), digit counts uniform in 1..5."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"{split}-{seed}")
    out: dict[tuple[int, int], None] = {}
    while len(out) < n:
        a, b = (rng.randrange(10 ** (rng.randint(1, MAX_DIGITS))) for _ in range(2))
        if is_test(a, b) == (split == "test"):
            out[(a, b)] = None
    return list(out)


def draw(split: str, n: int, rng: random.Random) -> list[tuple[int, int]]:
    """`n` problems of `split` drawn with replacement (training batches), same distribution as
    `sample`."""
    out = []
    while len(out) < n:
        a, b = (rng.randrange(10 ** (rng.randint(1, MAX_DIGITS))) for _ in range(2))
        if is_test(a, b) == (split == "test"):
            out.append((a, b))
    return out


def check(a: int, b: int, generated: str) -> bool:
    """Exact match of the final number (text after the last '#', up to EOS)."""
    tail = generated.split(EOS)[0]
    if "#" not in tail:
        return False
    value = tail.rsplit("#", 1)[1].strip()
    return value.isdigit() and int(value) == a + b


def write_tokenizer(directory: str | Path, chars: str = CHARS) -> None:
    """A character-level `tokenizer.json` (the `tokenizers` package) with LLaDA-like special
    tokens, plus `tokenizer_config.json` with a chat template built from the prompt markers.

    Other tasks pass their own `chars`; the specials keep ids 0-3 and the template stays the
    same, so every task's checkpoint speaks the same chat format."""
    from lacache_jax.tokenizer import save_char_tokenizer

    if len(set(chars)) != len(chars):
        raise ValueError(f"chars must be distinct characters, got {chars!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_char_tokenizer(directory / "tokenizer.json",
                        {tok: i for i, tok in enumerate((*SPECIALS, *chars))}, list(SPECIALS))
    template = ("{% for m in messages %}" + USER + "{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}")
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "eos_token": EOS, "mask_token": MASK}, indent=2) + "\n")


def special_ids() -> dict[str, int]:
    """Token ids of the specials in `write_tokenizer`'s vocabulary."""
    return {s: i for i, s in enumerate(SPECIALS)}
