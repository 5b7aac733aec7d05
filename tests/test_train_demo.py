"""The demo model's training code on CPU: the objective, a short run that learns, export."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lacache_jax as lj
from benchmarks import arith, tasks, train_demo
from convert.__main__ import main as convert_main


def test_batch_layout(tmp_path):
    arith.write_tokenizer(tmp_path)
    from lacache_jax.tokenizer import Tokenizer
    tok = Tokenizer(tmp_path)
    cfg = train_demo.demo_config()
    tokens, pad = train_demo.encode_batch([(407, 96), (99999, 99999)], tok.encode, cfg.eos_id)
    P = train_demo.PROMPT_LEN
    assert tokens.shape == (2, P + train_demo.GEN_LEN)
    assert tok.decode(tokens[0, pad[0]:P].tolist()) == arith.prompt_text(407, 96)
    answer = tok.decode(tokens[0, P:].tolist())
    assert answer.startswith(arith.answer_text(407, 96) + arith.EOS)
    assert arith.check(407, 96, answer)
    assert pad[1] == P - 14 and (tokens[:, :P] != cfg.mask_id).all()  # longest prompt: 14


def test_loss_only_counts_masked_answer_tokens():
    cfg = train_demo.demo_config(n_layers=1, d_model=64, d_ff=128, n_heads=2, n_kv_heads=2)
    params = lj.init_params(cfg, jax.random.key(0), jnp.float32)
    tokens = jnp.full((2, train_demo.PROMPT_LEN + train_demo.GEN_LEN), 5, jnp.int32)
    pad = jnp.array([0, 3])
    loss = train_demo.sft_loss(params, cfg, tokens, pad, jax.random.key(1))
    assert np.isfinite(float(loss)) and float(loss) > 0
    grads = jax.grad(train_demo.sft_loss)(params, cfg, tokens, pad, jax.random.key(1))
    assert float(jnp.abs(grads.layers[0].w_down).sum()) > 0


def test_loss_is_the_models_forward_pass():
    """sft_loss runs the blocks itself (for its own embedding lookup): in fp32 it must be the
    model's forward_hidden + lm_head exactly, the same ops in the same order."""
    cfg = train_demo.demo_config(n_layers=2, d_model=64, d_ff=128, n_heads=2, n_kv_heads=2)
    params = lj.init_params(cfg, jax.random.key(0), jnp.float32)
    T, P = train_demo.PROMPT_LEN + train_demo.GEN_LEN, train_demo.PROMPT_LEN
    tokens = jax.random.randint(jax.random.key(2), (3, T), 0, cfg.mask_id)
    pad, key = jnp.array([0, 2, 5]), jax.random.key(1)
    loss = train_demo.sft_loss(params, cfg, tokens, pad, key)
    # The same objective spelled out on the model's own forward pass.
    col = jnp.arange(T)
    t = jax.random.uniform(jax.random.fold_in(key, 0), (3, 1))
    p_mask = (1 - train_demo.EPS) * t + train_demo.EPS
    masked = (col >= P) & (jax.random.uniform(jax.random.fold_in(key, 1), (3, T)) < p_mask)
    hidden = lj.model.forward_hidden(params, cfg, jnp.where(masked, cfg.mask_id, tokens),
                                     col[None] >= pad[:, None],
                                     jnp.maximum(col[None] - pad[:, None], 0))
    ce = optax.softmax_cross_entropy_with_integer_labels(
        lj.model.lm_head(params, cfg, hidden), tokens)
    want = (jnp.where(masked, ce / p_mask, 0.0) / (T - P)).sum() / 3
    assert float(loss) == float(want)


