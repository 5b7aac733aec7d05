"""Slot refill: any number N of prompts through B rows in flight (`generate(..., slots=B)`).

Axes here (beside the package legend): B the slots (batch rows), U queued prompts (up to
`queue_size(B)`), E rows that ended during one program call (at most U + B).

Design: a device-resident queue. One jitted program (`_slot_run`) holds the B slots (batch
rows) and a queue of up to U = `queue_size(B)` prompts; its while loop runs one block of every
slot in flight (`sar.run_block` with one block index per row: each row's first forward and
later steps, with the policies, reveal rules and step strategies of `generate`), ends the
rows that stopped at EOS (`stop_at_eos`) or decoded their last block, writes their outputs
out, and gives each freed slot the next queued prompt, all on the device. Every cache
policy's first forward of a block rebuilds its whole cache (none, exact, prefix and dual all
run a full forward there), so no cache outlives a block: between blocks a row is its canvas
row, counters, block index, key and prompt, which is all a slot carries. Rows in flight sit at
different blocks, so each row's block starts at its own column `s_b = P + k_b * block_length`;
the canvas cut and write, RoPE tables, DPad's kept suffix, the EOS fill, the fixed schedule's
quota and the keys (`fold_in(key_b, k_b)`) all follow the row. A row therefore computes what it
computes in `generate`, alone or in any batch (fp32: the same tokens; tests/test_slots.py).

Why on the device: a host scheduler around a per-block program (this module until 2026-12-02)
pays one host round trip per block (inputs up, outputs down, the device idle in between): on
the H200 about 4 ms a block, next to 2.3 ms of device work per block for the demo model (64
slots, 4-token blocks), which made slot refill slower than static batches there
(benchmarks/RESULTS.md). Here the host meets the device once per U admitted prompts (the
queue's refill, the finished rows' outputs and progress) and when the canvas narrows.

Buckets. The canvas's prompt width P is a bucket of prompt lengths: the next power of two (at
least `MIN_BUCKET`), at most `max_seq_len - gen_length`. One program is compiled per
(ModelConfig, GenerationConfig, B, P), not per request or per N (B = `slot_count`: min(slots,
number of prompts), so a call with fewer prompts than slots computes no empty rows, except up
to data - 1 of them where a mesh rounds B up). Prompts are admitted
longest first, so the width needed only shrinks: a call leaves its loop as soon as its rows in
flight and its queue's rest fit the next smaller bucket, and the host narrows the canvas
(rows in flight keep their tokens: only their left padding changes, which never shows: padded
keys are masked, positions count from each row's first token).

Several devices (`mesh`, one host: the host reads the slots back when the canvas narrows):
the B slots split over the mesh's `data` axis (B rounded up to a multiple of it), the queue
replicated, the weights as `generate` places them. Admission stays
global (a slot freed on any device takes the next queued prompt), so a row computes what it
computes on one device; every device runs the same while loop, whose condition and admission
XLA's partitioner turns into small collectives once per block.

Memory. The cache lives inside the program: XLA's buffers, the size of the static batch's
cache for B rows, allocated once per program. Per-row block writes into a cache are one
scatter (`Canvas.put`). XLA's CPU memory analysis at LLaDA-8B shapes (B = 32, prompt 512, gen
256, dual cache) gave the per-block program of 2026-12-01 69.2 GiB against the static
program's 63.9 GiB (its buffer assignment gives these scatters copies); the GPU compiler gave
both 29,700.8 MiB (`python -m benchmarks.serve memory`, RESULTS.md).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from lacache_jax import sar
from lacache_jax.config import GenerationConfig, ModelConfig
from lacache_jax.model import Params
from lacache_jax.sharding import DATA, tracing_under

MIN_BUCKET = 8
FLASH_MESH_REFUSED = "slot refill with gen.flash runs on one device: pass no mesh"


def bucket(n: int, cap: int) -> int:
    """Prompt width P of the canvas holding an n-token prompt: the next power of two >= n (at
    least MIN_BUCKET), at most `cap` (max_seq_len - gen_length, which n never exceeds)."""
    return min(max(MIN_BUCKET, 1 << (n - 1).bit_length()), cap)




def narrower(P: int) -> int:
    """The largest bucket below width P (0 at MIN_BUCKET): a canvas of width P narrows to it
    once every prompt it holds or queues fits."""
    return 0 if P <= MIN_BUCKET else 1 << ((P - 1).bit_length() - 1)


def queue_size(B: int) -> int:
    """Prompts one program call can admit (U): the host meets the device once per U."""
    return 4 * B


@dataclasses.dataclass
class Outputs:
    """Per-prompt results in input order, filled as rows finish."""
    generated: np.ndarray  # [prompts, gen_length] each prompt's generated columns
    nfe: np.ndarray        # [prompts]
    steps: np.ndarray      # [prompts]
    revealed: np.ndarray   # [prompts]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotState:
    """The B slots between blocks (device arrays; a free slot has `live_B` False)."""
    x_BT: jax.Array        # [B, P + gen_length] canvas rows, prompts left-padded to P
    pad_B: jax.Array       # [B] left padding
    len_B: jax.Array       # [B] prompt length (0: free)
    block_B: jax.Array     # [B] the row's next block
    done_B: jax.Array      # [B] bool: stopped at EOS
    live_B: jax.Array      # [B] bool: holds a prompt
    nfe_B: jax.Array       # [B] counters as in sar.LoopState
    steps_B: jax.Array
    revealed_B: jax.Array
    limit_B: jax.Array     # [B] blocks the row decodes at most
    index_B: jax.Array     # [B] the prompt's place in the input
    keydata_B: jax.Array   # [B, ...] the prompt's key data


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Queue:
    """Up to U prompts in admission order, left-padded to the program's width P."""
    prompt_UP: jax.Array   # [U, P]
    len_U: jax.Array       # [U]
    limit_U: jax.Array     # [U]
    index_U: jax.Array     # [U]
    keydata_U: jax.Array   # [U, ...]
    n: jax.Array           # [] entries in use


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Finished:
    """Rows that ended during one call, in the order they ended (E = U + B: at most the rows
    in flight at its start and those it admits)."""
    generated_E: jax.Array   # [E, gen_length]
    nfe_E: jax.Array
    steps_E: jax.Array
    revealed_E: jax.Array
    index_E: jax.Array       # [E] the prompt's place in the input
    count: jax.Array         # [] rows used


