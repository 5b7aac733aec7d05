"""Issue 20's CPU side: rows a forward computes. The prefix cache's later steps query [s, T)
in one program per block, DPad runs its full forwards on the compact canvas ([0, e) and the
kept suffix) and prefix's later steps on the block and the kept suffix; a gaussian draw that
overflows its static slots falls back to the masked full canvas with the same tokens; the
static slot bound; the benchmark's DPad side-by-side switch on a tiny config."""

from __future__ import annotations

import dataclasses

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lacache_jax as lj
from lacache_jax import cache, sampling, sar
from lacache_jax.config import tiny
from tests.conftest import record_forward_widths

CFG = tiny(n_layers=1, n_heads=4, n_kv_heads=2)  # one layer: these tests count rows, compile less
G, BL = 16, 8
PROMPTS = [[7, 8, 9, 10, 11], list(range(20, 29)), list(range(100, 113))]  # P = 13, T = 29
P = max(map(len, PROMPTS))
T = P + G
STARTS = [P + k * BL for k in range(G // BL)]
UNIFORM = lj.DPadConfig(strategy="uniform", window=10, keep=4)


@pytest.fixture(scope="module")
def params():
    # Larger weights than init's default make the outputs depend visibly on the context.
    return lj.init_params(CFG, jax.random.key(0), jnp.float32, std=0.3)


def _generate(params, monkeypatch, **kw):
    """(tokens, nfe, rows traced, rows executed) of sar.run under a fresh jit: every forward's
    query rows, as `cache.run_blocks` receives them, at trace time and as they run."""
    traced, executed = record_forward_widths(monkeypatch)
    gen = lj.GenerationConfig(gen_length=G, block_length=BL, steps=G, stop_at_eos=False,
                              **kw).resolve(CFG)
    x = np.full((len(PROMPTS), T), CFG.mask_id, np.int32)
    pad = np.array([P - len(r) for r in PROMPTS], np.int32)
    for b, r in enumerate(PROMPTS):
        x[b, :pad[b]], x[b, pad[b]:P] = CFG.pad_id, r
    keys = jax.random.split(jax.random.key(3), len(PROMPTS))
    run = jax.jit(lambda p, x, pad, keys: sar.run(p, CFG, gen, x, pad, keys))
    st = jax.block_until_ready(run(params, jnp.asarray(x), jnp.asarray(pad), keys))
    return np.asarray(st.x_BT), np.asarray(st.nfe_B), traced, set(executed)


def _widths(dpad):
    """Uniform DPad's compact widths: [0, e) plus min(keep, window, T - e) kept columns."""
    return {s + BL + min(dpad.keep, dpad.window, T - s - BL) for s in STARTS}


CASES = {  # cache, dpad -> the query rows of every forward (old code: T and T - P only)
    "prefix": (dict(cache="prefix"), {T} | {T - s for s in STARTS}),
    "none_dpad": (dict(dpad=UNIFORM), _widths(UNIFORM)),
    "dual_dpad": (dict(cache="dual", dpad=UNIFORM), _widths(UNIFORM) | {BL}),
    # exact: run_blocks takes layers >= 1 (this one-layer model has none; it still sees
    # each forward's compact width)
    "exact_dpad": (dict(cache="exact", dpad=UNIFORM), _widths(UNIFORM)),
}  # prefix with DPad: test_gaussian_overflow_... below


@pytest.mark.parametrize("case", list(CASES))
def test_forwards_compute_only_the_rows_they_use(params, monkeypatch, case):
    """Fails if per-block prefix shapes or DPad's compact canvas are silently off: forwards
    then run T or T - P rows, whatever the block."""
    kw, rows = CASES[case]
    tokens, nfe, traced, executed = _generate(params, monkeypatch, **kw)
    assert traced == rows and executed == rows
    assert (nfe == G).all()  # one token per step, every step counted


def test_gaussian_overflow_runs_the_masked_canvas_with_the_same_tokens(params, monkeypatch):
    """DPAD_TAIL = 1 makes every block's slot bound 0, so every block whose rows kept a suffix
    column overflows and runs the masked full canvas (the computation before compaction):
    full-width first forwards, later steps on [s, T) with DPad's mask. Same tokens as the
    compact run, under CFG (model rows 2B) with ragged prompts. The prefix cache is the
    policy with both fallbacks (first forward and later step); its later steps query the
    block and that block's own slots."""
    dpad = lj.DPadConfig(window=10)
    kw = dict(cache="prefix", dpad=dpad, cfg_scale=1.0)
    compact, nfe, _, ran_compact = _generate(params, monkeypatch, **kw)
    slots = [sampling.dpad_capacity(dpad, T - s - BL) for s in STARTS]
    assert slots[0] < min(dpad.window, T - STARTS[0] - BL)  # block 0 can overflow
    assert ran_compact == {s + BL + n for s, n in zip(STARTS, slots)} | {BL + n for n in slots}
    monkeypatch.setattr(sampling, "DPAD_TAIL", 1.0)
    masked, nfe_masked, _, ran_masked = _generate(params, monkeypatch, **kw)
    # The last block keeps no suffix (nothing to overflow): its later steps query the block,
    # which is [s, T) there too.
    assert ran_masked == {T} | {T - s for s in STARTS}
    np.testing.assert_array_equal(compact, masked)
    np.testing.assert_array_equal(nfe, nfe_masked)


def test_exact_gaussian_overflow_runs_the_masked_canvas_with_the_same_tokens(params,
                                                                            monkeypatch):
    """The exact cache's fallback (first forward and later steps, one condition each): with
    every block overflowing, all its forwards run the masked whole canvas, with the compact
    run's tokens (under CFG, ragged prompts)."""
    dpad = lj.DPadConfig(window=10)
    kw = dict(cache="exact", dpad=dpad, cfg_scale=1.0)
    compact, nfe, _, ran_compact = _generate(params, monkeypatch, **kw)
    slots = [sampling.dpad_capacity(dpad, T - s - BL) for s in STARTS]
    assert ran_compact == {s + BL + n for s, n in zip(STARTS, slots)}
    monkeypatch.setattr(sampling, "DPAD_TAIL", 1.0)
    masked, nfe_masked, _, ran_masked = _generate(params, monkeypatch, **kw)
    assert ran_masked == {T}
    np.testing.assert_array_equal(compact, masked)
    np.testing.assert_array_equal(nfe, nfe_masked)


def test_dpad_capacity():
    """Uniform: exactly min(keep, window), or n where n <= keep (DPad keeps a short suffix
    whole). Gaussian: the (1 - tail) quantile of the kept count, checked against dpad_keep's
    own draws."""
    for n in (0, 3, 8, 30):
        assert sampling.dpad_capacity(UNIFORM, n) == min(4, 10, n)
    wide = lj.DPadConfig(strategy="uniform", window=4, keep=12)  # keep above the window
    assert [sampling.dpad_capacity(wide, n) for n in (3, 12, 13, 30)] == [3, 12, 4, 4]
    dpad = lj.DPadConfig(window=64)
    keys = jax.random.split(jax.random.key(1), 4000)
    counts = np.asarray(sampling.dpad_keep(dpad, keys, jnp.int32(10), 100))[:, 10:].sum(1)
    cap = sampling.dpad_capacity(dpad, 90, tail=0.05)
    # 4000 draws: the standard error of a 5% frequency is 0.0034; 4 sigma either side.
    assert np.mean(counts > cap) <= 0.05 + 0.014
    assert np.mean(counts > cap - 1) >= 0.05 - 0.014
    assert sampling.dpad_capacity(dpad, 90) <= 64  # default tail: still a bound under window


def test_block_rows():
    """The rows the benchmark reports (prompt 512, gen 256, block 32): prefix queries shrink
    from 256 by one block per block; dual queries the block."""
    gen = lj.GenerationConfig(gen_length=256, block_length=32, steps=256, cache="prefix")
    assert cache.block_rows(gen, 512) == [(768, 256 - 32 * k) for k in range(8)]
    dual = lj.GenerationConfig(gen_length=256, block_length=32, steps=256, cache="dual",
                               dpad=lj.DPadConfig(strategy="uniform", keep=32))
    widths = [512 + 32 * (k + 1) + min(32, 256 - 32 * (k + 1)) for k in range(8)]
    assert cache.block_rows(dual, 512) == [(w, 32) for w in widths]
    # prefix + DPad: later steps query the block and that block's kept slots, never more
    # than without DPad (the last block: the block alone)
    pd = dataclasses.replace(gen, dpad=lj.DPadConfig())
    later = [q for _, q in cache.block_rows(pd, 512)]
    assert later[-1] == 32 and all(32 <= q <= 256 - 32 * k for k, q in enumerate(later))
    assert later[0] < 256  # something is dropped
    # exact + DPad: every forward of a block on its compact canvas
    ex = dataclasses.replace(dual, cache="exact")
    assert cache.block_rows(ex, 512) == [(w, w) for w in widths]


def test_step_cost_counts_what_each_mode_computes(monkeypatch):
    """The benchmark's floor (LLaDA-8B, prompt 512, gen 256, block 32): the exact cache costs
    what none does (its deeper layers run in full, no KV cache of theirs is read); the dual
    cache reads its K/V; the FP8 FFN's FLOPs of layers >= 1 count half (FP8's tensor-core rate
    is twice bf16's) and its weights one byte each; the last layer's attention, output
    projection and MLP count the block's 32 rows only (`cache.HEAD_ROWS_ONLY`), its Q/K/V
    projection (one GEMM) every row."""
    from benchmarks.generate import step_cost
    cfg = lj.llada_8b()
    gen = lj.GenerationConfig(gen_length=256, block_length=32, steps=256)
    cost = lambda **kw: step_cost(cfg, dataclasses.replace(gen, **kw), 1, 512)  # noqa: E731
    none, exact = cost(), cost(cache="exact")
    assert exact == none
    kv = 2 * cfg.n_layers * 768 * cfg.n_kv_heads * cfg.head_dim * 2
    assert cost(cache="dual")[1] == none[1] + kv
    ffn = 3 * cfg.d_model * cfg.d_ff  # a layer's, per row
    fp8 = cost(fp8_ffn=True)
    # 768 rows a step in layers 1 .. L-2, the block's 32 in the last
    assert fp8[0] == pytest.approx(none[0] - 2 * (768 * (cfg.n_layers - 2) + 32) * ffn / 2)
    assert fp8[1] == none[1] - ffn * (cfg.n_layers - 1)
    o = cfg.d_model * cfg.n_heads * cfg.head_dim  # the output projection, per row
    attn = 2 * 768 * cfg.n_heads * cfg.head_dim  # a query row's, over the 768 keys
    monkeypatch.setattr(cache, "HEAD_ROWS_ONLY", False)
    every_row = cost()
    assert every_row[0] == pytest.approx(none[0] + 2 * (768 - 32) * (o + attn + ffn))
    assert every_row[1] == none[1]


def test_flash_step_cost_counts_the_window_as_the_step_runs_it(monkeypatch):
    """The Flash-dLLM floor (`benchmarks/flash.py`, LLaDA-8B, prompt 512): R = W + A + Tr
    query rows in every layer but the last's attention, output projection and MLP, which
    count the W window rows (`cache.HEAD_ROWS_ONLY`), as the LM head does; W is the window
    capped at the generation length (`flash.Budget`), so a generation shorter than the window
    counts its own rows, not the window's."""
    from benchmarks.flash import step_cost
    from lacache_jax import flash
    cfg = lj.llada_8b()
    D, V = cfg.d_model, cfg.vocab_size
    qkv = D * cfg.head_dim * (cfg.n_heads + 2 * cfg.n_kv_heads)
    rest = D * cfg.head_dim * cfg.n_heads + 3 * D * cfg.d_ff

    def flops(gen_length, window=16):
        T = 512 + gen_length
        fcfg = lj.FlashConfig(window=window, lookahead=48, track=64)
        budget = flash.Budget.build(fcfg, gen_length, T)
        attn = 2 * T * cfg.n_heads * cfg.head_dim
        return step_cost(cfg, budget, 1, T)[0], budget.rows(T), budget.W, attn

    cost, R, W, attn = flops(256)
    assert (R, W) == (16 + 48 + 64, 16)
    L = cfg.n_layers
    assert cost == pytest.approx(2 * (R * L * qkv + (R * (L - 1) + W) * (rest + attn) + W * D * V))
    cost, R, W, attn = flops(8)  # the window capped at 8 generated columns, no look-ahead
    assert (R, W) == (8 + 0 + 64, 8)
    assert cost == pytest.approx(2 * (R * L * qkv + (R * (L - 1) + 8) * (rest + attn) + 8 * D * V))
    monkeypatch.setattr(cache, "HEAD_ROWS_ONLY", False)
    every_row, R, W, attn = flops(256)
    assert every_row == pytest.approx(2 * (R * L * (qkv + rest + attn) + W * D * V))


def test_benchmark_dpad_both_runs_on_a_tiny_config(tmp_path, monkeypatch, capsys):
    """`python -m benchmarks.generate --tiny --dpad both` measures each configuration without
    and with DPad and reports the rows its forwards compute per block."""
    from benchmarks import generate as bench
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr("sys.argv", ["generate", "--tiny", "--layers", "1", "--batch", "1",
                                     "--modes", "none", "--decoding", "fixed", "--prompt", "16",
                                     "--gen", "16", "--block", "8", "--iters", "1",
                                     "--dpad", "both", "--dpad-strategy", "uniform",
                                     "--dpad-keep", "2"])
    bench.main()
    rows = json.loads(next(tmp_path.glob("generate-*.json")).read_text())["rows"]
    assert [r["dpad"] for r in rows] == [None, "uniform"]
    T = 16 + 16
    assert rows[0]["rows_per_block"] == [[T, T], [T, T]]
    # DPad keeps 2 suffix columns after block 0 (ending at 24) and none after the last.
    assert rows[1]["rows_per_block"] == [[24 + 2, 24 + 2], [T, T]]
    assert all(r["nfe"] == 16 and r["ms_per_step"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert "rows per block" in out and "× no DPad" in out


def test_benchmark_runs_each_short_attention_choice(tmp_path, monkeypatch):
    """`generate --short-attention split,cudnn`: every configuration once per choice, each row
    saying which; a choice that is none of them refused before any run."""
    from benchmarks import generate as bench
    monkeypatch.setenv("OUT", str(tmp_path))
    argv = ["generate", "--tiny", "--layers", "1", "--batch", "1", "--modes", "dual",
            "--decoding", "fixed", "--prompt", "16", "--gen", "16", "--block", "8", "--iters",
            "1", "--short-attention"]
    monkeypatch.setattr("sys.argv", argv + ["split,cudnn"])
    bench.main()
    rows = json.loads(next(tmp_path.glob("generate-*.json")).read_text())["rows"]
    assert [r["short_attention"] for r in rows] == ["split", "cudnn"]
    monkeypatch.setattr("sys.argv", argv + ["flash"])
    with pytest.raises(SystemExit, match="--short-attention: 'flash'"):
        bench.main()


def test_benchmark_only_runs_the_chosen_pairs(tmp_path, monkeypatch, capsys):
    """`generate --only CACHE:FP8,...`: of --modes x --fp8-ffn only those pairs run; a pair
    outside them refused before the weights are built (2 layers: the first stays bf16)."""
    from benchmarks import generate as bench
    monkeypatch.setenv("OUT", str(tmp_path))
    argv = ["generate", "--tiny", "--layers", "2", "--batch", "1", "--modes", "none,exact",
            "--decoding", "fixed", "--prompt", "16", "--gen", "16", "--block", "8", "--iters",
            "1", "--fp8-ffn", "both", "--only"]
    monkeypatch.setattr("sys.argv", argv + ["none:off,exact:on"])
    bench.main()
    rows = json.loads(next(tmp_path.glob("generate-*.json")).read_text())["rows"]
    assert [(r["cache"], r["fp8_ffn"]) for r in rows] == [("none", False), ("exact", True)]
    monkeypatch.setattr(bench, "setup", lambda *a: pytest.fail("built before the check"))
    monkeypatch.setattr("sys.argv", argv + ["dual:on"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "--only: ['dual:on'] not among --modes" in capsys.readouterr().err


SWITCH = 0  # a module-level switch for `generate --settings` (kernels read theirs while tracing)
FLAG = False  # and a bool one


def test_benchmark_runs_each_module_setting(tmp_path, monkeypatch):
    """`generate --settings SPEC ...`: every configuration once per SPEC, with the switch set
    while it runs and restored after, each row saying which; a misspelt switch refused before
    the weights are built."""
    from benchmarks import generate as bench
    monkeypatch.setenv("OUT", str(tmp_path))
    seen, run_one = [], bench.run_one

    def recording(*args, **kwargs):
        seen.append(SWITCH)
        return run_one(*args, **kwargs)
    monkeypatch.setattr(bench, "run_one", recording)
    argv = ["generate", "--tiny", "--layers", "1", "--batch", "1", "--modes", "none,dual",
            "--decoding", "fixed", "--prompt", "16", "--gen", "16", "--block", "8", "--iters",
            "1", "--settings"]
    monkeypatch.setattr("sys.argv", argv + [f"{__name__}:SWITCH=3", f"{__name__}:SWITCH=5"])
    bench.main()
    rows = json.loads(next(tmp_path.glob("generate-*.json")).read_text())["rows"]
    assert seen == [3, 5, 3, 5] and SWITCH == 0
    assert [(r["cache"], r["settings"]) for r in rows] == [
        (c, f"{__name__}:SWITCH={v}") for c in ("none", "dual") for v in (3, 5)]
    assert all(r["same_generated_as_first_settings"] == 1.0 for r in rows[1::2])
    monkeypatch.setattr(bench, "setup", lambda *a: pytest.fail("built before the check"))
    monkeypatch.setattr("sys.argv", argv + [f"{__name__}:SWICH=1"])
    with pytest.raises(SystemExit, match="SWICH is not a module-level int"):
        bench.main()
    monkeypatch.setattr("sys.argv", argv + [f"{__name__}:FLAG=2"])
    with pytest.raises(SystemExit, match="FLAG is a bool: 0 or 1"):
        bench.main()


def test_bool_switches_are_set_as_bools():
    from benchmarks.common import module_settings, parse_settings
    me = sys.modules[__name__]
    assert parse_settings(f"{__name__}:FLAG=1,{__name__}:SWITCH=1") == [
        (me, "FLAG", True), (me, "SWITCH", 1)]
    with module_settings(f"{__name__}:FLAG=1"):
        assert FLAG is True
    assert FLAG is False


def test_fp8_e2e_runs_on_a_tiny_config_and_writes_its_rows(tmp_path, monkeypatch, capsys):
    """`python -m benchmarks.fp8_e2e --tiny`: every run without and with the FP8 FFN, its
    steps field honoured, the JSON and the table written (the eighth session's device call 4
    lost its JSON to a crash in the shared report)."""
    from benchmarks import fp8_e2e
    monkeypatch.setenv("OUT", str(tmp_path))
    fp8_e2e.main(["--tiny", "--layers", "2", "--gen", "16", "--block", "8",
                  "--runs", "1:16:none:fixed,2:16:exact:fixed:1:4"])
    rows = json.loads(next(tmp_path.glob("generate-*.json")).read_text())["rows"]
    assert [(r["B"], r["cache"], r["fp8_ffn"]) for r in rows] == [
        (1, "none", False), (1, "none", True), (2, "exact", True)]
    assert [r["nfe"] for r in rows] == [16, 16, 4]
    assert all(r["dpad"] is None and r["ms_per_step"] > 0 for r in rows)
    table = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ")]
    assert [ln.split(" | ")[:3] for ln in table[1:]] == [
        ["| 1", "16", "none"], ["| 1", "16", "none"], ["| 2", "16", "exact"]]


def test_fp8_e2e_paper_table_pairs_each_run_with_its_lacache_twin(tmp_path, monkeypatch,
                                                                  capsys):
    """`fp8_e2e --paper`: its runs (here two pairs at a tiny prompt, the second with DPad)
    timed, and each with-LaCache row's speed-up over its pair, beside the paper's ratio."""
    from benchmarks import fp8_e2e
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(fp8_e2e, "PAPER", (
        ("vanilla", "1:16:none:fixed:0"), ("+ LaCache", "1:16:exact:fixed:1"),
        ("+ DPad", "1:16:none:fixed:0::dpad"), ("+ DPad + LaCache", "1:16:exact:fixed:1::dpad")))
    fp8_e2e.main(["--tiny", "--layers", "2", "--gen", "16", "--block", "8", "--paper"])
    rows = json.loads(next(tmp_path.glob("generate-*.json")).read_text())["rows"]
    assert [(r["cache"], r["fp8_ffn"], r["dpad"]) for r in rows] == [
        ("none", False, None), ("exact", True, None), ("none", False, "gaussian"),
        ("exact", True, "gaussian")]
    out = capsys.readouterr().out.splitlines()
    table = {ln.split(" | ")[0][2:]: ln.split(" | ") for ln in out if ln.startswith("| ")}
    assert table["+ LaCache"][3] == f"{rows[0]['ms_per_step'] / rows[1]['ms_per_step']:.2f}x"
    assert table["+ LaCache"][4] == "1.10x |" and table["vanilla"][3] == ""
    assert table["+ DPad + LaCache"][3].endswith("x")
    with pytest.raises(SystemExit, match="seventh field"):
        fp8_e2e.main(["--tiny", "--runs", "1:16:none:fixed:0::other"])


def test_flash_gamma_sweep_compares_each_verify_setting_with_part_1(monkeypatch):
    """`benchmarks/flash.py --parts gamma` on a stand-in task (a tiny random model; a problem is
    solved when its answer's first token is even): every verify setting carries its paired
    difference to flash without verify on the same problems and its tokens-per-step ratio;
    the baseline row carries none; each row keeps which problems it solved."""
    import argparse
    import types

    from benchmarks import accuracy, flash, tasks
    cfg = lj.tiny(n_layers=1)
    params = lj.init_params(cfg, jax.random.key(0), jnp.float32)

    class Tok:
        encode = staticmethod(lambda text: [int(t) for t in text.split()])
        decode = staticmethod(lambda ids: " ".join(map(str, ids)))
    task = types.SimpleNamespace(
        name="stand-in", gen_len=16,
        sample=lambda split, n, seed: list(range(seed, seed + n)),
        prompt=lambda p: " ".join(str((7 * p + j) % 200) for j in range(3 + p % 4)),
        check=lambda p, answer: int(answer.split()[0]) % 2 == 0)
    monkeypatch.setattr(tasks, "get", lambda name: task)
    monkeypatch.setattr(flash, "task_model", lambda args: (cfg, params, Tok()))
    args = argparse.Namespace(task="stand-in", n=6, seed=1, gammas="0.9", accept="cumprod",
                              window=4, lookahead=4, track=4, epsilon=0.8)
    rows, thresholds, drawn, evaluate = [], [], [], accuracy.evaluate

    def spy(params, cfg, tok, problems, settings, **kw):
        thresholds.append(settings["threshold"])
        drawn.append(problems)
        return evaluate(params, cfg, tok, problems, settings, **kw)
    monkeypatch.setattr(accuracy, "evaluate", spy)
    flash.part_gamma(args, cfg, None, params, rows)
    assert thresholds == [0.8, 0.8]  # --epsilon is the draft's ε with and without verify
    assert drawn == [list(range(1, 7))] * 2  # --seed's draw, the same problems for both
    assert [r["mode"] for r in rows] == ["flash", "flash+verify0.9"]
    fields = {"part", "task", "mode", "epsilon", "n", "accuracy", "ci95", "solved",
              "tokens_per_step", "nfe", "tokens_per_s"}
    assert set(rows[0]) == fields and set(rows[1]) == fields | {"vs_flash"}
    assert [r["epsilon"] for r in rows] == [0.8, 0.8]
    base = [c == "1" for c in rows[0]["solved"]]
    for r in rows[1:]:
        solved = [c == "1" for c in r["solved"]]
        assert len(solved) == 6 and r["accuracy"] == sum(solved) / 6
        d, lo, hi = accuracy.paired_difference(base, solved)
        assert r["vs_flash"]["accuracy_diff"] == d and r["vs_flash"]["ci95"] == [lo, hi]
        assert r["vs_flash"]["tokens_per_step_ratio"] == pytest.approx(
            r["tokens_per_step"] / rows[0]["tokens_per_step"])


def test_attention_mask_probe_writes_a_row_per_variant(tmp_path, monkeypatch):
    """`python -m benchmarks.attention_mask_probe`: each variant timed or its failure recorded
    (on the CPU cuDNN's are absent), XLA's against itself, the floor from the run's rate."""
    from benchmarks import attention_mask_probe
    monkeypatch.setenv("OUT", str(tmp_path))
    attention_mask_probe.main(["--shapes", "1:32"])
    rows = json.loads(next(tmp_path.glob("attention_mask-*.json")).read_text())["rows"]
    assert [r["variant"] for r in rows] == ["cudnn_mask", "cudnn_nomask", "cudnn_kvlens",
                                            "xla_mask"]
    assert all(r["floor_us"] > 0 for r in rows)
    assert rows[-1]["max_diff_vs_xla"] == 0.0 and "error" not in rows[-1]
