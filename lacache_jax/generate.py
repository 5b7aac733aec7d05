"""Host side of generation: validation, padding, compilation, output.

`generate` checks every argument (ValueError naming it, before anything compiles), left-pads
the prompts into a canvas [B, P + gen_length] (canvas.py), compiles one program per
configuration and runs the SAR loop (sar.py) in it, then returns a `GenerateOutput`. The loop's
pieces, cache policies (cache.py), reveal rules (sampling.py) and step strategies (sar.py),
are chosen from `GenerationConfig` by name. With `slots=S` the prompts go through S rows in
flight instead, a finished row's slot taking the next prompt (slots.py).
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
from jax.sharding import PartitionSpec as PS

from lacache_jax import flash, sar
from lacache_jax import slots as slot_refill
from lacache_jax.config import GenerationConfig, ModelConfig
from lacache_jax.model import Params, check_params
from lacache_jax.quant import has_fp8_ffn
from lacache_jax.sharding import DATA, shard_params, tracing_under


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GenerateOutput:
    tokens: jax.Array          # [B, T] canvas (T = P + gen_length); prompts left-padded with pad_id
    prompt_lengths: jax.Array  # [B] real prompt tokens per row
    nfe: jax.Array             # [B] forward passes the row took part in (CFG counts two)
    steps: jax.Array           # [B] decoding steps the row took part in
    revealed: jax.Array        # [B] tokens the sampler revealed (not the EOS fill)
    gen_lengths: jax.Array     # [B] generated tokens before the first EOS
    # the run's gen_length (generate sets it; 0: not known, answers() then needs it)
    gen_length: int = dataclasses.field(default=0, metadata=dict(static=True))

    @property
    def tokens_per_step(self) -> jax.Array:
        return self.revealed / jnp.maximum(self.steps, 1)

    def answers(self, gen_length: int | None = None) -> list[list[int]]:
        """Each row's generated tokens up to (not including) its first EOS. `gen_length`, if
        given, must be the run's (it was once required)."""
        if gen_length is not None and self.gen_length and gen_length != self.gen_length:
            raise ValueError(f"answers({gen_length}): this output has gen_length "
                             f"{self.gen_length}")
        gen_length = gen_length or self.gen_length
        if not gen_length:
            raise ValueError("answers(gen_length): this output does not know its gen_length")
        toks, lens = np.asarray(self.tokens), np.asarray(self.gen_lengths)
        start = toks.shape[1] - gen_length
        return [toks[b, start:start + lens[b]].tolist() for b in range(toks.shape[0])]


