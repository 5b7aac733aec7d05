"""Slot refill for Flash-dLLM decoding (`generate(..., gen=GenerationConfig(flash=...),
slots=B)`): any number N of prompts through B rows in flight, a finished row's slot taking the
next prompt, as the released code does (REFERENCE.md §8).

Design: a host scheduler around three jitted programs over the B-slot state (flash.FlashState,
its K/V cache included), each compiled once per (ModelConfig, GenerationConfig, B, P):

- `_admit`: a new prompt's prefill (flash's step 1: every column a query) as a batch of one
  row, whose whole state row (canvas, decoded order, counters, every layer's cache row) is
  written into its slot of the B-slot state, in place (donated).
- `_until_finish`: later steps of all B slots in one `lax.while_loop`, until a row finishes
  while prompts wait (or every row is done): no host round trip per step, and a freed slot
  waits no step for its next prompt.
- `_narrow`: the prompt width shrinks to the next bucket (below) with rows in flight.

Why not slots.py's program: a Flash-dLLM row has no blocks and its cache lives
from its prefill to its end, so the unit that a refill must follow is the row's whole state,
kept on the device between calls. Why the prefill apart: a prefill queries every column
(P + gen_length rows), a later step W + A + Tr (flash.Budget); inside the B-slot step every
row would pay for one row's prefill. A batch-one prefill at LLaDA-8B shapes (>= 384 rows of
an 8B model) is already compute-bound on the GPU, so admitting one prompt per call costs no
batching; what it costs is one dispatch per prompt. Why stop at a finish: the host must see
the freed slot to refill it; the alternative, a device-resident queue of every prompt inside
the loop, puts all N prompts on the device and compiles per N.

Each row computes what it computes alone: its prefill is its own, its steps use its own key
folded with its own step count (flash.accept), positions count from its first real token and
padding keys are masked, so the slot, the other rows and the padding never show (fp32: the
same tokens, NFE and steps as `generate` of the prompt alone; tests/test_flash_slots.py).

Buckets (slots.bucket): the canvas is [B, P + gen_length] with P the next power of two of the
longest prompt in flight. Prompts are admitted longest first, so P only shrinks; when it does,
every column-indexed leaf of the state drops its first P - P' columns (all padding: every
row in flight fits in P'), cache included (flash.drop_columns). `refill=False` (static
batches, a benchmark baseline) admits only into an empty state, which is rebuilt at the new
width when it changes.

Memory: the B-slot state, the K/V cache of B rows at width P + gen_length, is allocated once
per bucket and updated in place by every call (donated); besides it, the admission holds one
row's prefill state (its cache row, 1/B of the slots' cache) and the narrowing a copy of the
state at the smaller width (once per bucket change).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from lacache_jax import flash
from lacache_jax.cache import Ctx
from lacache_jax.config import GenerationConfig, ModelConfig
from lacache_jax.model import Params
from lacache_jax.slots import Outputs, bucket


def _ctx_budget(params, cfg, gen, pad_B, T):
    return Ctx.build(params, cfg, gen, pad_B, T), flash.Budget.build(gen.flash, gen.gen_length, T)


@functools.partial(jax.jit, static_argnames=("cfg", "gen"))
def _empty(params: Params, cfg: ModelConfig, gen: GenerationConfig, x_BT, pad_B):
    """A B-slot state whose rows are all done (free slots never act)."""
    ctx, budget = _ctx_budget(params, cfg, gen, pad_B, x_BT.shape[1])
    st = flash.init_state(ctx, x_BT, not budget.full)
    return dataclasses.replace(st, done_B=jnp.ones_like(st.done_B))


@functools.partial(jax.jit, static_argnames=("cfg", "gen", "impl"), donate_argnums=(4,))
def _admit(params: Params, cfg: ModelConfig, gen: GenerationConfig, impl: str,
           st: flash.FlashState, slot, x_1T, pad_1, keydata_1):
    """The prefill of one prompt (canvas row x_1T), written into row `slot` of the state."""
    ctx, budget = _ctx_budget(params, cfg, gen, pad_1, x_1T.shape[1])
    keys = jax.random.wrap_key_data(keydata_1, impl=impl)
    new = flash.step(ctx, gen, budget, flash.init_state(ctx, x_1T, not budget.full), keys,
                     prefill=True)
    return jax.tree.map(lambda a, n: jax.lax.dynamic_update_slice_in_dim(a, n, slot, 0),
                        st, new)


@functools.partial(jax.jit, static_argnames=("cfg", "gen", "impl"), donate_argnums=(4,))
def _until_finish(params: Params, cfg: ModelConfig, gen: GenerationConfig, impl: str,
                  st: flash.FlashState, pad_B, keydata_B, limit_B, stop_at_finish):
    """Later steps of every slot until all are done, or (`stop_at_finish`) until a row that
    was running at the call finishes. A row also ends after `limit_B` steps: gen_length,
    where `generate`'s loop bound ends it (unreachable: every step of a running row accepts),
    or a benchmark's stop rule (run's `step_limits`)."""
    ctx, budget = _ctx_budget(params, cfg, gen, pad_B, st.x_BT.shape[1])
    keys = jax.random.wrap_key_data(keydata_B, impl=impl)
    st = dataclasses.replace(st, done_B=st.done_B | (st.steps_B >= limit_B))
    running_B = ~st.done_B

    def cond(st):
        finished = (running_B & st.done_B).any() & stop_at_finish
        return ~st.done_B.all() & ~finished

    def body(st):
        st = flash.step(ctx, gen, budget, st, keys, prefill=False)
        return dataclasses.replace(st, done_B=st.done_B | (st.steps_B >= limit_B))
    return jax.lax.while_loop(cond, body, st)


@functools.partial(jax.jit, static_argnames=("d",))
def _narrow(st: flash.FlashState, d: int):
    """The state at a prompt width d columns smaller (flash.drop_columns)."""
    return flash.drop_columns(st, d)


@dataclasses.dataclass
class Programs:
    """The compiled programs of one bucket (compile_programs); `chunk` is the main one (its
    HLO is what benchmarks read), `narrow` maps a wider bucket to the program that narrows
    from it."""
    empty: Callable
    admit: Callable
    chunk: Callable
    narrow: dict[int, Callable]


def _shapes(cfg, gen, B, P, keydata_B):
    """Example arguments of the programs at B slots and prompt width P."""
    T = P + gen.gen_length
    zeros = np.zeros(B, np.int32)
    return (np.full((B, T), gen.mask_id, np.int32), zeros + P - 1,
            np.zeros((1, T), np.int32), zeros[:1], keydata_B[:1], zeros)


def compile_programs(params: Params, cfg: ModelConfig, gen: GenerationConfig,
                     prompts: list[np.ndarray], keys: jax.Array, slots: int) -> dict:
    """Every program these prompts can use, compiled ahead of time: per bucket P the empty
    state, the admission and the until-finish programs, and the narrowing from each wider
    bucket in use."""
    B = min(int(slots), len(prompts))
    impl = jax.random.key_impl(keys)
    keydata_B = np.asarray(jax.random.key_data(keys))[:1].repeat(B, 0)
    cap = cfg.max_seq_len - gen.gen_length
    widths = sorted({bucket(len(r), cap) for r in prompts}, reverse=True)
    programs = {}
    for n, P in enumerate(widths):
        x, pad, x1, pad1, key1, limit = _shapes(cfg, gen, B, P, keydata_B)
        st = _empty.eval_shape(params, cfg, gen, x, pad)
        programs[P] = Programs(
            _empty.lower(params, cfg, gen, x, pad).compile(),
            _admit.lower(params, cfg, gen, impl, st, np.int32(0), x1, pad1, key1).compile(),
            _until_finish.lower(params, cfg, gen, impl, st, pad, keydata_B, limit,
                                np.bool_(True)).compile(), {})
        for wide in widths[:n]:
            wide_st = _empty.eval_shape(params, cfg, gen, *_shapes(cfg, gen, B, wide,
                                                                   keydata_B)[:2])
            programs[P].narrow[wide] = _narrow.lower(wide_st, wide - P).compile()
    return programs


class Slots:
    """Host view of the B slots: the prompt each holds (-1: free), its left padding and key,
    and the device state they live in."""

    def __init__(self, params, cfg, gen, impl, programs, B: int, keydata_row):
        self.params, self.cfg, self.gen, self.impl = params, cfg, gen, impl
        self.programs = programs or {}
        self.prompt_B = np.full(B, -1)
        self.pad_B = np.zeros(B, np.int32)
        self.keydata_B = np.zeros((B, *keydata_row.shape), keydata_row.dtype)
        self.limit_B = np.full(B, gen.gen_length, np.int32)
        self.P: int | None = None
        self.st: flash.FlashState | None = None

    def _program(self, name: str, P: int):
        prog = self.programs.get(P)
        return None if prog is None else getattr(prog, name)

    def width(self, P: int) -> None:
        """Set the prompt width: a fresh state when no row is in flight, else narrowed."""
        if P == self.P:
            return
        live = self.prompt_B >= 0
        if self.st is None or not live.any():
            self.pad_B[:] = P - 1  # free slots: one pad token, so no row attends to nothing
            x = np.full((len(self.pad_B), P + self.gen.gen_length), self.gen.mask_id, np.int32)
            args = (x, self.pad_B.copy())
            empty = self._program("empty", P)
            st = empty(self.params, *args) if empty is not None else _empty(
                self.params, self.cfg, self.gen, *args)
            # Placed (committed) like the programs' outputs, so that the first call on it and
            # the later ones share one compilation.
            self.st = jax.device_put(st, jax.tree.leaves(self.params)[0].sharding)
        else:
            if P > self.P:
                raise AssertionError("the prompt width grew with rows in flight")
            d = self.P - P
            narrow = self.programs[P].narrow.get(self.P) if P in self.programs else None
            self.st = narrow(self.st) if narrow is not None else _narrow(self.st, d)
            self.pad_B = np.where(live, self.pad_B - d, P - 1).astype(np.int32)
        self.P = P

    def admit(self, slot: int, i: int, prompt: np.ndarray, keydata_row, limit: int) -> None:
        P, gl = self.P, self.gen.gen_length
        x = np.full((1, P + gl), self.gen.mask_id, np.int32)
        x[0, :P - len(prompt)] = self.cfg.pad_id
        x[0, P - len(prompt):P] = prompt
        pad = np.array([P - len(prompt)], np.int32)
        self.prompt_B[slot], self.pad_B[slot], self.keydata_B[slot] = i, pad[0], keydata_row
        self.limit_B[slot] = limit
        args = (self.st, np.int32(slot), x, pad, keydata_row[None])
        admit = self._program("admit", P)
        self.st = admit(self.params, *args) if admit is not None else _admit(
            self.params, self.cfg, self.gen, self.impl, *args)

    def step_until_finish(self, stop: bool) -> None:
        args = (self.st, self.pad_B.copy(), self.keydata_B.copy(), self.limit_B.copy(),
                np.bool_(stop))
        chunk = self._program("chunk", self.P)
        self.st = chunk(self.params, *args) if chunk is not None else _until_finish(
            self.params, self.cfg, self.gen, self.impl, *args)


def run(params: Params, cfg: ModelConfig, gen: GenerationConfig, prompts: list[np.ndarray],
        keys: jax.Array, slots: int, *, refill: bool = True, programs: dict | None = None,
        progress: Callable[[int, int], None] | None = None,
        step_limits: np.ndarray | None = None) -> Outputs:
    """Flash-dLLM generation for every prompt (validated token arrays; `keys` one per
    prompt) with at most `slots` rows in flight; arguments as slots.run. `step_limits` (one
    per prompt; benchmarks only, e.g. from a drawn answer length) ends row i after that many
    steps, as if it had finished there."""
    n, gl = len(prompts), gen.gen_length
    limits = np.full(n, gl) if step_limits is None else np.minimum(step_limits, gl)
    B = min(int(slots), n)
    cap = cfg.max_seq_len - gl
    keydata = np.asarray(jax.random.key_data(keys))
    order = sorted(range(n), key=lambda i: -len(prompts[i])) if refill else range(n)
    queue = collections.deque(order)
    sl = Slots(params, cfg, gen, jax.random.key_impl(keys), programs, B, keydata[0])
    out = Outputs(np.zeros((n, gl), np.int32), *np.zeros((3, n), np.int32))
    finished = 0
    while True:
        free = np.flatnonzero(sl.prompt_B < 0)
        if refill or len(free) == len(sl.prompt_B):
            new = [(int(slot), queue.popleft()) for slot in free[:len(queue)]]
            lengths = [len(prompts[i]) for i in sl.prompt_B[sl.prompt_B >= 0]]
            lengths += [len(prompts[i]) for _, i in new]
            if lengths:
                sl.width(bucket(max(lengths), cap))
            for slot, i in new:
                sl.admit(slot, i, prompts[i], keydata[i], limits[i])
        live = sl.prompt_B >= 0
        if not live.any():
            return out
        sl.step_until_finish(stop=refill and bool(queue))
        x, done, nfe, steps, revealed = jax.device_get(
            (sl.st.x_BT, sl.st.done_B, sl.st.nfe_B, sl.st.steps_B, sl.st.revealed_B))
        ended = np.flatnonzero(live & np.asarray(done))
        for slot in ended:
            i = sl.prompt_B[slot]
            out.generated[i] = x[slot, sl.P:]
            out.nfe[i], out.steps[i], out.revealed[i] = nfe[slot], steps[slot], revealed[slot]
            sl.prompt_B[slot] = -1
        if len(ended) and progress is not None:
            finished += len(ended)
            progress(finished, n)
