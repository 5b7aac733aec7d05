"""benchmarks.common's trace summary: the idle-gap arithmetic, and `profile` read back from a
real trace in a fresh process (a trace's threads depend on what the process ran before: in the
full suite an in-process trace once held no python-thread events); the benchmarks' helpers
leave no temporary files behind."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from benchmarks.common import idle_gaps
from tests.conftest import ROOT


@pytest.mark.parametrize("spans, min_ns, want", [
    ([], 0, (0.0, 0)),
    ([(0, 10)], 0, (0.0, 0)),
    ([(0, 10), (5, 20), (30, 40)], 0, (10.0, 1)),        # overlap merged, one gap of 10
    ([(30, 40), (0, 10), (12, 14)], 5, (18.0, 1)),       # unsorted; gaps 2 and 16, one > 5
    ([(0, 100), (10, 20), (50, 60), (120, 130)], 0, (20.0, 1)),  # nested spans leave no gap
])
def test_idle_gaps(spans, min_ns, want):
    assert idle_gaps(spans, min_ns) == want


def run_fresh(code: str, tmpdir: Path | None = None) -> subprocess.CompletedProcess:
    """`code` in a fresh CPU-only python (a trace's threads depend on the process's past),
    its temporary files under `tmpdir` if given."""
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300,
                          env={**env, "TMPDIR": str(tmpdir)} if tmpdir else env)


def test_profile_reads_a_trace_back(tmp_path):
    """... and removes the trace it wrote (each run used to leave one in /tmp)."""
    code = (
        "import jax, jax.numpy as jnp, numpy as np\n"
        "from benchmarks.common import profile\n"
        "f = jax.jit(lambda x: jnp.sin(x) @ x)\n"
        "x = np.ones((128, 128), np.float32)\n"
        "f(x).block_until_ready()\n"
        "print(profile(lambda: [jax.device_get(f(x)) for _ in range(4)], 4))\n")
    r = run_fresh(code, tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []
    head, *rest = r.stdout.rstrip().splitlines()
    assert head.startswith("  trace: wall ") and "ms/step, device kernels" in head
    # The CPU client runs the program on its own thread: the host lines always include it.
    assert any(line.startswith("    host ") for line in rest), r.stdout


def test_device_chained_reads_the_programs_kernels():
    """`device_chained` on a real trace in a fresh process: on this CPU machine the trace
    holds no device stream, so the span and kernel times are NaN (not 0, which would read as
    infinitely fast); the call count is kept."""
    code = (
        "import jax.numpy as jnp, math\n"
        "from benchmarks.common import device_chained\n"
        "t = device_chained(lambda x: jnp.sin(x) @ x, jnp.ones((64, 64)), n=3)\n"
        "assert math.isnan(t['span_ms']) and math.isnan(t['kernels_ms']) and t['n'] == 3, t\n"
        "assert t['largest'] is None and t['wall_ms'] > 0, t\n"
        "print('ok')\n")
    r = run_fresh(code)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_device_chained_arithmetic(monkeypatch):
    """Per call: the span from the first kernel's start to the last one's end (the gap
    between kernels counts), the kernels' summed time and each name's launches, each over the
    n chained calls."""
    import collections

    from benchmarks import common
    fake = common.Trace(wall=1.0, device=collections.Counter({"gemm": 3_000_000, "q": 1_000_000}),
                        spans=[(5_000_000, 7_000_000), (1_000_000, 3_000_000)],
                        host=collections.Counter(),
                        count=collections.Counter({"gemm": 4, "Memset": 2}))
    monkeypatch.setattr(common, "trace", lambda run: fake)
    monkeypatch.setattr(common, "_chained", lambda fn, n: lambda *a: 0)
    t = common.device_chained(None, n=2)
    # (7 - 1) ms / 2; 4 ms / 2; the 2 ms gap / 2; the GEMM's 3 ms / 2; 1 s / 2; launches / 2
    assert t == {"n": 2, "wall_ms": 500.0, "span_ms": 3.0, "kernels_ms": 2.0, "idle_ms": 1.0,
                 "largest": ("gemm", 1.5), "launches": {"gemm": 2.0, "Memset": 1.0}}


def test_demo_model_and_task_tokenizers_load_without_leaving_files(tmp_path, monkeypatch):
    """`load_model` without a checkpoint (serve's and flash's demo runs) converts demo_model/
    into a temporary checkpoint and `train_demo`'s encoders write a task's tokenizer: both
    load whole, so nothing is left in the temporary directory (each run used to leave a
    checkpoint or a tokenizer there)."""
    import tempfile

    from benchmarks import common, train_demo
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cfg, params, tok = common.load_model()
    assert cfg.n_layers == 8 and len(params.layers) == 8
    assert tok.decode(tok.encode("12+3=")) == "12+3="
    encoder = train_demo._encoder.__wrapped__("arith")
    assert encoder.tokenizer.encode("12+3=") == tok.encode("12+3=")
    assert list(tmp_path.iterdir()) == []


PTX = """
.version 8.4
.visible .entry fp8_matmul_kernel(
    .param .u64 p0
)
{
    ld.param.u64 %rd1, [p0];
$L__BB0_1:
    cp.async.cg.shared.global [%r1], [%rd2], 16;
    cp.async.commit_group;
    @%p1 ld.global.b32 %r2, [%rd3];
$L__BB0_2:
    wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%f1}, %rd4, %rd5, 1, 1, 1;
    @%p2 bra $L__BB0_2;
    cp.async.wait_group 1;
    bar.sync 0;
    @!%p3 bra.uni $L__BB0_1;
    st.global.b32 [%rd6], %r3;
    ret;
}
.visible .entry other_kernel(
    .param .u64 p0
)
{
    ld.global.b32 %r1, [%rd1];
    ret;
}
"""


def test_ptx_loops_counts_each_loops_instructions(tmp_path, capsys):
    """`benchmarks.ptx_loops`: a kernel's loops (nested ones too) and what each does, from a
    dump directory's .ptx files; kernels by name; a directory without one says so."""
    from benchmarks import ptx_loops
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "module_0001.ptx").write_text(PTX)
    kernels = ptx_loops.kernels(PTX)
    assert list(kernels) == ["fp8_matmul_kernel", "other_kernel"]
    outer, inner = ptx_loops.loops(kernels["fp8_matmul_kernel"])
    assert (outer.counts["cp.async"], outer.counts["async wait"], outer.counts["ld.global"],
            outer.counts["wgmma"], outer.counts["bar"], outer.counts["st.global"]) == (
        1, 2, 1, 1, 1, 0)
    assert inner.counts["wgmma"] == 1 and inner.counts["instructions"] == 2
    assert inner.first > outer.first and inner.last < outer.last
    lines = ptx_loops.report(tmp_path, "fp8_matmul", top=3)
    assert len(lines) == 3 and lines[0].startswith("module_0001.ptx fp8_matmul_kernel: ")
    assert "st.global 1" in lines[0] and "ld.global 1" in lines[1]
    assert ptx_loops.report(tmp_path, "absent", 3)[0].startswith("no kernel named *absent*")
    saved = ptx_loops.save(tmp_path, "kernel", tmp_path / "out", most=1)
    assert [p.name for p in saved] == ["fp8_matmul_kernel.ptx"]
    assert saved[0].read_text().splitlines() == kernels["fp8_matmul_kernel"]


