"""Slot refill: any number N of prompts through S rows in flight (`generate(..., slots=S)`).

Design: a host scheduler around one jitted per-block program over S slots.

Why per block. Every cache policy's first forward of a block rebuilds its whole cache (none,
exact, prefix and dual all run a full forward there), so no cache outlives a block. Between
blocks a row is only its canvas row, its counters, its block index and its key. The program
(`_slot_block`) takes those for S rows, runs one block of each (its first forward and later
steps, with the policies, reveal rules and step strategies of `generate`: `sar.run_block` with
one block index per row) and returns them. Rows in flight sit at different blocks, so each
row's block starts at its own column `s_b = P + k_b * block_length`; the canvas cut and write,
RoPE tables, DPad's kept suffix, the EOS fill, the fixed schedule's quota and the keys
(`fold_in(key_b, k_b)`) all follow the row. A row therefore computes what it computes in
`generate`, alone or in any batch (fp32: the same tokens; tests/test_slots.py).

Between blocks the host (`run`) ends the rows that stopped at EOS (`stop_at_eos`) or decoded
their last block, keeps their outputs (returned in input order) and gives each freed slot the
next prompt. That costs one host round trip per block, small next to a block's steps (32
forward passes with LLaDA's defaults); a device-resident queue would avoid it but puts every
prompt on the device and compiles per N, and a Flash-dLLM block table (REFERENCE.md §8) needs
paged caches and ragged kernels under every policy.

Buckets. The canvas's prompt width P is a bucket of prompt lengths: the next power of two
(at least `MIN_BUCKET`), at most `max_seq_len - gen_length`. One program is compiled per
(ModelConfig, GenerationConfig, S, P), not per request (S = min(slots, number of prompts): a
call with fewer prompts than slots computes no empty rows). Prompts are admitted longest
first, so the bucket of the rows in flight only shrinks and each program runs over one
contiguous span.
When it shrinks, rows in flight are re-padded: only their left padding changes, which never
shows (padded keys are masked, positions count from each row's first token).

Memory. The cache lives inside the per-block program: XLA's buffers of that program, the size
of the static batch's cache for S rows, allocated once per program and reused by every call.
Per-row block writes into a cache are one scatter (`Canvas.put`). XLA's CPU memory analysis
at LLaDA-8B shapes (S = 32, prompt 512, gen 256, dual cache) gives the static program 63.9 GiB
and this one 69.2 GiB: its buffer assignment gives these scatters copies. With one in-place
dynamic_update_slice per row instead both are 63.9 GiB, at the price of a kernel per row and
layer on a GPU; `python -m benchmarks.serve memory` measures what the GPU compiler does.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from lacache_jax import sar
from lacache_jax.config import GenerationConfig, ModelConfig
from lacache_jax.model import Params

MIN_BUCKET = 8


def bucket(n: int, cap: int) -> int:
    """Prompt width P of the canvas holding an n-token prompt: the next power of two >= n (at
    least MIN_BUCKET), at most `cap` (max_seq_len - gen_length, which n never exceeds)."""
    return min(max(MIN_BUCKET, 1 << (n - 1).bit_length()), cap)


@functools.partial(jax.jit, static_argnames=("cfg", "gen", "impl"))
def _slot_block(params: Params, cfg: ModelConfig, gen: GenerationConfig, impl: str, x_BT, pad_B,
                block_B, done_B, nfe_B, steps_B, revealed_B, keydata_B):
    """One block of every slot (batch row) not `done_B`, each at its own block `block_B`;
    returns the new (generated columns [B, gen_length], done, block, nfe, steps, revealed).
    Done rows change nothing."""
    keys_B = jax.random.wrap_key_data(keydata_B, impl=impl)
    loop = sar.make_loop(params, cfg, gen, pad_B, x_BT.shape[1])
    # No cache comes in: the block's first forward builds it (see the module docstring).
    st = sar.LoopState(x_BT, done_B, nfe_B, steps_B, revealed_B, block_B, None)
    st = sar.run_block(loop, keys_B, None, st)
    return (st.x_BT[:, -gen.gen_length:], st.done_B, jnp.where(done_B, block_B, st.block),
            st.nfe_B, st.steps_B, st.revealed_B)


@dataclasses.dataclass
class Outputs:
    """Per-prompt results in input order, filled as rows finish."""
    generated: np.ndarray  # [prompts, gen_length] each prompt's generated columns
    nfe: np.ndarray        # [prompts]
    steps: np.ndarray      # [prompts]
    revealed: np.ndarray   # [prompts]


class Scheduler:
    """Host state of the slots (the per-block program's batch rows B): the prompt each holds,
    its generated columns, block index, EOS stop and counters."""

    def __init__(self, cfg: ModelConfig, gen: GenerationConfig, prompts: list[np.ndarray],
                 B: int):
        self.cfg, self.gen, self.prompts = cfg, gen, prompts
        n, gl = len(prompts), gen.gen_length
        self.prompt_B = np.full(B, -1)                      # prompt index, -1: free slot
        self.generated_B = np.full((B, gl), gen.mask_id, np.int32)  # [B, gen_length]
        self.block_B = np.zeros(B, np.int32)
        self.done_B = np.zeros(B, bool)
        self.counts_3B = np.zeros((3, B), np.int32)         # nfe, steps, revealed
        self.out = Outputs(np.zeros((n, gl), np.int32), *np.zeros((3, n), np.int32))
        self.prompt_BP = np.zeros((B, 0), np.int32)         # left-padded prompts at width P
        self.pad_B = np.zeros(B, np.int32)
        self.admitted: list[int] = []                       # slots whose prompt area is stale

    def admit(self, slot: int, i: int) -> None:
        self.prompt_B[slot] = i
        self.generated_B[slot] = self.gen.mask_id
        self.block_B[slot], self.done_B[slot], self.counts_3B[:, slot] = 0, False, 0
        self.admitted.append(slot)

    def canvas(self, P: int):
        """Canvas [B, P + gen_length] and left padding [B]. Prompt areas are rewritten only
        for new prompts or a new width; a free slot keeps its last row or, after a width
        change, one pad token (it is done, so it never acts)."""
        if self.prompt_BP.shape[1] != P:
            self.prompt_BP = np.full((len(self.prompt_B), P), self.cfg.pad_id, np.int32)
            self.pad_B[:] = P - 1
            self.admitted = list(np.flatnonzero(self.prompt_B >= 0))
        for slot in self.admitted:
            r = self.prompts[self.prompt_B[slot]]
            self.pad_B[slot] = P - len(r)
            self.prompt_BP[slot, :P - len(r)] = self.cfg.pad_id
            self.prompt_BP[slot, P - len(r):] = r
        self.admitted = []
        return np.concatenate([self.prompt_BP, self.generated_B], axis=1), self.pad_B.copy()

    def finish(self, limit_B: np.ndarray) -> int:
        """End the rows that stopped at EOS or reached their last block (`limit_B`), keep
        their outputs and free their slots; returns how many ended."""
        ended = np.flatnonzero((self.prompt_B >= 0) & (self.done_B | (self.block_B >= limit_B)))
        for slot in ended:
            i = self.prompt_B[slot]
            self.out.generated[i] = self.generated_B[slot]
            self.out.nfe[i], self.out.steps[i], self.out.revealed[i] = self.counts_3B[:, slot]
            self.prompt_B[slot] = -1
        return len(ended)


def run(params: Params, cfg: ModelConfig, gen: GenerationConfig, prompts: list[np.ndarray],
        keys: jax.Array, slots: int, *, refill: bool = True, programs: dict | None = None,
        progress: Callable[[int, int], None] | None = None,
        block_limits: np.ndarray | None = None) -> Outputs:
    """Generate for every prompt (validated token arrays; `keys` one per prompt) with at most
    `slots` rows in flight.

    `refill=False` admits prompts only when every slot is free, in input order: static batches
    of `slots` through the same program (a baseline for benchmarks). `programs` maps a bucket
    to a compiled `_slot_block` (compile_programs). `progress(rows_done, len(prompts))` is
    called on the host whenever rows finish. `block_limits` (one per prompt; benchmarks only,
    e.g. from a drawn answer length) ends row i after that many blocks, as if it had stopped
    at EOS there. With `gen.flash` the Flash-dLLM scheduler runs instead (flash_slots.py; no
    `block_limits`: its rows have no blocks).
    """
    if gen.flash is not None:
        if block_limits is not None:
            raise ValueError("block_limits applies to block decoding, not to gen.flash")
        from lacache_jax import flash_slots
        return flash_slots.run(params, cfg, gen, prompts, keys, slots, refill=refill,
                               programs=programs, progress=progress)
    n, nb = len(prompts), gen.num_blocks
    B = min(int(slots), n)
    cap = cfg.max_seq_len - gen.gen_length
    impl = jax.random.key_impl(keys)
    keydata = np.asarray(jax.random.key_data(keys))
    limits = np.full(n, nb) if block_limits is None else np.minimum(block_limits, nb)
    order = sorted(range(n), key=lambda i: -len(prompts[i])) if refill else range(n)
    queue = collections.deque(order)
    sch = Scheduler(cfg, gen, prompts, B)
    finished = 0
    while True:
        if refill or (sch.prompt_B < 0).all():
            for slot in np.flatnonzero(sch.prompt_B < 0)[:len(queue)]:
                sch.admit(slot, queue.popleft())
        live_B = sch.prompt_B >= 0
        if not live_B.any():
            return sch.out
        P = bucket(max(len(prompts[i]) for i in sch.prompt_B[live_B]), cap)
        x, pad = sch.canvas(P)
        prompt_B = np.where(live_B, sch.prompt_B, 0)
        args = (x, pad, sch.block_B, sch.done_B | ~live_B, *sch.counts_3B, keydata[prompt_B])
        if programs is not None and P in programs:
            out = programs[P](params, *args)
        else:
            out = _slot_block(params, cfg, gen, impl, *args)
        generated, done, block, *counts = jax.device_get(out)
        sch.generated_B, sch.block_B = np.array(generated), np.array(block)
        sch.done_B, sch.counts_3B = np.array(done), np.array(counts)
        ended = sch.finish(np.where(live_B, limits[prompt_B], nb))
        if ended and progress is not None:
            finished += ended
            progress(finished, n)


def compile_programs(params: Params, cfg: ModelConfig, gen: GenerationConfig,
                     prompts: list[np.ndarray], keys: jax.Array, slots: int) -> dict:
    """The per-block program of every bucket these prompts can use, compiled ahead of time
    (with `gen.flash`, flash_slots.compile_programs: a `Programs` per bucket)."""
    if gen.flash is not None:
        from lacache_jax import flash_slots
        return flash_slots.compile_programs(params, cfg, gen, prompts, keys, slots)
    B = min(int(slots), len(prompts))
    cap = cfg.max_seq_len - gen.gen_length
    impl = jax.random.key_impl(keys)
    keydata_B = np.asarray(jax.random.key_data(keys))[:1].repeat(B, 0)
    zeros_B = np.zeros(B, np.int32)
    programs = {}
    for P in sorted({bucket(len(r), cap) for r in prompts}, reverse=True):
        args = (np.zeros((B, P + gen.gen_length), np.int32), zeros_B, zeros_B,
                np.zeros(B, bool), zeros_B, zeros_B, zeros_B, keydata_B)
        programs[P] = _slot_block.lower(params, cfg, gen, impl, *args).compile()
    return programs
