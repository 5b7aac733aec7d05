"""The semi-autoregressive (SAR) generation loop: one jitted program per configuration.

Canvas `x [B, T]`, T = P + G: prompts left-padded to P, then G masks. Padding never shows:
padded keys are masked and RoPE positions count from each row's first real token, so a row
generates exactly what it generates alone. Blocks [s, s + block_length) are decoded in order by
a `lax.while_loop` over blocks and, inside, one over steps until the block has no mask left in
any unfinished row. Every block opens with a full forward whose logits decode its first step:

  cache    first step of a block                 later steps
  none     full forward                          full forward
  exact    full forward, fill layer 0's          layer 0: embed/norm/QKV/RoPE of [s, e) only,
           LaCache (embeddings, q/k/v, FACache)  FACache attention in reuse mode; layers >= 1
                                                 full. Same tokens as `none`.
  prefix   full forward, keep all K/V            queries [P, T) against cached K/V before s
  dual     full forward, keep all K/V            queries [s, e); their K/V overwrite the cache

Only the block's rows go through the LM head and the sampler (sampling.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS  # P is the prompt length here

from kernels.cached_attention import FAState, cached_attention
from lacache_jax import sampling
from lacache_jax.cache import KVCache, LaCache
from lacache_jax.config import GenerationConfig, ModelConfig
from lacache_jax.quant import has_fp8_ffn
from lacache_jax.model import (Params, finish_block, forward_layers, lm_head, qkv, rms_norm,
                               rope_tables, run_blocks)
from lacache_jax.sharding import DATA, MODEL, shard_kernel, shard_params

_DPAD_STREAM = 1 << 20  # fold_in tag separating DPad draws from sampling draws


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GenerateOutput:
    tokens: jax.Array          # [B, P + G] canvas; prompts left-padded with pad_id
    prompt_lengths: jax.Array  # [B] real prompt tokens per row
    nfe: jax.Array             # [B] forward passes the row took part in (CFG counts two)
    steps: jax.Array           # [B] decoding steps the row took part in
    revealed: jax.Array        # [B] tokens the sampler revealed (not the EOS fill)
    gen_lengths: jax.Array     # [B] generated tokens before the first EOS

    @property
    def tokens_per_step(self) -> jax.Array:
        return self.revealed / jnp.maximum(self.steps, 1)

    def answers(self, gen_length: int) -> list[list[int]]:
        """Each row's generated tokens up to (not including) its first EOS."""
        toks, lens = np.asarray(self.tokens), np.asarray(self.gen_lengths)
        start = toks.shape[1] - gen_length
        return [toks[b, start:start + lens[b]].tolist() for b in range(toks.shape[0])]


def generate(params: Params, config: ModelConfig, prompts: Any, gen: GenerationConfig,
             key: jax.Array | None = None, prompt_lengths: Any = None,
             mesh: jax.sharding.Mesh | None = None,
             progress: Callable[[int, int], None] | None = None) -> GenerateOutput:
    """Generate `gen.gen_length` tokens after each prompt.

    `prompts`: an int array [B, P], a list of token lists (ragged), or an array [B, P] with
    `prompt_lengths` [B] (row b's prompt is its first `prompt_lengths[b]` tokens).
    `key`: one key, or one key per row ([B]); with one key row b draws from
    `fold_in(key, b)`, so pass per-row keys when a row's random draws (temperature > 0,
    random remasking, DPad) must not depend on its place in the batch.
    `mesh` (`lj.make_mesh(data, model)`): rows split over its `data` axis (the batch is
    padded to a multiple of it, and the padding dropped from the output), weights over `model`
    (tensor parallel); the tokens are those of the single-device run.
    `progress(blocks_done, num_blocks)` is called from the device once per finished block (a
    host callback; the call returns only once generation has finished).
    Every invalid argument raises ValueError before anything is compiled.
    """
    params, gen, B, *args = _prepare(params, config, prompts, gen, key, prompt_lengths, mesh)
    if progress is None:
        return _rows(_generate(params, config, gen, mesh, False, *args), B)
    with _reporting(progress, gen.num_blocks):
        return jax.block_until_ready(_rows(_generate(params, config, gen, mesh, True, *args), B))


