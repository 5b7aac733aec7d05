"""Slot refill (`generate(..., slots=S)`, lacache_jax/slots.py): every row's output equals what
`generate` gives that prompt (fp32, per-row keys) in every cache mode, with fixed / threshold /
factor decoding, CFG, FP8 FFN and DPad; more prompts than slots, ragged prompts over two length
buckets, rows that stop at EOS blocks apart; per-row block starts; bad input."""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lacache_jax as lj
from kernels import cached_attention as ca
from lacache_jax import cache, sampling, slots
from lacache_jax.canvas import Canvas
from lacache_jax.generate import _slot_output
from tests.conftest import GEN_CFG as CFG
from tests.conftest import assert_valid_triton

G, BL, S = 32, 8, 3  # 4 blocks; 3 slots for 7-8 prompts
NB = G // BL
_rng = np.random.default_rng(0)
# Buckets 16 (lengths 10, 12) and 8: the program's canvas shrinks while rows are in flight.
TWO_BUCKETS = [_rng.integers(0, 300, n).tolist() for n in (3, 12, 5, 8, 10, 4, 7, 6)]
ONE_BUCKET = [p for p in TWO_BUCKETS if len(p) <= 8] + [_rng.integers(0, 300, 8).tolist()]


def _gen(**kw):
    return lj.GenerationConfig(**{**dict(gen_length=G, block_length=BL, steps=G), **kw})