def test_triton_ptx_writes_the_fp8_gemms_triton_module(tmp_path):
    """`benchmarks/triton_ptx.py` without a GPU: the FP8 GEMM's Triton module at the down
    GEMM's decode shape, with `--tiles` changes applied (a bool and an int field: the
    untransposed tile's module differs), a misspelt field refused."""
    from benchmarks.triton_ptx import parse_tiles, triton_module
    from kernels.fp8_matmul_triton import TritonTiles
    base = TritonTiles.get_default(32, 4096, 12288)
    assert base.swap
    changed = parse_tiles(base, "swap=0,num_stages=4")
    assert changed == dataclasses.replace(base, swap=False, num_stages=4)
    texts = [triton_module(32, 12288, 4096, t) for t in (base, changed)]
    assert all("tt.func public @fp8_matmul" in t for t in texts) and texts[0] != texts[1]
    with pytest.raises(SystemExit, match="no field 'stages'"):
        parse_tiles(base, "stages=1")


def test_triton_ptx_writes_the_flash_cache_kernels_triton_module():
    """`triton_ptx --kernel flash_cache`: the fused cache update's Triton module at a batch-1
    flash step's 128 rows, its tiles changed by `--tiles` (64-deep chunks: the loop's dots
    take 64-row slices of the weights), a misspelt field refused."""
    from benchmarks.triton_ptx import flash_cache_module, parse_tiles
    from kernels.flash_cache import BlockSizes
    base = BlockSizes.get_default(128, 4096)
    deep = parse_tiles(base, "rows=128,depth=128,warps=8,stages=3")
    assert deep == BlockSizes(128, 128, 8, 3)
    texts = [flash_cache_module(128, b) for b in (base, deep)]
    assert all("tt.func public @flash_cache" in t for t in texts)
    dots = [[line for line in t.splitlines() if "tt.dot" in line] for t in texts]
    assert all(len(d) == 2 for d in dots)  # a dot per RoPE half
    assert "tensor<64x64xbf16> * tensor<64x64xbf16>" in dots[0][0]
    assert "tensor<128x128xbf16> * tensor<128x64xbf16>" in dots[1][0]
    with pytest.raises(SystemExit, match="BlockSizes has no field 'tile'"):
        parse_tiles(base, "tile=1")


def test_fp8_dots_get_max_num_imprecise_acc_when_set(monkeypatch):
    """`fp8_matmul_triton.IMPRECISE_ACC`: unset, the FP8 dot is lowered as Pallas lowers it
    (no maxNumImpreciseAcc: Triton then upcasts to f16 for mma.sync); set, every FP8 dot of
    the module carries it (Triton may then use wgmma) and the module still verifies."""
    from benchmarks.triton_ptx import triton_module
    from kernels import fp8_matmul_triton as tr
    from tests.conftest import assert_valid_triton
    t = tr.TritonTiles.get_default(32, 4096, 12288)
    dots = lambda text: [line for line in text.splitlines() if "tt.dot" in line]
    assert all("maxNumImpreciseAcc" not in d for d in dots(triton_module(32, 12288, 4096, t)))
    monkeypatch.setattr(tr, "IMPRECISE_ACC", 32)
    got = dots(triton_module(32, 12288, 4096, t))
    assert got and all("maxNumImpreciseAcc = 32 : i32" in d for d in got)
    x = jax.ShapeDtypeStruct((32, 12288), jnp.float8_e4m3fn)
    xs = jax.ShapeDtypeStruct((32, 96), jnp.float32)
    w = jax.ShapeDtypeStruct((4096, 12288), jnp.float8_e4m3fn)
    ws = jax.ShapeDtypeStruct((32, 96), jnp.float32)
    assert_valid_triton(lambda *a: tr.fp8_matmul_pallas(*a, tiles=t), x, xs, w, ws)