def _where_rows(take_B, new, old):
    """Row b of every field from `new` where take_B[b], else from `old`."""
    return jax.tree.map(lambda a, b: jnp.where(take_B.reshape((-1,) + (1,) * (a.ndim - 1)), a, b),
                        new, old)


def slot_count(slots: int, n: int, mesh: jax.sharding.Mesh | None) -> int:
    """Rows the program holds: `slots`, at most the number of prompts, rounded up to a
    multiple of the mesh's data axis (each device holds as many)."""
    B = min(int(slots), n)
    return B if mesh is None else -(-B // mesh.shape[DATA]) * mesh.shape[DATA]


def _place(args: tuple, mesh: jax.sharding.Mesh | None) -> tuple:
    """`_slot_run`'s arguments on the mesh: slots split by row over `data`, the rest
    replicated (a compiled program takes its arguments exactly so placed)."""
    if mesh is None:
        return args
    sl, *rest = args
    return (jax.device_put(sl, NamedSharding(mesh, PS(DATA))),
            *jax.device_put(tuple(rest), NamedSharding(mesh, PS())))


@functools.partial(jax.jit, static_argnames=("cfg", "gen", "impl", "mesh"))
def _slot_run(params: Params, cfg: ModelConfig, gen: GenerationConfig, impl, mesh,
              sl: SlotState, q: Queue, narrow_to, drain, refill):
    """Admit queued prompts into free slots and run blocks until the queue is admitted (or,
    with `drain`, until no row is in flight), or until the prompts in flight and queued all fit
    width `narrow_to`. `refill` False admits only when every slot is free (static batches; a
    traced flag, so one compiled program serves both).
    Returns (slots, the rows that ended, queue entries admitted, longest prompt in flight,
    rows in flight)."""
    with tracing_under(mesh):
        return _slot_body(params, cfg, gen, impl, sl, q, narrow_to, drain, refill)


def _slot_body(params, cfg, gen, impl, sl, q, narrow_to, drain, refill):
    B, T = sl.x_BT.shape
    n_gen, U = gen.gen_length, q.len_U.shape[0]
    P, E = T - n_gen, U + B

    def admit(sl, nxt):
        free = ~sl.live_B
        j = nxt + jnp.cumsum(free) - 1
        take = free & (j < q.n) & (refill | free.all())
        j = jnp.clip(j, 0, U - 1)
        zeros = jnp.zeros(B, jnp.int32)
        masks = jnp.full((B, n_gen), gen.mask_id, jnp.int32)
        new = SlotState(
            x_BT=jnp.concatenate([q.prompt_UP[j], masks], 1),
            pad_B=P - q.len_U[j], len_B=q.len_U[j], block_B=zeros,
            done_B=jnp.zeros(B, bool), live_B=jnp.ones(B, bool), nfe_B=zeros, steps_B=zeros,
            revealed_B=zeros, limit_B=q.limit_U[j], index_B=q.index_U[j],
            keydata_B=q.keydata_U[j])
        return _where_rows(take, new, sl), nxt + take.sum(dtype=jnp.int32)

    def one_block(sl):
        keys_B = jax.random.wrap_key_data(sl.keydata_B, impl=impl)
        loop = sar.make_loop(params, cfg, gen, sl.pad_B, T)
        idle = sl.done_B | ~sl.live_B  # idle rows change nothing
        st = sar.LoopState(sl.x_BT, idle, sl.nfe_B, sl.steps_B, sl.revealed_B, sl.block_B, None)
        st = sar.run_block(loop, keys_B, None, st)
        return dataclasses.replace(
            sl, x_BT=st.x_BT, done_B=st.done_B & sl.live_B,
            block_B=jnp.where(idle, sl.block_B, st.block), nfe_B=st.nfe_B,
            steps_B=st.steps_B, revealed_B=st.revealed_B)

    def finish(sl, fin):
        ended = sl.live_B & (sl.done_B | (sl.block_B >= sl.limit_B))
        at = jnp.where(ended, fin.count + jnp.cumsum(ended) - 1, E)  # E: dropped
        put = lambda buf, rows: buf.at[at].set(rows, mode="drop")
        fin = Finished(put(fin.generated_E, sl.x_BT[:, P:]), put(fin.nfe_E, sl.nfe_B),
                       put(fin.steps_E, sl.steps_B), put(fin.revealed_E, sl.revealed_B),
                       put(fin.index_E, sl.index_B), fin.count + ended.sum(dtype=jnp.int32))
        return dataclasses.replace(sl, live_B=sl.live_B & ~ended,
                                   len_B=jnp.where(ended, 0, sl.len_B)), fin

    def in_flight(sl):  # the longest prompt in flight (0: none)
        return jnp.where(sl.live_B, sl.len_B, 0).max()

    def longest(sl, nxt):
        rest = (jnp.arange(U) >= nxt) & (jnp.arange(U) < q.n)
        return jnp.maximum(in_flight(sl), jnp.where(rest, q.len_U, 0).max())

    def go_on(carry):
        sl, _, nxt = carry
        return sl.live_B.any() & ((nxt < q.n) | drain) & (longest(sl, nxt) > narrow_to)

    def body(carry):
        sl, fin, nxt = carry
        sl, fin = finish(one_block(sl), fin)
        sl, nxt = admit(sl, nxt)
        return sl, fin, nxt

    zeros_E = jnp.zeros(E, jnp.int32)
    fin = Finished(jnp.full((E, n_gen), gen.mask_id, jnp.int32), zeros_E, zeros_E, zeros_E,
                   jnp.full(E, -1, jnp.int32), jnp.int32(0))
    sl, nxt = admit(sl, jnp.int32(0))
    sl, fin, nxt = jax.lax.while_loop(go_on, body, (sl, fin, nxt))
    return sl, fin, nxt, in_flight(sl), sl.live_B.sum(dtype=jnp.int32)


def _rewidth(sl: SlotState, shift: int, pad_id: int) -> SlotState:
    """The slots (on the host) at a prompt width `shift` columns wider (< 0: narrower): left
    padding added or cut, which rows in flight never see (their prompts fit the new width).
    Host numpy: widths change a few times a run, and a jitted version would compile per
    (shift, B, P) inside the first timed run."""
    sl = jax.device_get(sl)
    x = (np.concatenate([np.full((len(sl.x_BT), shift), pad_id, np.int32), sl.x_BT], 1)
         if shift > 0 else sl.x_BT[:, -shift:])
    return dataclasses.replace(sl, x_BT=x, pad_B=np.maximum(sl.pad_B + shift, 0))


def _empty(B: int, P: int, gen: GenerationConfig, cfg: ModelConfig,
           keydata_1: np.ndarray) -> SlotState:
    """B free slots at width P (one pad token each: a free row computes nothing it keeps)."""
    x = np.full((B, P + gen.gen_length), gen.mask_id, np.int32)
    x[:, :P] = cfg.pad_id
    z = np.zeros(B, np.int32)
    return SlotState(x, np.full(B, P - 1, np.int32), z, z, np.zeros(B, bool), np.zeros(B, bool),
                     z, z, z, z, z, keydata_1.repeat(B, 0))


def _queue(prompts: list[np.ndarray], take: np.ndarray, P: int, U: int, pad_id: int,
           limits: np.ndarray, keydata: np.ndarray) -> Queue:
    """Prompts `take` (indices into `prompts`, at most U) left-padded to P; unused entries
    repeat the last one (never admitted: `n`)."""
    rows = np.full((U, P), pad_id, np.int32)
    for e, i in enumerate(take):
        rows[e, P - len(prompts[i]):] = prompts[i]
    idx = np.concatenate([take, np.full(U - len(take), take[-1] if len(take) else 0)])
    idx = idx.astype(np.int32)
    lens = np.array([len(prompts[i]) for i in idx], np.int32)
    return Queue(rows, lens, limits[idx].astype(np.int32), idx, keydata[idx],
                 np.int32(len(take)))


def run(params: Params, cfg: ModelConfig, gen: GenerationConfig, prompts: list[np.ndarray],
        keys: jax.Array, slots: int, *, refill: bool = True, programs: dict | None = None,
        progress: Callable[[int, int], None] | None = None,
        block_limits: np.ndarray | None = None,
        mesh: jax.sharding.Mesh | None = None) -> Outputs:
    """Generate for every prompt (validated token arrays; `keys` one per prompt) with at most
    B = `slot_count(slots, ...)` rows in flight.

    `refill=False` admits prompts only when every slot is free, in input order: static batches
    of B through the same program (a baseline for benchmarks). `programs` maps a width
    to a compiled `_slot_run` (compile_programs). `progress(rows_done, len(prompts))` is
    called on the host after each program call that ended rows. `block_limits` (one per
    prompt; benchmarks only, e.g. from a drawn answer length) ends row i after that many
    blocks (at least one), as if it had stopped at EOS there. With `gen.flash` the Flash-dLLM
    scheduler runs instead (flash_slots.py; no `block_limits`: its rows have no blocks).
    `mesh`: slots over its data axis (module docstring); `params` already placed on it
    (`sharding.shard_params`).
    """
    if gen.flash is not None:
        if block_limits is not None:
            raise ValueError("block_limits applies to block decoding, not to gen.flash")
        if mesh is not None:
            raise ValueError(FLASH_MESH_REFUSED)
        from lacache_jax import flash_slots
        return flash_slots.run(params, cfg, gen, prompts, keys, slots, refill=refill,
                               programs=programs, progress=progress)
    n, n_gen = len(prompts), gen.gen_length
    B = slot_count(slots, n, mesh)
    U, cap = queue_size(B), cfg.max_seq_len - n_gen
    impl = jax.random.key_impl(keys)
    keydata = np.asarray(jax.random.key_data(keys))
    # A row decodes one block at least (it ends after a block), whatever its limit says.
    limits = np.full(n, gen.num_blocks) if block_limits is None else np.clip(
        block_limits, 1, gen.num_blocks)
    lens = np.array([len(r) for r in prompts])
    order = np.argsort(-lens, kind="stable") if refill else np.arange(n)
    out = Outputs(np.zeros((n, n_gen), np.int32), *np.zeros((3, n), np.int32))
    sl, P, pos, longest, live, finished = None, 0, 0, 0, 0, 0
    while pos < n or live:
        take = order[pos:pos + U]
        width = bucket(max(longest, int(lens[take].max(initial=0))), cap)
        sl = (_empty(B, width, gen, cfg, keydata[:1]) if sl is None
              else sl if width == P else _rewidth(sl, width - P, cfg.pad_id))
        P = width
        q = _queue(prompts, take, P, U, cfg.pad_id, limits, keydata)
        args = _place((sl, q, np.int32(narrower(P)), np.bool_(pos + len(take) == n),
                       np.bool_(refill)), mesh)
        if programs is not None and P in programs:
            res = programs[P](params, *args)
        else:
            res = _slot_run(params, cfg, gen, impl, mesh, *args)
        sl = res[0]
        fin, nxt, longest, live = jax.device_get(res[1:])
        pos, longest, live = pos + int(nxt), int(longest), int(live)
        k = int(fin.count)
        i = fin.index_E[:k]
        out.generated[i] = fin.generated_E[:k]
        out.nfe[i], out.steps[i] = fin.nfe_E[:k], fin.steps_E[:k]
        out.revealed[i] = fin.revealed_E[:k]
        if k and progress is not None:
            finished += k
            progress(finished, n)
    return out


def compile_programs(params: Params, cfg: ModelConfig, gen: GenerationConfig,
                     prompts: list[np.ndarray], keys: jax.Array, slots: int,
                     mesh: jax.sharding.Mesh | None = None) -> dict:
    """The program of every width these prompts can use, compiled ahead of time (with
    `gen.flash`, flash_slots.compile_programs: a `Programs` per bucket)."""
    if gen.flash is not None:
        if mesh is not None:
            raise ValueError(FLASH_MESH_REFUSED)
        from lacache_jax import flash_slots
        return flash_slots.compile_programs(params, cfg, gen, prompts, keys, slots)
    B = slot_count(slots, len(prompts), mesh)
    cap = cfg.max_seq_len - gen.gen_length
    impl = jax.random.key_impl(keys)
    keydata = np.asarray(jax.random.key_data(keys))[:1]
    programs = {}
    for P in sorted({bucket(len(r), cap) for r in prompts}, reverse=True):
        args = _place((_empty(B, P, gen, cfg, keydata),
                       _queue([np.zeros(1, np.int32)], np.zeros(1, np.int64), P, queue_size(B),
                              cfg.pad_id, np.zeros(1), keydata), np.int32(0), np.bool_(True),
                       np.bool_(True)), mesh)
        programs[P] = _slot_run.lower(params, cfg, gen, impl, mesh, *args).compile()
    return programs