def _finish_blocks(out) -> np.ndarray:
    """Blocks each row decoded: up to the block holding its first EOS, else all."""
    return np.minimum(np.asarray(out.gen_lengths) // BL + 1, NB)


def _assert_same(got, want):
    for field in ("tokens", "prompt_lengths", "nfe", "steps", "revealed", "gen_lengths"):
        np.testing.assert_array_equal(np.asarray(getattr(got, field)),
                                      np.asarray(getattr(want, field)), err_msg=field)


@pytest.fixture(scope="module")
def eos_id(models):
    """A token the plain run emits in the first block of many rows and never in as many
    others: as EOS it ends rows blocks apart (each case checks that it still does)."""
    params, _ = models
    out = lj.generate(params, CFG, TWO_BUCKETS, _gen(stop_at_eos=False, steps=16))
    gen_part = np.asarray(out.tokens)[:, -G:]
    best, score = None, 0
    for t in np.unique(gen_part):
        first = np.array([np.argmax(r == t) // BL if (r == t).any() else NB for r in gen_part])
        if min((first == 0).sum(), (first == NB).sum()) > score:
            best, score = int(t), min((first == 0).sum(), (first == NB).sum())
    assert best is not None
    return best


def _spy(monkeypatch, Q=None) -> list:
    """The slots at the start of each program call, call by call (with a queue of Q prompts
    when given)."""
    seen, real = [], slots._slot_run

    def spy(params, cfg, gen, impl, mesh, sl, *rest):
        seen.append(dict(T=sl.x_BT.shape[1], block=np.array(sl.block_B),
                         live=np.array(sl.live_B)))
        return real(params, cfg, gen, impl, mesh, sl, *rest)
    monkeypatch.setattr(slots, "_slot_run", spy)
    if Q is not None:
        monkeypatch.setattr(slots, "queue_size", lambda S: Q)
    return seen


@pytest.fixture
def calls(monkeypatch):
    """The program calls with a queue of one prompt: each call admits one prompt, so the
    slots seen are those of every admission."""
    return _spy(monkeypatch, Q=1)


CASES = {
    "none_fixed_two_buckets": (dict(steps=16), TWO_BUCKETS),
    "exact_threshold_cfg": (dict(cache="exact", threshold=0.9, cfg_scale=1.0), ONE_BUCKET),
    "prefix_factor": (dict(cache="prefix", factor=1.0), ONE_BUCKET),
    "dual_threshold_dpad_sampled": (dict(cache="dual", threshold=0.7, temperature=1.0,
                                         dpad=lj.DPadConfig(window=12)), ONE_BUCKET),
}


@pytest.mark.parametrize("case", list(CASES))
def test_slots_equal_generate(models, eos_id, calls, case):
    """N > S prompts through S slots against one static `generate` batch of all of them (a
    row of which is the prompt alone: tests/test_generate.py); with per-row keys, so sampled
    tokens and DPad draws must follow each row through its slot and blocks."""
    params, _ = models
    kw, prompts = CASES[case]
    gen = _gen(eos_id=eos_id, **kw)
    keys = jax.random.split(jax.random.key(2), len(prompts))
    want = lj.generate(params, CFG, prompts, gen, key=keys)
    done = []
    got = lj.generate(params, CFG, prompts, gen, key=keys, slots=S,
                      progress=lambda n, total: done.append((n, total)))
    _assert_same(got, want)
    assert got.answers(G) == want.answers(G)
    # Not vacuous: rows stop blocks apart (one in its first block, one runs all four), slots
    # are refilled, and the slots hold rows at different blocks at once.
    blocks = _finish_blocks(want)
    assert blocks.min() == 1 and blocks.max() == NB
    assert len(calls) > NB and any(len(set(c["block"][c["live"]])) > 1 for c in calls)
    assert done[-1] == (len(prompts), len(prompts)) and len(done) > 1
    if prompts is TWO_BUCKETS:  # the canvas shrank from bucket 16 to 8 with rows in flight
        widths = [c["T"] for c in calls]
        assert widths[0] == 16 + G and widths[-1] == 8 + G and widths == sorted(widths)[::-1]


def test_slot_row_equals_the_prompt_alone(models, eos_id):
    """The guarantee taken literally for two prompts: sampled tokens, DPad and EOS, each
    generated alone with its own key."""
    params, _ = models
    gen = _gen(eos_id=eos_id, **CASES["dual_threshold_dpad_sampled"][0])
    keys = jax.random.split(jax.random.key(2), len(ONE_BUCKET))
    got = lj.generate(params, CFG, ONE_BUCKET, gen, key=keys, slots=S)
    P = max(map(len, ONE_BUCKET))
    for b in (len(ONE_BUCKET) - 1, ONE_BUCKET.index(TWO_BUCKETS[3])):  # the two of length 8
        alone = lj.generate(params, CFG, [ONE_BUCKET[b]], gen, key=keys[b:b + 1])
        np.testing.assert_array_equal(np.asarray(got.tokens[b, P - 8:]),
                                      np.asarray(alone.tokens[0]))
        for field in ("nfe", "steps", "revealed", "gen_lengths"):
            assert int(getattr(got, field)[b]) == int(getattr(alone, field)[0]), field


@pytest.mark.parametrize("refill", [True, False], ids=["refill", "static_batches"])
@pytest.mark.parametrize("Q", [None, S], ids=["queue_4S", "queue_S"])
def test_queue_sizes_and_static_batches(models, eos_id, monkeypatch, refill, Q):
    """The default queue (4S prompts: all of them queued in the first call) and a queue of S
    (calls that admit several prompts over several blocks, then leave for the next queue),
    with refill and with refill off (benchmarks' static batches: admitted only when every
    slot is free, in input order), against `generate`, over two buckets."""
    params, _ = models
    gen = _gen(eos_id=eos_id, steps=16)
    keys = jax.random.split(jax.random.key(2), len(TWO_BUCKETS))
    want = lj.generate(params, CFG, TWO_BUCKETS, gen, key=keys)
    calls = _spy(monkeypatch, Q)
    rows = [np.asarray(p, np.int32) for p in TWO_BUCKETS]
    out = slots.run(params, CFG, gen.resolve(CFG), rows, keys, S, refill=refill)
    _assert_same(_slot_output(out, rows, gen, CFG), want)
    widths = [(c["T"] - G, int(c["live"].sum())) for c in calls]
    apart = [len(set(c["block"][c["live"]])) > 1 for c in calls]
    if refill:  # the canvas narrows (16 -> 8) with rows in flight
        assert widths[0] == (16, 0) and any(w == 8 and live for w, live in widths), widths
    if Q is None and not refill:  # batches [3, 12, 5] and [8, 10, 4] at 16, then [7, 6] at 8
        assert [w for w, _ in widths] == [16, 8], widths
    if Q == S:  # refill starts a row while others are blocks into theirs; static never does
        assert any(apart) if refill else not any(apart)


def test_compiled_programs_serve_refill_and_static(models, eos_id, monkeypatch):
    """compile_generate's programs over two buckets, a queue of S: slot refill and static
    batches both run on them alone (the jitted program is never called) and give
    `generate`'s tokens."""
    params, _ = models
    gen = _gen(eos_id=eos_id, steps=16)
    keys = jax.random.split(jax.random.key(2), len(TWO_BUCKETS))
    want = lj.generate(params, CFG, TWO_BUCKETS, gen, key=keys)
    monkeypatch.setattr(slots, "queue_size", lambda S: S)
    run = lj.compile_generate(params, CFG, TWO_BUCKETS, gen, key=keys, slots=S)
    assert set(run.programs) == {8, 16}

    def not_compiled(*args, **kwargs):
        raise AssertionError("compiled inside the run")
    monkeypatch.setattr(slots, "_slot_run", not_compiled)
    _assert_same(run(), want)
    rows = [np.asarray(p, np.int32) for p in TWO_BUCKETS]
    out = slots.run(params, CFG, gen.resolve(CFG), rows, keys, S, refill=False,
                    programs=run.programs)
    _assert_same(_slot_output(out, rows, gen, CFG), want)


def test_block_limits_end_rows_early(models, eos_id):
    """Benchmarks' stop rule: row i ends after block_limits[i] blocks (at least one), its
    decoded blocks those of `generate`, the rest still masks (unless EOS ended it first)."""
    params, _ = models
    gen = _gen(eos_id=eos_id, steps=16)
    keys = jax.random.split(jax.random.key(2), len(TWO_BUCKETS))
    want = lj.generate(params, CFG, TWO_BUCKETS, gen, key=keys)
    rows = [np.asarray(p, np.int32) for p in TWO_BUCKETS]
    limits = np.array([0, 1, 2, 3, 4, 9, 1, 2])
    out = slots.run(params, CFG, gen.resolve(CFG), rows, keys, S, block_limits=limits)
    ends = _finish_blocks(want)
    want_gen = np.asarray(want.tokens)[:, -G:]
    for i, k in enumerate(np.clip(limits, 1, NB)):
        np.testing.assert_array_equal(out.generated[i, :k * BL], want_gen[i, :k * BL])
        rest = out.generated[i, k * BL:]
        assert (rest == want_gen[i, k * BL:]).all() if ends[i] <= k else (
            rest == CFG.mask_id).all(), i
    assert (ends > np.clip(limits, 1, NB)).any()  # some rows were cut short


def test_fp8_ffn_through_compile_generate():
    """FP8 FFN under the dual cache, five ragged prompts through two slots, through
    compile_generate's precompiled programs."""
    cfg8 = lj.tiny(d_model=128, d_ff=256, n_heads=4, n_kv_heads=2)
    params = lj.quantize_ffn(lj.init_params(cfg8, jax.random.key(0), jnp.float32))
    prompts = [[5, 6, 7], list(range(20, 28)), [9] * 5, [40, 41], list(range(50, 56))]
    gen = _gen(cache="dual", fp8_ffn=True, steps=16)
    want = lj.generate(params, cfg8, prompts, gen, key=jax.random.key(4))
    run = lj.compile_generate(params, cfg8, prompts, gen, key=jax.random.key(4), slots=2)
    assert set(run.programs) == {8} and run.compiled is run.programs[8]
    _assert_same(run(), want)


def test_per_row_block_starts_equal_scalar_ones():
    """Canvas cut/put and DPad's kept set at one block start per row equal the scalar-start
    versions applied row by row (model rows under CFG repeat their row's start)."""
    cv = types.SimpleNamespace(block_len=4)
    dpad = lj.DPadConfig(window=6)
    blocks = jnp.array([0, 2, 1])

    @jax.jit
    def per_row_and_scalar(a, new, s, keys):
        rows = [(Canvas.cut(cv, a[r:r + 1], s[r % 3])[0],
                 Canvas.put(cv, a[r:r + 1], new[:1], s[r % 3])[0]) for r in range(6)]
        kept = [sampling.dpad_keep(dpad, sampling.dpad_block_keys(keys[r:r + 1], blocks[r]),
                                   s[r] + 4, 20)[0] for r in range(3)]
        return ((Canvas.cut(cv, a, s), Canvas.put(cv, a, new, s),
                 sampling.dpad_keep(dpad, sampling.dpad_block_keys(keys, blocks), s + 4, 20)),
                (jnp.stack([c for c, _ in rows]), jnp.stack([p for _, p in rows]),
                 jnp.stack(kept)))
    a = jnp.arange(2 * 3 * 12).reshape(6, 12)  # 6 model rows = 2 x 3 rows (CFG)
    s = jnp.array([0, 5, 8])
    got, want = per_row_and_scalar(a, -jnp.ones((6, 4), a.dtype), s,
                                   jax.random.split(jax.random.key(0), 3))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    kept = np.asarray(got[2])
    for r in range(3):
        assert kept[r, :int(s[r]) + 4].all() and not kept[r, int(s[r]) + 10:].any()
    assert not kept.all()


def test_facache_per_row_bounds_pallas(monkeypatch):
    """FACache with one block per row runs the Pallas kernel vmapped (interpret mode here):
    reuse from the reference's fill state equals the reference row by row, and the batched
    fill and reuse kernels lower to valid Triton for CUDA."""
    B, L, H, Gk, K = 2, 32, 2, 1, 16
    k0, k1, k2 = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(k0, (B, L, H, K))
    k, v = jax.random.normal(k1, (B, L, Gk, K)), jax.random.normal(k2, (B, L, Gk, K))
    mask = jnp.ones((B, L), bool).at[1, :3].set(False)
    starts = (3, 17)
    s = jnp.array(starts)

    @jax.jit
    def batched_and_rows(q, k, v, mask):
        rows = [ca.cached_attention_ref(q[b:b + 1], k[b:b + 1], v[b:b + 1], mask[b:b + 1],
                                        starts[b], starts[b] + 8, mode="fill")[0]
                for b in range(B)]
        return cache.facache(q, k, v, mask, s, s + 8, mode="fill"), jnp.concatenate(rows)
    (want, state), rows = batched_and_rows(q, k, v, mask)  # the CPU reference
    # vmapped and plain fp32 einsums may sum in another order: a few ulps.
    np.testing.assert_allclose(want, rows, atol=1e-6)
    kernel = functools.partial(ca.cached_attention_pallas, block_q=16, block_k=16,
                               interpret=True)
    monkeypatch.setattr(cache, "cached_attention", kernel)
    got = jax.jit(lambda *a: cache.facache(*a, mode="reuse", block_len=8))(
        q, k, v, mask, s, s + 8, state)
    # fp32 online softmax in tiles (the block's keys split over programs) vs the dense
    # reference: a few ulps of O(1) values.
    np.testing.assert_allclose(got, want, atol=2e-6)
    gpu = functools.partial(ca.cached_attention_pallas, block_q=16, block_k=16)
    monkeypatch.setattr(cache, "cached_attention", gpu)
    assert_valid_triton(lambda *a: cache.facache(*a, mode="fill"), q, k, v, mask, s, s + 8)
    assert_valid_triton(lambda *a: cache.facache(*a, mode="reuse", block_len=8), q, k, v, mask,
                        s, s + 8, state, n_kernels=2)


def test_bucket():
    assert [slots.bucket(n, 1000) for n in (1, 8, 9, 16, 17, 600)] == [8, 8, 16, 16, 32, 1000]
    assert slots.bucket(600, 700) == 700  # capped at max_seq_len - gen_length


def test_bad_slots(models, monkeypatch):
    params, _ = models
    gen = _gen()
    for bad in (0, -2, True, 1.5, "4"):
        with pytest.raises(ValueError, match="slots must be a positive integer"):
            lj.generate(params, CFG, [[1, 2]], gen, slots=bad)
        with pytest.raises(ValueError, match="slots must be a positive integer"):
            lj.compile_generate(params, CFG, [[1, 2]], gen, slots=bad)
    flash = lj.GenerationConfig(gen_length=8, threshold=0.5,
                                flash=lj.FlashConfig(window=4, lookahead=2, track=3))
    for fn in (lj.generate, lj.compile_generate):
        with pytest.raises(ValueError, match="slot refill with gen.flash runs on one device"):
            fn(params, CFG, [[1, 2]], flash, slots=2, mesh=lj.make_mesh(1, 1))
    with monkeypatch.context() as m:
        m.setattr(jax, "process_count", lambda: 2)
        with pytest.raises(ValueError, match="slot refill with a mesh runs on one host"):
            lj.generate(params, CFG, [[1, 2]], gen, slots=2, mesh=lj.make_mesh(1, 1))
    with pytest.raises(ValueError, match=r"prompts\[1\] contains the mask id"):
        lj.generate(params, CFG, [[1, 2], [CFG.mask_id]], gen, slots=2)
    with pytest.raises(ValueError, match=r"key must be one key or one per row \(2\)"):
        lj.generate(params, CFG, [[1], [2]], gen, slots=1,
                    key=jax.random.split(jax.random.key(0), 3))
