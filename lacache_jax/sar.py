"""The jitted semi-autoregressive (SAR) loop: a typed loop state, the block and step
`lax.while_loop`s, and the step strategies.

Blocks [s, s + block_length) of the canvas (canvas.py) are decoded in order; inside a block,
steps run until the block has no mask left in any unfinished row. Each step is a **step
strategy** (`STEP_STRATEGIES`): it runs the cache policy's forward(s) (cache.py: the block's
first forward, then later ones) and writes what the **reveal rule** (sampling.REVEAL_RULES)
chooses into the canvas. A strategy owns its forward count, so a two-pass step (draft, then
verify) is one more strategy. Rows that reveal an EOS in a block stop after it (`stop_at_eos`)
and their remaining columns are filled with EOS.

`run` decodes every block of a batch whose rows share the block index (one scalar `s`).
`run_block` also takes one block index per row (`LoopState.block` [B]): slot refill
(slots.py) runs one block of rows that are at different blocks, each from its own column
`s_B = P + k_B * block_length`, with its own block keys and DPad draw `fold_in(key, k_B)`.

Static shapes: a policy whose later forwards change shape block by block (prefix: queries
[s, T); exact with DPad: block k's compact canvas) gets each block's later steps in a program
of their own, `lax.switch` over the blocks with s a Python int (`static_later`). The switch
wraps the whole step loop, not each step, so the cache crosses a conditional once per block
and is updated in place inside. A block's first forward needs no switch here: the policies
dispatch it per block themselves (compact.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from lacache_jax import sampling
from lacache_jax.cache import Ctx, policy_for
from lacache_jax.canvas import Canvas
from lacache_jax.config import GenerationConfig, ModelConfig
from lacache_jax.model import Params


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoopState:
    x_BT: jax.Array        # [B, T] canvas
    done_B: jax.Array      # [B] bool: the row stopped at EOS
    nfe_B: jax.Array       # [B] forward passes the row took part in (CFG counts two)
    steps_B: jax.Array     # [B] decoding steps the row took part in
    revealed_B: jax.Array  # [B] tokens revealed by the sampler (not the EOS fill)
    block: jax.Array       # [] index of the current block, or [B] one per row (slots.py)
    cache: Any             # the cache policy's pytree (None without a cache)


@dataclasses.dataclass(frozen=True)
class Block:
    """What stays fixed over the steps of one block."""
    s: jax.Array                  # [] first column, or [B] one per row
    keep_BT: jax.Array            # [B, T] keys the block sees (padding, DPad's drops removed)
    quota_BS: jax.Array | None    # [B, steps_per_block] fixed schedule; None when parallel
    keys_B: jax.Array             # [B] per-row keys of the block

    def step_keys(self, i) -> jax.Array:
        return jax.vmap(lambda key: jax.random.fold_in(key, i))(self.keys_B)


@dataclasses.dataclass(frozen=True)
class Loop:
    """The static pieces of one generation: model context, settings, policy, rule, strategy."""
    ctx: Ctx
    gen: GenerationConfig
    policy: Any
    rule: Callable
    strategy: Any

    @property
    def canvas(self) -> Canvas:
        return self.ctx.canvas


def reveal(loop: Loop, st: LoopState, blk: Block, i, logits_BQV, passes: int = 1) -> LoopState:
    """Sample the block's masked positions from `logits_BQV`, reveal those the rule picks in
    the active rows, and count the step (`passes` forwards, doubled under CFG)."""
    gen, cv = loop.gen, loop.canvas
    with jax.named_scope("sample"):
        xb = cv.cut(st.x_BT, blk.s)
        masked = xb == gen.mask_id
        active = ~st.done_B & masked.any(-1)
        if gen.logits_eos_inf:
            logits_BQV = logits_BQV.at[..., gen.eos_id].set(-jnp.inf)
        keys = blk.step_keys(i)
        k_sample = jax.vmap(lambda k: jax.random.fold_in(k, 0))(keys)
        k_conf = jax.vmap(lambda k: jax.random.fold_in(k, 1))(keys)
        x0 = sampling.sample(logits_BQV, gen.temperature, k_sample)
        conf_logits = (sampling.without_eos_eot(logits_BQV, gen.eos_id, gen.eot_id,
                                                gen.temperature)
                       if gen.confidence_eos_eot_inf else logits_BQV)
        conf = sampling.confidence(conf_logits, x0, gen.remasking, k_conf)
        quota = (None if blk.quota_BS is None
                 else blk.quota_BS[:, jnp.minimum(i, blk.quota_BS.shape[1] - 1)])
        chosen = loop.rule(conf, masked, quota, gen.reveal_value) & active[:, None]
        return dataclasses.replace(
            st, x_BT=cv.put(st.x_BT, jnp.where(chosen, x0, xb), blk.s),
            nfe_B=st.nfe_B + active * passes * cv.rows_per_row, steps_B=st.steps_B + active,
            revealed_B=st.revealed_B + (chosen & (x0 != gen.mask_id)).sum(-1))


class RevealStep:
    """LLaDA / Fast-dLLM: one forward, then reveal by the rule."""

    def __call__(self, loop: Loop, st: LoopState, blk: Block, i, forward) -> LoopState:
        logits, cache = forward(st.x_BT, st.cache)
        return reveal(loop, dataclasses.replace(st, cache=cache), blk, i, logits)


# name -> strategy(loop, state, block, i, forward) -> state, where `forward(x_BT, cache) ->
# (logits_BQV, cache)` is the cache policy's forward for this step.
STEP_STRATEGIES = {"reveal": RevealStep()}


def has_work(loop: Loop, st: LoopState, s) -> jax.Array:
    """Some unfinished row still has a mask in the block."""
    masked = loop.canvas.cut(st.x_BT, s) == loop.gen.mask_id
    return (~st.done_B & masked.any(-1)).any()


def open_block(loop: Loop, st: LoopState, keys_B: jax.Array) -> Block:
    gen, cv = loop.gen, loop.canvas
    k = st.block  # [] or [B]
    s = cv.prompt_len + k * gen.block_length
    keep = cv.valid_BT
    if gen.dpad is not None:
        keep &= sampling.dpad_keep(gen.dpad, sampling.dpad_block_keys(keys_B, k),
                                   s + gen.block_length, cv.valid_BT.shape[1])
    quota = None
    if not gen.parallel:
        n_masked = (cv.cut(st.x_BT, s) == gen.mask_id).sum(-1)
        quota = sampling.transfer_schedule(n_masked, gen.steps_per_block)
    return Block(s, keep, quota,
                 jax.vmap(jax.random.fold_in)(keys_B, jnp.broadcast_to(k, keys_B.shape)))


def run_block(loop: Loop, keys_B: jax.Array, on_block: Callable | None,
              st: LoopState) -> LoopState:
    """The block's first step (the policy's first forward), its later steps, the EOS stop."""
    gen, cv, policy, ctx = loop.gen, loop.canvas, loop.policy, loop.ctx
    blk = open_block(loop, st, keys_B)
    i0 = 0
    if not policy.later_is_first:
        first = lambda x, cache: policy.first(ctx, x, blk.keep_BT, blk.s)
        st, i0 = loop.strategy(loop, st, blk, 0, first), 1
    # Otherwise step 0 runs in the loop too (always: as the first step does), so the program
    # holds one copy of the forward, not two (compile time; DPad's compact canvas has one per
    # block).

    def later_steps(st: LoopState, blk: Block) -> LoopState:
        def body(carry):
            st, i = carry
            later = lambda x, cache: policy.step(ctx, x, blk.keep_BT, blk.s, cache, i)
            return loop.strategy(loop, st, blk, i, later), i + 1

        return jax.lax.while_loop(
            lambda c: (c[1] == 0) | ((c[1] < step_limit) & has_work(loop, c[0], blk.s)),
            body, (st, jnp.int32(i0)))[0]

    # A mask stays masked only where the model samples the mask id itself. LLaDA's fixed
    # schedule then still ends the block after its steps (masks left, as released); the
    # parallel rules' released loops would run until the mask goes, possibly forever: here
    # at most one step per position.
    step_limit = gen.block_length if gen.parallel else gen.steps_per_block

    if jnp.ndim(blk.s) == 0 and policy.static_later(ctx):
        # One program per block, its start a Python int (cache.py: `static_later`).
        starts = [cv.prompt_len + k * gen.block_length for k in range(gen.num_blocks)]
        st = jax.lax.switch(st.block, [
            lambda st, s=s: later_steps(st, dataclasses.replace(blk, s=s)) for s in starts], st)
    else:
        st = later_steps(st, blk)
    if gen.stop_at_eos:
        finished = ~st.done_B & (cv.cut(st.x_BT, blk.s) == gen.eos_id).any(-1)
        col = jnp.arange(st.x_BT.shape[1])
        end = jnp.reshape(blk.s + gen.block_length, (-1, 1))  # [1, 1] or [B, 1]
        fill = finished[:, None] & (col[None, :] >= end)
        st = dataclasses.replace(st, x_BT=jnp.where(fill, gen.eos_id, st.x_BT),
                                 done_B=st.done_B | finished)
    if on_block is not None:
        report_progress(on_block, st.block + 1, st.x_BT)
    return dataclasses.replace(st, block=st.block + 1)


def report_progress(on_block: Callable, done: jax.Array, x_BT: jax.Array) -> None:
    """`on_block(done)` from the device once the work that produced `x_BT` is done. The
    callback also takes an element of the canvas: with only `done` (known when the block
    starts) XLA ran it first, and the progress bar ran a block ahead of the work."""
    jax.debug.callback(lambda d, _: on_block(d), done, x_BT[0, 0])


def make_loop(params: Params, cfg: ModelConfig, gen: GenerationConfig, pad_B: jax.Array,
              T: int) -> Loop:
    return Loop(Ctx.build(params, cfg, gen, pad_B, T), gen, policy_for(gen),
                sampling.REVEAL_RULES[gen.reveal_rule], STEP_STRATEGIES["reveal"])


def init_state(loop: Loop, x_BT: jax.Array) -> LoopState:
    zeros = jnp.zeros((x_BT.shape[0],), jnp.int32)
    return LoopState(x_BT, jnp.zeros(zeros.shape, bool), zeros, zeros, zeros, jnp.int32(0),
                     loop.policy.init(loop.ctx))


def run(params: Params, cfg: ModelConfig, gen: GenerationConfig, x_BT: jax.Array,
        pad_B: jax.Array, keys_B: jax.Array, on_block: Callable | None = None) -> LoopState:
    """Decode every block of the canvas (traced: call under jit). `on_block(blocks_done)` is
    called from the device once per finished block when given."""
    loop = make_loop(params, cfg, gen, pad_B, x_BT.shape[1])
    return jax.lax.while_loop(lambda st: (st.block < gen.num_blocks) & ~st.done_B.all(),
                              lambda st: run_block(loop, keys_B, on_block, st),
                              init_state(loop, x_BT))
