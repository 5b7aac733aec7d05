"""benchmarks/eval_time.py (issue 19's GSM8K-sized wall time): its run specs and projection."""

import pytest

from benchmarks.eval_time import parse_run, project


def test_run_specs():
    assert parse_run("32:exact:fixed:0:32", 256) == dict(B=32, cache="exact", decoding="fixed",
                                                         fp8_ffn=False, steps=32)
    assert parse_run("8:dual:threshold:1", 256)["steps"] == 256
    for bad in ("32:exact:fixed", "32:dual:greedy:0", "32:dual:fixed:2",
                "32:dual:threshold:1:64"):  # threshold decides its own step count
        with pytest.raises(ValueError, match="run"):
            parse_run(bad, 256)


def test_projection_counts_whole_batches_at_one_token_per_step():
    r = dict(B=32, ms_per_step=100.0, compile_s=30.0, decoding="fixed")
    p = project(r, 1319, 256)
    # 1319 items in batches of 32: 41 full batches and one of 7, which costs a whole batch.
    assert p["batches"] == 42
    assert p["projected_s"] == pytest.approx(42 * 256 * 0.1)
    assert p["projected_with_compile_s"] == pytest.approx(42 * 256 * 0.1 + 30)
    assert not p["bound"] and project({**r, "decoding": "threshold"}, 1319, 256)["bound"]


def test_tiny_run_goes_through_both_default_runs(capsys):
    """The script end to end on a tiny model (the default runs include the FP8 FFN, which
    refuses widths that are not multiples of 128): one line per run."""
    from benchmarks.eval_time import main
    main(["--tiny", "--items", "10", "--prompt", "16", "--gen", "32", "--block", "16",
          "--runs", "4:exact:fixed:0:4,2:dual:threshold:1"])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("B=")]
    assert len(lines) == 2 and "one-token-per-step bound" in lines[1]
