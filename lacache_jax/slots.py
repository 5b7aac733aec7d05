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
(ModelConfig, GenerationConfig, S, P), not per request. Prompts are admitted longest first, so
the bucket of the rows in flight only shrinks and each program runs over one contiguous span.
When it shrinks, rows in flight are re-padded: only their left padding changes, which never
shows (padded keys are masked, positions count from each row's first token).

Memory. The cache lives inside the per-block program: XLA's buffers of that program, the size
of the static batch's cache for S rows, allocated once per program and reused by every call.
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
def _slot_block(params: Params, cfg: ModelConfig, gen: GenerationConfig, impl: str, x_ST, pad_S,
                block_S, done_S, nfe_S, steps_S, revealed_S, keydata_S):
    """One block of every slot not `done_S`, each at its own block `block_S`; returns the new
    (canvas, done, block, nfe, steps, revealed). Done slots change nothing."""
    keys_S = jax.random.wrap_key_data(keydata_S, impl=impl)
    loop = sar.make_loop(params, cfg, gen, pad_S, x_ST.shape[1])
    # No cache comes in: the block's first forward builds it (see the module docstring).
    st = sar.LoopState(x_ST, done_S, nfe_S, steps_S, revealed_S, block_S, None)
    st = sar.run_block(loop, keys_S, None, st)
    return (st.x_BT, st.done_B, jnp.where(done_S, block_S, st.block), st.nfe_B, st.steps_B,
            st.revealed_B)


@dataclasses.dataclass
class Outputs:
    """Per-prompt results in input order, filled as rows finish."""
    gen_NG: np.ndarray
    nfe_N: np.ndarray
    steps_N: np.ndarray
    revealed_N: np.ndarray


class Scheduler:
    """Host state of S slots: which prompt each holds, its canvas row and counters."""

    def __init__(self, cfg: ModelConfig, gen: GenerationConfig, rows: list[np.ndarray], S: int):
        self.cfg, self.gen, self.rows, self.S = cfg, gen, rows, S
        N, G = len(rows), gen.gen_length
        self.row_of = np.full(S, -1)          # prompt index per slot, -1: free
        self.gen_SG = np.full((S, G), gen.mask_id, np.int32)
        self.block_S = np.zeros(S, np.int32)
        self.done_S = np.zeros(S, bool)
        self.counts_S = np.zeros((3, S), np.int32)  # nfe, steps, revealed
        self.out = Outputs(np.zeros((N, G), np.int32), *np.zeros((3, N), np.int32))

    def admit(self, slot: int, i: int) -> None:
        self.row_of[slot] = i
        self.gen_SG[slot] = self.gen.mask_id
        self.block_S[slot], self.done_S[slot], self.counts_S[:, slot] = 0, False, 0

    def canvas(self, P: int):
        """Canvas [S, P + G] and left padding [S] of the slots; free slots hold one pad token
        and masks (done, so they never act)."""
        x = np.full((self.S, P + self.gen.gen_length), self.cfg.pad_id, np.int32)
        pad = np.full(self.S, P - 1, np.int32)
        x[:, P:] = self.gen_SG
        for slot in np.flatnonzero(self.row_of >= 0):
            r = self.rows[self.row_of[slot]]
            pad[slot] = P - len(r)
            x[slot, pad[slot]:P] = r
        return x, pad

    def finish(self, limit_S: np.ndarray) -> list[int]:
        """End the rows that stopped at EOS or reached their last block; returns their slots."""
        done = np.flatnonzero((self.row_of >= 0) & (self.done_S | (self.block_S >= limit_S)))
        for slot in done:
            i = self.row_of[slot]
            self.out.gen_NG[i] = self.gen_SG[slot]
            self.out.nfe_N[i], self.out.steps_N[i], self.out.revealed_N[i] = self.counts_S[:, slot]
            self.row_of[slot] = -1
        return list(done)


def run(params: Params, cfg: ModelConfig, gen: GenerationConfig, rows: list[np.ndarray],
        keys_N: jax.Array, S: int, *, refill: bool = True, programs: dict | None = None,
        progress: Callable[[int, int], None] | None = None,
        block_limits: np.ndarray | None = None) -> Outputs:
    """Generate for every prompt of `rows` (validated token arrays) with at most S in flight.

    `refill=False` admits prompts only when every slot is free, in input order: static batches
    of S through the same program (a baseline for benchmarks). `programs` maps a bucket to a
    compiled `_slot_block` (compile_generate). `progress(rows_done, N)` is called on the host
    whenever rows finish. `block_limits` [N] (benchmarks only, e.g. a drawn answer length)
    ends row i after that many blocks, as if it had stopped at EOS there.
    """
    N, nb = len(rows), gen.num_blocks
    S = min(int(S), N)
    cap = cfg.max_seq_len - gen.gen_length
    impl = jax.random.key_impl(keys_N)
    keydata_N = np.asarray(jax.random.key_data(keys_N))
    limits_N = np.full(N, nb) if block_limits is None else np.minimum(block_limits, nb)
    order = (sorted(range(N), key=lambda i: -len(rows[i])) if refill else range(N))
    queue = collections.deque(order)
    sch = Scheduler(cfg, gen, rows, S)
    finished = 0
    while True:
        if refill or (sch.row_of < 0).all():
            for slot in np.flatnonzero(sch.row_of < 0):
                if not queue:
                    break
                sch.admit(slot, queue.popleft())
        live = sch.row_of >= 0
        if not live.any():
            return sch.out
        P = bucket(max(len(rows[i]) for i in sch.row_of[live]), cap)
        x, pad = sch.canvas(P)
        rows_S = np.where(live, sch.row_of, 0)
        args = (x, pad, sch.block_S, sch.done_S | ~live, *sch.counts_S, keydata_N[rows_S])
        if programs is not None and P in programs:
            out = programs[P](params, *args)
        else:
            out = _slot_block(params, cfg, gen, impl, *args)
        x, done, block, *counts = jax.device_get(out)
        sch.gen_SG, sch.block_S = np.array(x[:, P:]), np.array(block)
        sch.done_S, sch.counts_S = np.array(done), np.array(counts)
        n = len(sch.finish(np.where(live, limits_N[rows_S], nb)))
        if n and progress is not None:
            finished += n
            progress(finished, N)


def compile_programs(params: Params, cfg: ModelConfig, gen: GenerationConfig,
                     rows: list[np.ndarray], keys_N: jax.Array, S: int) -> dict:
    """The per-block program of every bucket these prompts can use, compiled ahead of time."""
    S = min(int(S), len(rows))
    cap = cfg.max_seq_len - gen.gen_length
    impl = jax.random.key_impl(keys_N)
    kd = np.asarray(jax.random.key_data(keys_N))[:1].repeat(S, 0)
    programs = {}
    for P in sorted({bucket(len(r), cap) for r in rows}, reverse=True):
        T = P + gen.gen_length
        zeros = np.zeros(S, np.int32)
        args = (np.zeros((S, T), np.int32), zeros, zeros, np.zeros(S, bool), zeros, zeros, zeros,
                kd)
        programs[P] = _slot_block.lower(params, cfg, gen, impl, *args).compile()
    return programs