def compile_generate(params: Params, config: ModelConfig, prompts: Any, gen: GenerationConfig,
                     key: jax.Array | None = None, prompt_lengths: Any = None,
                     mesh: jax.sharding.Mesh | None = None,
                     progress: Callable[[int, int], None] | None = None):
    """Compile ahead of time; returns `run() -> GenerateOutput`, the same computation as
    `generate(...)` with these arguments, so benchmarks can time it without compilation.
    `run.compiled` is the `jax.stages.Compiled` program (`run.compiled.as_text()`: the
    optimised HLO, for profiles and copy counts)."""
    params, gen, B, *args = _prepare(params, config, prompts, gen, key, prompt_lengths, mesh)
    compiled = _generate.lower(params, config, gen, mesh, progress is not None, *args).compile()

    def run():
        if progress is None:
            return _rows(compiled(params, *args), B)
        with _reporting(progress, gen.num_blocks):
            return jax.block_until_ready(_rows(compiled(params, *args), B))
    run.compiled = compiled
    return run


_progress_hooks: list[Callable[[int], None]] = []


@contextlib.contextmanager
def _reporting(progress: Callable[[int, int], None], num_blocks: int):
    """Route the loop's per-block callbacks to `progress` while the program runs."""
    _progress_hooks.append(lambda done: progress(done, num_blocks))
    try:
        yield
    finally:
        _progress_hooks.pop()


def _block_done(done) -> None:
    if _progress_hooks:
        _progress_hooks[-1](int(done))


def _rows(out: GenerateOutput, B: int) -> GenerateOutput:
    """Drop the rows added to fill the mesh's data axis."""
    return out if out.tokens.shape[0] == B else jax.tree.map(lambda a: a[:B], out)


def _prepare(params, config, prompts, gen, key, prompt_lengths, mesh=None):
    """Validate everything; returns (params with FP8 FFN copies kept only for `fp8_ffn`,
    resolved gen, B, canvas [B', T], left padding [B'], keys [B']), B' = B rounded up to the
    mesh's data axis, all placed on the mesh when there is one."""
    if not isinstance(gen, GenerationConfig):
        raise ValueError(f"gen must be a GenerationConfig, got {type(gen).__name__}")
    gen = gen.resolve(config)
    rows = _prompt_rows(prompts, prompt_lengths, config, gen)
    B, P = len(rows), max(len(r) for r in rows)
    if P + gen.gen_length > config.max_seq_len:
        raise ValueError(f"prompt length {P} + gen_length {gen.gen_length} exceeds the model's "
                         f"max_seq_len={config.max_seq_len}")
    if len(params.layers) != config.n_layers:
        raise ValueError(f"params has {len(params.layers)} layers, config says {config.n_layers}")
    if gen.fp8_ffn and not has_fp8_ffn(params):
        raise ValueError("fp8_ffn=True needs FP8 FFN weights: params = lj.quantize_ffn(params)")
    if not gen.fp8_ffn:
        params = dataclasses.replace(
            params, layers=[dataclasses.replace(layer, ffn8=None) for layer in params.layers])
    keys = row_keys(key, B)
    if mesh is not None:
        params = shard_params(params, config, mesh)
        extra = -B % mesh.shape[DATA]  # copies of the last row: each row is independent
        rows += [rows[-1]] * extra
        keys = jnp.concatenate([keys, jnp.repeat(keys[-1:], extra, axis=0)])
    x = np.full((len(rows), P + gen.gen_length), gen.mask_id, np.int32)
    pad = np.array([P - len(r) for r in rows], np.int32)
    for b, r in enumerate(rows):
        x[b, :pad[b]] = config.pad_id
        x[b, pad[b]:P] = r
    x, pad = jnp.asarray(x), jnp.asarray(pad)
    if mesh is not None:
        x, pad, keys = jax.device_put((x, pad, keys), NamedSharding(mesh, PS(DATA)))
    return params, gen, B, x, pad, keys


def facache(q, k, v, key_mask, s, e, state: FAState | None = None, *, mode: str,
            block_len: int | None = None):
    """FACache attention; under a mesh, one kernel per (row shard, head shard). In reuse mode
    `block_len` (the static e - s) selects the kernel's split-key path for the block's tiles
    (measured faster on the H200: RESULTS.md)."""
    heads = PS(DATA, None, MODEL, None)
    st = FAState(PS(DATA, MODEL, None), PS(DATA, MODEL, None), heads)
    extra = () if state is None else (state,)
    fn = shard_kernel(lambda *a: cached_attention(*a, mode=mode, block_len=block_len),
                      (heads, heads, heads, PS(DATA, None), PS(), PS(), *((st,) if extra else ())),
                      (heads, st) if mode == "fill" else heads)
    return fn(q, k, v, key_mask, s, e, *extra)


