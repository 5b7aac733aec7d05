"""Data and tensor parallelism on 4 fake CPU devices (tests/multi_device_cases.py, run once in
a subprocess: XLA_FLAGS must be set before JAX starts): tokens identical to one device in every
cache mode, with threshold decoding and with the FP8 FFN, whose copies are split over the model
axis like the bf16 FFN; the split-keys attention run per device on its shard; slot refill
with its slots split over the data axis; the tensor-parallel generate program moves no
weight; and benchmarks/multi_gpu.py runs in its --tiny mode."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, cpu_subprocess_env


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, dict]:
    env = cpu_subprocess_env(tmp_path_factory.mktemp("benchmark_out"),
                             "--xla_force_host_platform_device_count=4")
    done = subprocess.run([sys.executable, "-m", "tests.multi_device_cases"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {r["case"]: r for r in results}


def test_meshes_give_single_device_tokens(cases):
    tokens = {k: r for k, r in cases.items() if "setting" in r}
    # 7 bf16 settings (exact + DPad among them) on 3 meshes, FP8 exact and Flash on 3, FP8
    # dual on 2 model meshes.
    assert len(tokens) == 7 * 3 + 2 * 3 + 2, sorted(tokens)
    assert all(r["same"] for r in tokens.values()), [r for r in tokens.values() if not r["same"]]
    for setting in ("fp8_ffn_exact", "fp8_ffn_dual"):  # the FP8 FFN split 2 ways
        assert {f"{setting}/model2", f"{setting}/data2_model2"} <= set(tokens)
    assert cases["load_sharded"]["same"]
    assert cases["load_sharded"]["w_qkv_spec"] == ["None", "model"]
    assert cases["load_sharded"]["embed_replicated"]
    assert cases["bad_mesh"]["same"]
    assert cases["per_data_shard"]["rows"] == [8, 4]  # no mesh; data 2 x model 2
    assert cases["per_data_shard"]["heads"] == 16
    assert cases["per_data_shard"]["takes"] == [False, True]
    # the split-keys attention (a Pallas call) on a data 2 x model 2 mesh: each device runs
    # its 2 rows x 4 of the 8 heads, and the result is the dense attention's (fp32, 1e-5)
    r = cases["short_attention_mesh"]
    assert r["shard_shapes"] == [[2, 8, 4, 16]] and r["close"], r


def test_slot_refill_over_the_data_axis(cases):
    runs = {k: r for k, r in cases.items() if k.startswith("slots/")}
    assert len(runs) == 3 * 2, sorted(runs)  # 3 settings on 2 meshes
    assert all(r["slots_same"] for r in runs.values()), runs
    # Nine prompts over three buckets with a queue of two: many calls, the slots read back and
    # re-placed as the canvas narrows, through `generate` and the compiled programs alike;
    # every FACache kernel traced saw the mesh (a program traced without it would run the
    # Pallas kernels unsharded on GPUs while CPU tokens stayed equal).
    r = cases["slots_calls"]
    assert r["slots_same"] and r["buckets"] == [8, 16, 32], r
    assert r["kernel_traces"] > 0 and r["kernel_saw_mesh"], r
    r = cases["slots_program"]
    # The slots split by row over `data` (3 slots rounded up to 4: 2 a device), the queue
    # replicated; the forward's [rows, L, D] all-reduces over `model` carry 2 rows (4 if the
    # slots ran replicated), and no all-gather result (tuples included) is larger than per-row
    # state (the generated columns of the 4 slots, 4 x 8 tokens; a gathered activation would
    # hold d_model = 128 per row).
    assert (r["slot_spec"], r["queue_spec"]) == ("P('data',)", "P()"), r
    assert r["activation_rows"] == [2], r
    assert 0 < r["max_gather"] <= 4 * 8, r


def test_fp8_ffn_is_split_over_the_model_axis(cases):
    for name, model in (("fp8_split/data1_model2", 2), ("fp8_split/data2_model2", 2)):
        r = cases[name]
        # Every FP8 array and scale splits evenly, so each device holds exactly 1/model
        # (integer bytes: d_ff / model is whole 128-blocks); replicated would be all of it.
        assert r["per_device"] == [r["full"] // model] and r["full"] % model == 0, r
    for g in ("group", "token", "tensor"):
        # The split FFN quantises the same activations with the same scales (the ablation's
        # row / tensor amax is taken over both shards); only the fp32 sum of the two halves
        # of the down GEMM's K is in another order: a few ulp (2^-24 ~ 6e-8) of the output.
        # A scale taken per shard instead moves it by FP8 rounding (~3e-2).
        assert cases[f"ffn_split/{g}"]["rel_err"] <= 1e-6, cases[f"ffn_split/{g}"]
    error = cases["fp8_model4_refused"]["error"]
    assert error and "d_ff" in error and "128" in error and "model axis (4)" in error, error
    assert cases["fp8_model4_bf16_runs"]["same"]


@pytest.mark.parametrize("ffn", ["bf16", "fp8"])
def test_tensor_parallel_program_moves_no_weight(cases, ffn):
    r = cases[f"hlo/{ffn}"]
    # No collective as large as a weight shard: the only ones that belong are the per-layer
    # all-reduces of [1, L, D] activations (and small sampling ones), far below it.
    assert r["collectives"] == [], r["collectives"]
    # No weight-sized move (copy, slice, transpose, ...) at any while-loop depth (0 once per
    # call, 2 every step): the partitioner repairs no weight layout, per step or per call.
    # For FP8 on the CPU the reference GEMM widens the FP8 weights: exactly the moves of the
    # one-device program, by depth and opcode, and no more.
    if ffn == "bf16":
        assert r["moves"] == [], r["moves"]
    else:
        assert r["one_device_collectives"] == []
        assert r["moves"] == r["one_device_moves"], r
        assert r["same"]  # and the two programs give the same tokens


def test_multi_gpu_benchmark_runs_tiny(cases):
    """benchmarks/multi_gpu.py --tiny --tp dual+fp8 on 2 fake devices: it runs, each device
    holds half of every matrix, the FP8 copies included, and its program gathers none."""
    (row,) = cases["benchmark_tiny"]["rows"]
    assert row["gpus"] == 2 and row["setting"] == "dual+fp8" and row["ms_per_step"] > 0
    assert round(row["weight_gb_per_gpu"] * 1e9) == cases["benchmark_tiny"][
        "expected_bytes_per_gpu"]
    # Streamed per step: the FP8 FFN in place of the bf16 one it leaves unread.
    assert row["streamed_gb_per_gpu"] < row["weight_gb_per_gpu"]
    assert row["collectives"] == []


def test_weight_move_count_sees_a_mismatched_layout(cases):
    """The control: FP8 down split along the wrong axis must show up in the same counts."""
    r, ok = cases["hlo_control/fp8_down_by_rows"], cases["hlo/fp8"]
    assert r["collectives"] or r["moves"] != ok["moves"], r