def test_half_precision_embedding_lookup_is_exact_and_its_gradient_sums_in_fp32():
    """bf16 lookups take their gradient as a one-hot product (no scatter-add): the fp32 sum of
    each row's contributions rounded once to bf16, so within bf16's unit roundoff (2^-8 relative)
    of the exact sum, where XLA's bf16 scatter-add misses that bound (checked below)."""
    embed = jax.random.normal(jax.random.key(0), (48, 64)).astype(jnp.bfloat16)
    tokens = jax.random.randint(jax.random.key(1), (4, 150), 0, 48)
    got = train_demo.embed_lookup(embed, tokens)
    assert got.dtype == jnp.bfloat16 and (got == embed[tokens]).all()
    g = jax.random.normal(jax.random.key(2), (4, 150, 64))
    grad = jax.grad(lambda e: (train_demo.embed_lookup(e, tokens).astype(jnp.float32)
                               * g).sum())(embed)
    # The cotangent reaching a bf16 activation is bf16: the exact sum of those.
    exact = jnp.zeros((48, 64)).at[tokens].add(g.astype(jnp.bfloat16).astype(jnp.float32))
    excess = lambda grad: float(jnp.max(jnp.abs(grad.astype(jnp.float32) - exact)
                                        - 2.0**-8 * jnp.abs(exact)))
    assert excess(grad) <= 0
    scatter = jax.grad(lambda e: (e[tokens].astype(jnp.float32) * g).sum())(embed)
    assert excess(scatter) > 0
    assert (train_demo.embed_lookup(embed.astype(jnp.float32), tokens)
            == embed.astype(jnp.float32)[tokens]).all()


def test_short_training_run_learns_and_exports(tmp_path):
    cfg = train_demo.demo_config(n_layers=2, d_model=64, d_ff=128, n_heads=2, n_kv_heads=2)
    params, losses, _ = train_demo.train(cfg, steps=60, batch=16, lr=3e-3, progress=False)
    # Chance level over 32 tokens is ln 32 = 3.47 per masked token; the EOS padding and the
    # fixed scratchpad format are learnt within a few dozen steps.
    assert losses[-1] < 0.6 * losses[0]
    from convert import export_hf
    export_hf(tmp_path / "hf", cfg, params, dtype=jnp.bfloat16)
    arith.write_tokenizer(tmp_path / "hf")
    assert convert_main([str(tmp_path / "hf"), str(tmp_path / "ck"), "--quiet"]) == 0
    assert (tmp_path / "ck" / "tokenizer.json").is_file() and lj.load(tmp_path / "ck")[0] == cfg
    # --init: training goes on from the exported (bf16-rounded) weights, at the trained
    # loss rather than the first step's; another task's or another size's model is refused.
    arith_task = tasks.get("arith")
    init = train_demo.load_init(tmp_path / "hf", cfg, arith_task)
    rounded = jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32), params)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), init, rounded))
    _, more, _ = train_demo.train(cfg, steps=2, batch=16, lr=3e-3, progress=False, seed=1,
                                  init=init)
    assert more[0] < 0.6 * losses[0], (more, losses)
    with pytest.raises(ValueError, match="its model is not the arith task's"):
        train_demo.load_init(tmp_path / "hf", dataclasses.replace(cfg, n_layers=1), arith_task)
    with pytest.raises(ValueError, match="its tokenizer is not the chain-d2m task's"):
        train_demo.load_init(tmp_path / "hf", cfg, tasks.get("chain-d2m"))


def test_accuracy_harness_plumbing(tmp_path):
    """On an untrained model the numbers mean nothing; the harness must still run every kind
    of mode and compare lossless ones with their baselines."""
    from benchmarks import accuracy
    from lacache_jax.tokenizer import Tokenizer
    cfg = train_demo.demo_config(n_layers=1, d_model=64, d_ff=128, n_heads=2, n_kv_heads=2)
    params = lj.init_params(cfg, jax.random.key(0), jnp.float32)
    arith.write_tokenizer(tmp_path)
    tok = Tokenizer(tmp_path)
    problems = arith.sample("test", 4, seed=0)
    base = accuracy.evaluate(params, cfg, tok, problems, accuracy.MODES["fixed"][0])
    exact = accuracy.evaluate(params, cfg, tok, problems, accuracy.MODES["exact"][0])
    par = accuracy.evaluate(params, cfg, tok, problems, accuracy.MODES["threshold+dpad+dual"][0])
    assert (exact["tokens"] == base["tokens"]).all()
    for r in (base, exact, par):  # the harness's score, recomputed from its tokens
        gen_part = r["tokens"][:, -train_demo.GEN_LEN:]
        answers = [row[:int(np.argmax(row == cfg.eos_id))] if (row == cfg.eos_id).any() else row
                   for row in gen_part]
        correct = sum(arith.check(*p, tok.decode(a.tolist())) for p, a in zip(problems, answers))
        assert r["correct"] == correct and r["accuracy"] == correct / len(problems)
    # The fixed schedule reveals one token per step (steps = gen_length) and stops rows at EOS;
    # a step whose sampled token is the mask id reveals nothing (this untrained model samples
    # it: the position stays masked), so tokens per step is at most 1.
    assert 0 < base["tokens_per_step"] <= 1.0 and 1 <= base["nfe"] <= train_demo.GEN_LEN