def dpad_block_keys(keys_B: jax.Array, block: int | jax.Array) -> jax.Array:
    """Per-row keys of the DPad draw for block `block` (exposed for tests)."""
    stream = jax.vmap(lambda k: jax.random.fold_in(k, _DPAD_STREAM))(keys_B)
    return jax.vmap(lambda k: jax.random.fold_in(k, block))(stream)


@functools.partial(jax.jit, static_argnames=("cfg", "gen", "mesh", "report"))
def _generate(params: Params, cfg: ModelConfig, gen: GenerationConfig, mesh, report: bool, x_BT,
              pad_B, keys_B):
    # The mesh is static: kernels see it (`shard_kernel`) while this traces.
    with (jax.sharding.use_abstract_mesh(mesh.abstract_mesh) if mesh is not None
          else contextlib.nullcontext()):
        return _generate_traced(params, cfg, gen, report, x_BT, pad_B, keys_B)


def _generate_traced(params: Params, cfg: ModelConfig, gen: GenerationConfig, report: bool,
                     x_BT, pad_B, keys_B):
    B, T = x_BT.shape
    G, bl = gen.gen_length, gen.block_length
    P = T - G
    col = jnp.arange(T)
    # The block_length columns starting at s: read them, or write them into a [B, T, ...] array.
    cut = lambda a, s: jax.lax.dynamic_slice_in_dim(a, s, bl, axis=1)
    put = lambda a, new, s: jax.lax.dynamic_update_slice_in_dim(a, new, s, axis=1)
    valid_BT = col[None, :] >= pad_B[:, None]
    pos_BT = jnp.maximum(col[None, :] - pad_B[:, None], 0).astype(jnp.int32)
    use_cfg = gen.cfg_scale > 0
    # Classifier-free guidance runs the unconditional copies (prompt tokens -> mask) as extra
    # rows of the same batch, so every cache mode supports it unchanged.
    dup = (lambda a: jnp.concatenate([a, a])) if use_cfg else (lambda a: a)
    prompt_BT = valid_BT & (col[None, :] < P)

    def model_rows(x):
        return jnp.concatenate([x, jnp.where(prompt_BT, gen.mask_id, x)]) if use_cfg else x

    pos_M = dup(pos_BT)

    def block_logits(h_MQD):
        logits = lm_head(params, cfg, h_MQD).astype(jnp.float32)
        if use_cfg:
            cond, uncond = logits[:B], logits[B:]
            logits = uncond + (gen.cfg_scale + 1.0) * (cond - uncond)
        return logits

    def forward_full(x, keep_BT, s):
        h, ks, vs = forward_layers(params, cfg, model_rows(x), pos_M, dup(keep_BT))
        return block_logits(cut(h, s)), KVCache(ks, vs)

    def forward_dual(x, keep_BT, s, cache):
        kv_fns = [lambda k, v, i=i: (put(cache.k[i], k, s), put(cache.v[i], v, s))
                  for i in range(cfg.n_layers)]
        h, ks, vs = forward_layers(params, cfg, cut(model_rows(x), s), cut(pos_M, s),
                                   dup(keep_BT), kv_fns)
        return block_logits(h), KVCache(ks, vs)

    def forward_prefix(x, keep_BT, s, cache):
        # Static query window [P, T): rows before s are computed and ignored; their keys come
        # from the cache, as do all keys before s (see DESIGN.md on static shapes).
        fresh = (col >= s)[None, :, None, None]
        mix = lambda c, new: jnp.where(fresh, c.at[:, P:].set(new), c)
        kv_fns = [lambda k, v, i=i: (mix(cache.k[i], k), mix(cache.v[i], v))
                  for i in range(cfg.n_layers)]
        h, _, _ = forward_layers(params, cfg, model_rows(x)[:, P:], pos_M[:, P:],
                                 dup(keep_BT), kv_fns)
        return block_logits(cut(h, s - P)), cache

    layer0, deeper = params.layers[0], params.layers[1:]
    cos_M, sin_M = rope_tables(pos_M, cfg.head_dim, cfg.rope_theta)

    def layer0_qkv(tok, cos, sin):
        x0 = params.embed[tok]
        return (x0, *qkv(rms_norm(x0, layer0.attn_norm, cfg.norm_eps), layer0, cfg, cos, sin))

    def exact_rest(x0, attn, keep_BT, s):
        """Layer 0 after its attention, then the deeper layers as usual."""
        h, _, _ = run_blocks(finish_block(x0, attn, layer0, cfg), deeper, cfg, cos_M, sin_M,
                             dup(keep_BT))
        return block_logits(cut(h, s))

    def forward_exact_fill(x, keep_BT, s):
        x0, q, k, v = layer0_qkv(model_rows(x), cos_M, sin_M)
        attn, fa = facache(q, k, v, dup(keep_BT), s, s + bl, mode="fill")
        return exact_rest(x0, attn, keep_BT, s), LaCache(x0, q, k, v, fa)

    def forward_exact_step(x, keep_BT, s, cache):
        fresh = layer0_qkv(cut(model_rows(x), s), cut(cos_M, s), cut(sin_M, s))
        x0, q, k, v = (put(c, n, s) for c, n in zip((cache.x0, cache.q, cache.k, cache.v), fresh))
        attn = facache(q, k, v, dup(keep_BT), s, s + bl, cache.fa, mode="reuse",
                       block_len=bl)
        return exact_rest(x0, attn, keep_BT, s), LaCache(x0, q, k, v, cache.fa)

    first_forward = forward_exact_fill if gen.cache == "exact" else forward_full

    def decode(st, logits, i, s, sched, step_keys):
        xb = cut(st["x"], s)
        masked = xb == gen.mask_id
        active = ~st["done"] & masked.any(-1)
        if gen.logits_eos_inf:
            logits = logits.at[..., gen.eos_id].set(-jnp.inf)
        k_sample = jax.vmap(lambda k: jax.random.fold_in(k, 0))(step_keys)
        k_conf = jax.vmap(lambda k: jax.random.fold_in(k, 1))(step_keys)
        x0 = sampling.sample(logits, gen.temperature, k_sample)
        conf_logits = (sampling.without_eos_eot(logits, gen.eos_id, gen.eot_id, gen.temperature)
                       if gen.confidence_eos_eot_inf else logits)
        conf = sampling.confidence(conf_logits, x0, gen.remasking, k_conf)
        k_fixed = None if gen.parallel else sched[:, jnp.minimum(i, sched.shape[1] - 1)]
        reveal = sampling.choose(conf, masked, k_fixed, gen.threshold, gen.factor)
        reveal &= active[:, None]
        x = put(st["x"], jnp.where(reveal, x0, xb), s)
        return {**st, "x": x, "nfe": st["nfe"] + active * (2 if use_cfg else 1),
                "steps": st["steps"] + active, "revealed": st["revealed"] + reveal.sum(-1)}

    def has_work(st, s):
        return (~st["done"] & (cut(st["x"], s) == gen.mask_id).any(-1)).any()

    def run_block(st):
        k = st["block"]
        s = P + k * bl
        block_keys = jax.vmap(lambda key: jax.random.fold_in(key, k))(keys_B)
        step_keys = lambda i: jax.vmap(lambda key: jax.random.fold_in(key, i))(block_keys)
        keep = valid_BT
        if gen.dpad is not None:
            keep &= sampling.dpad_keep(gen.dpad, dpad_block_keys(keys_B, k), s + bl, T)
        n_masked = (cut(st["x"], s) == gen.mask_id).sum(-1)
        sched = None if gen.parallel else sampling.transfer_schedule(n_masked, gen.steps_per_block)

        logits, cache = first_forward(st["x"], keep, s)
        st = decode(st, logits, 0, s, sched, step_keys(0))
        if gen.cache != "none":
            st["cache"] = cache

        def step_cond(carry):
            st, i = carry
            return (i < bl) & has_work(st, s)

        def step_body(carry):
            st, i = carry
            if gen.cache == "none":
                logits, _ = forward_full(st["x"], keep, s)
            elif gen.cache == "exact":
                logits, cache = forward_exact_step(st["x"], keep, s, st["cache"])
                st = {**st, "cache": cache}
            elif gen.cache == "prefix":
                logits, _ = forward_prefix(st["x"], keep, s, st["cache"])
            else:
                dual = lambda x, c: forward_dual(x, keep, s, c)
                if gen.refresh_interval is None:
                    logits, cache = dual(st["x"], st["cache"])
                else:
                    logits, cache = jax.lax.cond(
                        i % gen.refresh_interval == 0,
                        lambda x, c: forward_full(x, keep, s), dual, st["x"], st["cache"])
                st = {**st, "cache": cache}
            return decode(st, logits, i, s, sched, step_keys(i)), i + 1

        st, _ = jax.lax.while_loop(step_cond, step_body, (st, jnp.int32(1)))
        if gen.stop_at_eos:
            finished = ~st["done"] & (cut(st["x"], s) == gen.eos_id).any(-1)
            fill = finished[:, None] & (col[None, :] >= s + bl)
            st = {**st, "x": jnp.where(fill, gen.eos_id, st["x"]),
                  "done": st["done"] | finished}
        if report:
            jax.debug.callback(_block_done, k + 1)
        return {**st, "block": k + 1}

    zeros = jnp.zeros((B,), jnp.int32)
    st = {"x": x_BT, "done": jnp.zeros((B,), bool), "nfe": zeros, "steps": zeros,
          "revealed": zeros, "block": jnp.int32(0)}
    M = B * (2 if use_cfg else 1)  # model rows
    q_shape = (M, T, cfg.n_heads, cfg.head_dim)
    kv_shape = (M, T, cfg.n_kv_heads, cfg.head_dim)
    if gen.cache == "exact":
        empty = lambda shape, dtype=params.dtype: jnp.zeros(shape, dtype)
        st["cache"] = LaCache(
            empty((M, T, cfg.d_model)), empty(q_shape), empty(kv_shape), empty(kv_shape),
            FAState(empty((M, cfg.n_heads, T), jnp.float32),
                    empty((M, cfg.n_heads, T), jnp.float32), empty(q_shape, jnp.float32)))
    elif gen.cache != "none":
        st["cache"] = KVCache([jnp.zeros(kv_shape, params.dtype) for _ in params.layers],
                              [jnp.zeros(kv_shape, params.dtype) for _ in params.layers])
    st = jax.lax.while_loop(lambda st: (st["block"] < gen.num_blocks) & ~st["done"].all(),
                            run_block, st)
    gen_lengths = jnp.min(jnp.where(st["x"][:, P:] == gen.eos_id, jnp.arange(G), G), axis=-1)
    return GenerateOutput(tokens=st["x"], prompt_lengths=P - pad_B,
                          nfe=st["nfe"], steps=st["steps"], revealed=st["revealed"],
                          gen_lengths=gen_lengths)