def generate(params: Params, config: ModelConfig, prompts: Any, gen: GenerationConfig,
             key: jax.Array | None = None, prompt_lengths: Any = None,
             mesh: jax.sharding.Mesh | None = None,
             progress: Callable[[int, int], None] | None = None,
             slots: int | None = None) -> GenerateOutput:
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
    `slots=S`: slot refill. At most S rows are in flight (with `mesh`, S rounded up to a
    multiple of its data axis); when a row finishes (EOS with
    `stop_at_eos`, or its last block) its slot takes the next prompt, so a short answer never
    waits for a long one. Any number of prompts; the output is the same (rows in input order,
    every row's tokens those of `generate` without slots). One program is compiled per
    bucket of prompt lengths (powers of two: slots.py); `progress(rows_done, B)` is then called
    on the host after each program call that ended rows (a call admits up to 4S prompts; the
    queue lives on the device, so rows end between calls unseen). With `mesh` the slots split
    over its data axis (one host; `gen.flash` with a mesh is refused).
    Every invalid argument raises ValueError before anything is compiled.
    """
    if slots is not None:
        params, gen, rows, keys = _validate(params, config, prompts, gen, key, prompt_lengths,
                                            mesh, slots)
        return _slot_output(slot_refill.run(params, config, gen, rows, keys, slots,
                                            progress=progress, mesh=mesh), rows, gen, config)
    params, gen, B, *args = _prepare(params, config, prompts, gen, key, prompt_lengths, mesh)
    if progress is None:
        return _rows(_generate(params, config, gen, mesh, False, *args), B)
    with _reporting(progress, gen.num_blocks):
        return jax.block_until_ready(_rows(_generate(params, config, gen, mesh, True, *args), B))


def compile_generate(params: Params, config: ModelConfig, prompts: Any, gen: GenerationConfig,
                     key: jax.Array | None = None, prompt_lengths: Any = None,
                     mesh: jax.sharding.Mesh | None = None,
                     progress: Callable[[int, int], None] | None = None,
                     slots: int | None = None):
    """Compile ahead of time; returns `run() -> GenerateOutput`, the same computation as
    `generate(...)` with these arguments, so benchmarks can time it without compilation.
    `run.compiled` is the `jax.stages.Compiled` program (`run.compiled.as_text()`: the
    optimised HLO, for profiles and copy counts). With `slots`, `run.programs` maps each
    bucket of prompt lengths to its compiled slot program and `run.compiled` is the
    largest bucket's."""
    if slots is not None:
        params, gen, rows, keys = _validate(params, config, prompts, gen, key, prompt_lengths,
                                            mesh, slots)
        programs = slot_refill.compile_programs(params, config, gen, rows, keys, slots, mesh)

        def run_slots():
            out = slot_refill.run(params, config, gen, rows, keys, slots, programs=programs,
                                  progress=progress, mesh=mesh)
            return _slot_output(out, rows, gen, config)
        run_slots.programs = programs
        top = programs[max(programs)]
        run_slots.compiled = getattr(top, "chunk", top)  # flash: its until-finish program
        return run_slots
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


def _validate(params, config, prompts, gen, key, prompt_lengths, mesh=None, slots=None):
    """Validate everything; returns (params with FP8 FFN copies kept only for `fp8_ffn`,
    placed on `mesh` when there is one, resolved gen, prompt rows, keys [B])."""
    if slots is not None:
        if isinstance(slots, bool) or not isinstance(slots, (int, np.integer)) or slots < 1:
            raise ValueError(f"slots must be a positive integer, got {slots!r}")
    if not isinstance(gen, GenerationConfig):
        raise ValueError(f"gen must be a GenerationConfig, got {type(gen).__name__}")
    gen = gen.resolve(config)
    if slots is not None and mesh is not None and gen.flash is not None:
        raise ValueError(slot_refill.FLASH_MESH_REFUSED)
    if slots is not None and mesh is not None and jax.process_count() > 1:
        # the host reads the slots back whenever the canvas narrows (slots.py)
        raise ValueError("slot refill with a mesh runs on one host: pass no slots, or a "
                         "mesh of this host's devices in a single-process run")
    rows = _prompt_rows(prompts, prompt_lengths, config, gen)
    B, P = len(rows), max(len(r) for r in rows)
    if P + gen.gen_length > config.max_seq_len:
        raise ValueError(f"prompt length {P} + gen_length {gen.gen_length} exceeds the model's "
                         f"max_seq_len={config.max_seq_len}")
    check_params(params, config)
    if gen.fp8_ffn and not has_fp8_ffn(params):
        raise ValueError("fp8_ffn=True needs FP8 FFN weights: params = lj.quantize_ffn(params)")
    if not gen.fp8_ffn:
        params = dataclasses.replace(
            params, layers=[dataclasses.replace(layer, ffn8=None) for layer in params.layers])
    if mesh is not None:
        params = shard_params(params, config, mesh)
    return params, gen, rows, row_keys(key, B)


def _prepare(params, config, prompts, gen, key, prompt_lengths, mesh=None):
    """Validate everything; returns (params with FP8 FFN copies kept only for `fp8_ffn`,
    resolved gen, B, canvas [B', T], left padding [B'] (None where no row is padded:
    `left_padding`), keys [B']), B' = B rounded up to the mesh's data axis, the arrays placed
    on the mesh when there is one."""
    params, gen, rows, keys = _validate(params, config, prompts, gen, key, prompt_lengths, mesh)
    B, P = len(rows), max(len(r) for r in rows)
    if mesh is not None:
        extra = -B % mesh.shape[DATA]  # copies of the last row: each row is independent
        rows += [rows[-1]] * extra
        keys = jnp.concatenate([keys, jnp.repeat(keys[-1:], extra, axis=0)])
    x = np.full((len(rows), P + gen.gen_length), gen.mask_id, np.int32)
    pad = np.array([P - len(r) for r in rows], np.int32)
    for b, r in enumerate(rows):
        x[b, :pad[b]] = config.pad_id
        x[b, pad[b]:P] = r
    # No row padded: None, and the trace gets host zeros (`Canvas.keeps_all`).
    x, pad = jnp.asarray(x), (jnp.asarray(pad) if pad.any() else None)
    if mesh is not None:
        x, pad, keys = jax.device_put((x, pad, keys), NamedSharding(mesh, PS(DATA)))
    return params, gen, B, x, pad, keys


@functools.partial(jax.jit, static_argnames=("cfg", "gen", "mesh", "report"))
def _generate(params: Params, cfg: ModelConfig, gen: GenerationConfig, mesh, report: bool, x_BT,
              pad_B, keys_B):
    pad_B = left_padding(pad_B, x_BT.shape[0])
    with tracing_under(mesh):
        loop = sar.run if gen.flash is None else flash.run  # Flash-dLLM has its own loop
        st = loop(params, cfg, gen, x_BT, pad_B, keys_B, _block_done if report else None)
        return _output(st, gen, pad_B)


def left_padding(pad_B, B: int):
    """`_prepare`'s padding as the loop takes it: None (no row padded) as host zeros, which
    tell the trace so (`Canvas.keeps_all`)."""
    return np.zeros(B, np.int32) if pad_B is None else pad_B


def _slot_output(out: slot_refill.Outputs, rows: list[np.ndarray], gen: GenerationConfig,
                 cfg: ModelConfig) -> GenerateOutput:
    """The slot scheduler's per-prompt results as `generate`'s output: prompts left-padded to
    the longest."""
    P = max(len(r) for r in rows)
    x = np.full((len(rows), P + gen.gen_length), cfg.pad_id, np.int32)
    for b, r in enumerate(rows):
        x[b, P - len(r):P] = r
    x[:, P:] = out.generated
    is_eos = out.generated == gen.eos_id
    gen_lengths = np.where(is_eos.any(-1), is_eos.argmax(-1), gen.gen_length).astype(np.int32)
    return GenerateOutput(
        tokens=jnp.asarray(x), prompt_lengths=jnp.asarray([len(r) for r in rows], jnp.int32),
        nfe=jnp.asarray(out.nfe), steps=jnp.asarray(out.steps),
        revealed=jnp.asarray(out.revealed), gen_lengths=jnp.asarray(gen_lengths),
        gen_length=gen.gen_length)


def _output(st: sar.LoopState, gen: GenerationConfig, pad_B) -> GenerateOutput:
    P = st.x_BT.shape[1] - gen.gen_length
    is_eos = st.x_BT[:, P:] == gen.eos_id
    gen_lengths = jnp.min(jnp.where(is_eos, jnp.arange(gen.gen_length), gen.gen_length), -1)
    return GenerateOutput(tokens=st.x_BT, prompt_lengths=jnp.asarray(P - pad_B), nfe=st.nfe_B,
                          steps=st.steps_B, revealed=st.revealed_B, gen_lengths=gen_lengths,
                          gen_length=gen.gen_length)


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