def test_wilson_interval_solves_the_score_equation():
    """The Wilson bounds are the p at which the score statistic equals z:
    (p_hat - p)^2 = z^2 p (1 - p) / n. Checked by bisection, independently of the closed form."""
    import statistics


    from benchmarks import accuracy
    z = accuracy.Z95
    assert z == pytest.approx(statistics.NormalDist().inv_cdf(0.975), abs=1e-12)
    for correct, n in [(0, 10), (3, 10), (10, 10), (1, 1), (480, 500), (250, 500)]:
        lo, hi = accuracy.wilson(correct, n)
        ph = correct / n
        f = lambda p: (ph - p) ** 2 - z * z * p * (1 - p) / n

        def root(a, b):  # f changes sign on [a, b]
            for _ in range(200):
                m = (a + b) / 2
                a, b = (m, b) if (f(m) > 0) == (f(a) > 0) else (a, m)
            return (a + b) / 2
        # Bisection converges to 1e-15 here; the closed form's rounding is of that order too.
        assert lo == (0.0 if correct == 0 else pytest.approx(root(0.0, ph), abs=1e-12))
        assert hi == (1.0 if correct == n else pytest.approx(root(ph, 1.0), abs=1e-12))
        assert 0.0 <= lo <= ph <= hi <= 1.0
    with pytest.raises(ValueError, match="n must"):
        accuracy.wilson(0, 0)
    with pytest.raises(ValueError, match="correct"):
        accuracy.wilson(11, 10)