def row_keys(key: jax.Array | None, B: int) -> jax.Array:
    """One key per row: `key` itself if it holds B keys, else fold_in(key, b)."""
    if key is None:
        key = jax.random.key(0)
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.dtype != jnp.uint32 or key.shape[-1:] != (2,):
            raise ValueError(f"key must be a JAX PRNG key (jax.random.key), got {key.dtype}"
                             f"{list(key.shape)}")
        key = jax.random.wrap_key_data(key)
    if key.shape == ():
        return jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(B))
    if key.shape != (B,):
        raise ValueError(f"key must be one key or one per row ({B}), got shape {key.shape}")
    return key


def _prompt_rows(prompts: Any, lengths: Any, cfg: ModelConfig,
                 gen: GenerationConfig) -> list[np.ndarray]:
    if isinstance(prompts, (list, tuple)) and lengths is None:
        if not prompts:
            raise ValueError("prompts is empty: give at least one prompt")
        rows = [np.asarray(p) for p in prompts]
        if any(r.ndim != 1 for r in rows):
            raise ValueError("prompts must be a list of token lists or an int array [B, P]")
    else:
        arr = np.asarray(prompts)
        if arr.ndim != 2:
            raise ValueError(f"prompts must be an int array [B, P], got shape {list(arr.shape)}")
        if lengths is None:
            rows = list(arr)
        else:
            lengths = np.asarray(lengths)
            if lengths.shape != (arr.shape[0],) or not np.issubdtype(lengths.dtype, np.integer):
                raise ValueError(f"prompt_lengths must be {arr.shape[0]} integers, got "
                                 f"{lengths.dtype}{list(lengths.shape)}")
            if (lengths > arr.shape[1]).any() or (lengths < 0).any():
                raise ValueError(f"prompt_lengths must lie in [0, {arr.shape[1]}]")
            rows = [arr[b, :n] for b, n in enumerate(lengths)]
        if not rows:
            raise ValueError("prompts is empty: give at least one prompt")
    for b, r in enumerate(rows):
        if r.size == 0:
            raise ValueError(f"prompts[{b}] is empty: every prompt needs at least one token")
        if not (np.issubdtype(r.dtype, np.integer)):
            raise ValueError(f"prompts[{b}] must hold integer token ids, got {r.dtype}")
        if r.min() < 0 or r.max() >= cfg.vocab_size:
            raise ValueError(f"prompts[{b}] has token ids outside [0, {cfg.vocab_size})")
        if (r == gen.mask_id).any():
            raise ValueError(f"prompts[{b}] contains the mask id {gen.mask_id} at position "
                             f"{int(np.argmax(r == gen.mask_id))}")
    return [r.astype(np.int32) for r in rows]
