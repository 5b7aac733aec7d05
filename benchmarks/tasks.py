"""The synthetic tasks, by name: everything training (`train_demo`) and the accuracy harness
(`accuracy`) need to know about one, behind one interface.

A problem is an opaque hashable value of its task module (`arith`: a pair (a, b); `chain`: a
`chain.Problem`). Each task fixes its canvas (prompt and answer lengths, the block length
generation uses), the model trained on it and the training defaults.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from typing import Any, Callable

import lacache_jax as lj
from benchmarks import arith, chain


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    prompt_len: int       # prompts are left-padded to this many tokens in training
    gen_len: int          # answers are right-padded with EOS to this many tokens
    block_length: int
    model: dict           # ModelConfig fields other than max_seq_len and the special ids
    batch: int            # training defaults
    lr: float
    steps: int
    dpad: lj.DPadConfig   # what the accuracy table's DPad modes run
    prompt: Callable[[Any], str]
    answer: Callable[[Any, random.Random | None], str]  # rng: the task's free choices, if any
    check: Callable[[Any, str], bool]
    sample: Callable[[str, int, int], list]             # (split, n, seed): distinct problems
    draw: Callable[[str, int, random.Random], list]     # with replacement, for batches
    write_tokenizer: Callable[[Any], None]
    special_ids: Callable[[], dict]
    mask: str = arith.MASK
    eos: str = arith.EOS
    compute: str = "fp32"  # training's forward-pass dtype (train_demo --compute)


ARITH = Task(
    name="arith",
    prompt_len=16,  # longest prompt: 2 markers + 5 + '+' + 5 + '=' = 14 tokens
    gen_len=64,     # longest answer: 5 columns of 11 chars ('9+9+1=19c1;') + '#' + 6 digits
    block_length=32,
    model=dict(d_model=256, n_layers=8, n_heads=4, n_kv_heads=4, d_ff=768, vocab_size=32,
               rope_theta=10000.0, norm_eps=1e-5),
    batch=512, lr=1e-3, steps=3000,
    # Window 32 keeps only the next block: what issue 6 measured (it drops the EOS padding
    # that tells the model where a 5-digit answer ends).
    dpad=lj.DPadConfig(window=32),
    prompt=lambda p: arith.prompt_text(*p),
    answer=lambda p, rng=None: arith.answer_text(*p),
    check=lambda p, text: arith.check(*p, text),
    sample=arith.sample, draw=arith.draw,
    write_tokenizer=arith.write_tokenizer, special_ids=arith.special_ids)

def chain_task(name: str, spec: chain.Spec) -> Task:
    return Task(
        name=name,
        prompt_len=chain.PROMPT_LEN,
        gen_len=chain.GEN_LEN,
        block_length=32,
        # 10.3M parameters, 20.5 MB in bf16: deeper than the demo (12 layers), since a layer
        # stack is what one forward pass can chain lookups and carries through; d_model and
        # d_ff stay multiples of 128 for the FP8 FFN's 128 x 128 weight blocks. All 48
        # token ids used (':' the last, for the "mark" form).
        model=dict(d_model=256, n_layers=12, n_heads=4, n_kv_heads=4, d_ff=768, vocab_size=48,
                   rope_theta=10000.0, norm_eps=1e-5),
        batch=256, lr=1e-3, steps=6000,
        dpad=lj.DPadConfig(),  # the published defaults (window 256: the whole canvas)
        prompt=functools.partial(chain.prompt_text, spec=spec),
        answer=functools.partial(chain.answer_text, spec=spec), check=chain.check,
        sample=functools.partial(chain.sample, spec=spec),
        draw=functools.partial(chain.draw, spec=spec),
        write_tokenizer=chain.write_tokenizer, special_ids=chain.special_ids,
        compute="bf16")


CHAIN = chain_task("chain", chain.SPEC)
# The difficulties tried for `chain` (train one with --task chain-d3 etc.).
CHAIN_SPECS = {f"chain-{k}": chain_task(f"chain-{k}", v) for k, v in chain.SPECS.items()}

TASKS = {t.name: t for t in (ARITH, CHAIN, *CHAIN_SPECS.values())}


def get(task: str | Task) -> Task:
    """A task by name (or the task itself)."""
    if isinstance(task, Task):
        return task
    if task not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {task!r}")
    return TASKS[task]


def model_config(task: str | Task, **overrides) -> lj.ModelConfig:
    """The task's model: its `model` fields, the canvas as context, its tokenizer's specials."""
    t = get(task)
    ids = t.special_ids()
    base = dict(**t.model, max_seq_len=t.prompt_len + t.gen_len, mask_id=ids[t.mask],
                eos_id=ids[t.eos], pad_id=ids[t.eos])
    return lj.ModelConfig(**{**base, **overrides})