def test_mode_table_baselines_and_missing_plot(tmp_path, monkeypatch, capsys):
    import sys
    from pathlib import Path


    from benchmarks import accuracy, tasks
    assert accuracy.with_baselines(["threshold+exact", "exact", "dual"]) == [
        "threshold", "threshold+exact", "fixed", "exact", "dual"]
    with pytest.raises(ValueError, match="--modes"):
        accuracy.with_baselines(["fixed", "warp"])
    for name, (settings, baseline) in accuracy.MODES.items():  # every entry is a valid config
        for task in tasks.TASKS:
            gen = accuracy.generation_config(task, settings)
            assert gen.gen_length == tasks.get(task).gen_len
            assert gen.flash is not None or gen.steps == gen.gen_length  # flash: no schedule
            assert gen.dpad == (tasks.get(task).dpad if settings.get("dpad") else None)
        assert baseline is None or accuracy.MODES[baseline][1] is None
    # A record of the demo from before issue 15 (no intervals stored) redraws as a table.
    results = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
    old = results / "accuracy-20261129-142949.json"
    assert accuracy.main(["--from-json", str(old), "--no-plot"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| mode | accuracy (95% CI)") and len(lines) == 2 + 12
    assert "| fixed | 100.0% (99.2-100.0) |" in lines[2]  # Wilson at 500/500: 1 - z^2/(n+z^2)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rows = {"fixed": {"accuracy": 0.5, "ci95": [0.2, 0.8], "tokens_per_s": 10.0}}
    assert accuracy.plot(rows, tmp_path / "p.png", "t") is None
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert not (tmp_path / "p.png").exists()


def test_worker_batches_are_numbered_and_the_same_from_a_process_pool():
    """Batch i depends on (task, seed, i) only, whichever process builds it: what makes a run
    with --workers reproducible for any worker count."""
    cfg = train_demo.tasks.model_config("chain-d2")
    a = train_demo.numbered_batch("chain-d2", 4, cfg.eos_id, 0, 3)
    other = train_demo.numbered_batch("chain-d2", 4, cfg.eos_id, 0, 4)
    assert not np.array_equal(a[0], other[0])
    stream = train_demo.prefetched("chain-d2", 4, cfg.eos_id, 0, workers=1, start=3)
    try:
        got = next(stream)
    finally:
        stream.close()
    np.testing.assert_array_equal(got[0], a[0])
    np.testing.assert_array_equal(got[1], a[1])


def test_bf16_compute_runs_the_matmuls_in_bf16():
    cfg = train_demo.demo_config(n_layers=1)
    params = lj.init_params(cfg, jax.random.key(0), jnp.float32)
    tokens = jnp.zeros((2, train_demo.PROMPT_LEN + train_demo.GEN_LEN), jnp.int32)
    pad = jnp.zeros((2,), jnp.int32)
    dots = lambda compute: {
        str(e.invars[0].aval.dtype) for e in jax.make_jaxpr(
            lambda p: train_demo.sft_loss(p, cfg, tokens, pad, jax.random.key(0),
                                          compute=compute))(params).jaxpr.eqns
        if e.primitive.name == "pjit" or e.primitive.name == "dot_general"}
    assert "bfloat16" in dots(jnp.bfloat16) and "bfloat16" not in dots(jnp.float32)


def test_attention_choice_reaches_the_model_and_bad_names_are_refused(monkeypatch):
    """bf16 training on the GPU can force XLA's attention over cuDNN's (see train_demo's
    docstring); elsewhere the model runs XLA's whatever is forced."""

    from lacache_jax import model
    monkeypatch.setattr(model.jax, "default_backend", lambda: "gpu")
    assert model._attention_impl(jnp.bfloat16) == "cudnn"
    with model.attention_implementation("xla"):
        assert model._attention_impl(jnp.bfloat16) == "xla"
    assert model._attention_impl(jnp.float32) == "xla"
    assert train_demo.attention_candidates("auto", jnp.bfloat16) == ["cudnn", "xla"]
    assert train_demo.attention_candidates("auto", jnp.float32) == ["auto"]
    monkeypatch.setattr(model.jax, "default_backend", lambda: "cpu")
    with model.attention_implementation("cudnn"):
        assert model._attention_impl(jnp.bfloat16) == "xla"
    with pytest.raises(ValueError, match="one of"):
        with model.attention_implementation("flash"):
            pass
    with pytest.raises(ValueError, match="attention must be one of"):
        train_demo.train(train_demo.demo_config(n_layers=1), steps=1, batch=2, lr=1e-3,
                         attention="cuDNN")


def test_char_encoder_is_the_tokenizer(tmp_path):
    """The training batches' table lookup gives the tokenizer's ids for every task's prompts
    and answers, and leaves text it cannot encode to the tokenizer's own error."""
    import random


    from benchmarks import tasks
    from lacache_jax.tokenizer import Tokenizer, TokenizerError
    for name in ("arith", "chain-d2"):
        t = tasks.get(name)
        t.write_tokenizer(tmp_path / name)
        tok, fast = Tokenizer(tmp_path / name), train_demo.CharEncoder(tmp_path / name)
        rng = random.Random(0)
        texts = [f(p) for p in t.draw("train", 50, rng)
                 for f in (t.prompt, lambda p: t.answer(p, rng))]
        texts += [arith.EOS + "12" + arith.MASK * 2 + "3", ""]
        for text in texts:
            assert fast(text) == tok.encode(text), text
        with pytest.raises(TokenizerError):
            fast("12€3")
        with pytest.raises(TokenizerError):
            fast("12~3")


def test_forced_attention_reaches_the_traced_train_step(monkeypatch):
    """The choice made by `make_train_step(attention=...)` is what the traced step's
    attention calls receive (as if on the GPU in bf16, where the default is cuDNN)."""

    from lacache_jax import model
    seen = []
    real = jax.nn.dot_product_attention

    def recording(*args, implementation=None, **kwargs):
        seen.append(implementation)
        return real(*args, implementation="xla", **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
    monkeypatch.setattr(model.jax, "default_backend", lambda: "gpu")
    cfg = train_demo.demo_config(n_layers=2)
    params = lj.init_params(cfg, jax.random.key(0), jnp.float32)
    opt = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3)
    tokens = jnp.zeros((2, train_demo.PROMPT_LEN + train_demo.GEN_LEN), jnp.int32)
    pad = jnp.zeros((2,), jnp.int32)
    for forced, want in ((None, "cudnn"), ("xla", "xla"), ("cudnn", "cudnn")):
        seen.clear()
        step = train_demo.make_train_step(cfg, opt, compute=jnp.bfloat16, attention=forced)
        jax.make_jaxpr(step)(params, opt.init(params), tokens, pad, jax.random.key(0), 1e-3)
        assert len(seen) == 2 and set(seen) == {want}, (forced, seen)


def test_paired_difference_interval():
    """Newcombe's paired interval (accuracy.paired_difference): the worked example of
    Newcombe & Altman (Statistics with Confidence, 2nd ed., ch. 7: 21 pairs, 0.2857 from 0.026
    to 0.507, with the continuity-corrected phi); an asymmetric table whose two half-widths
    differ (swapping them moves both bounds by 0.010); antisymmetric, holds the point
    estimate, narrower than either accuracy's Wilson interval when the modes mostly agree, and
    at large n equal to the Wald interval of the paired difference, to which it is
    asymptotically equivalent (sd of the mean difference sqrt(b + c - (b - c)^2 / n) / n)."""

    from benchmarks import accuracy

    def table(both, only1, only2, neither):  # per-problem outcomes of such a 2 x 2 table
        first = [True] * (both + only1) + [False] * (only2 + neither)
        second = [True] * both + [False] * only1 + [True] * only2 + [False] * neither
        return first, second
    # Published to 3 decimals (rounding: 5e-4).
    assert accuracy.paired_difference(*table(1, 1, 7, 12)) == pytest.approx(
        (6 / 21, 0.026, 0.507), abs=5e-4)
    # A table with an empty margin (phi 0): the lower bound pairs second's lower Wilson
    # distance with first's upper one; the interval of the half-widths swapped is
    # (-0.0794, -0.0104). Values from the closed forms, to 4 decimals.
    assert accuracy.paired_difference(*table(190, 10, 0, 0)) == pytest.approx(
        (-0.05, -0.0896, -0.0206), abs=5e-5)
    rng = np.random.default_rng(0)
    first = rng.random(200) < 0.62
    second = first.copy()
    flip = rng.choice(200, 14, replace=False)
    second[flip] = ~second[flip]
    d, lo, hi = accuracy.paired_difference(first, second)
    assert d == pytest.approx(second.mean() - first.mean(), abs=1e-15)
    assert -1 <= lo <= d <= hi <= 1
    assert accuracy.paired_difference(second, first) == pytest.approx((-d, -hi, -lo), abs=1e-12)
    w_lo, w_hi = accuracy.wilson(int(second.sum()), 200)
    # 14 discordant of 200: paired sd sqrt(14) / 200 = 0.0187 against the marginal's
    # sqrt(0.24 / 200) = 0.0346, a ratio of 0.54.
    assert hi - lo < 0.6 * (w_hi - w_lo)
    same = accuracy.paired_difference(first, first)
    assert same[0] == 0 and same[1] <= 0 <= same[2]
    # Large n: 30% / 40% marginals with 20% of problems discordant.
    n = 400_000
    u = rng.random(n)
    a = u < 0.30
    b = (u >= 0.05) & (u < 0.45)  # only-a: [0, 0.05), only-b: [0.30, 0.45)
    d, lo, hi = accuracy.paired_difference(a, b)
    only_a, only_b = int(np.sum(a & ~b)), int(np.sum(~a & b))
    sd = np.sqrt(only_a + only_b - (only_b - only_a) ** 2 / n) / n
    # The two intervals differ by O(1/n) (Wilson's centre shift); sd here is 6.9e-4.
    assert (lo, hi) == pytest.approx((d - accuracy.Z95 * sd, d + accuracy.Z95 * sd), abs=2e-5)
    with pytest.raises(ValueError, match="equal"):
        accuracy.paired_difference([True], [True, False])
