"""Shared test helpers: random LLaDA checkpoints in the real HF layout, written independently of
our exporter, and the independent PyTorch reference (`transformers` Llama, bidirectional mask)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def _cpu_only() -> bool:
    """Whether this install can run JAX on the CPU alone (no GPU plugin): decided before JAX
    starts, since XLA reads its flags once."""
    import importlib.metadata as md
    if md.entry_points(group="jax_plugins"):  # a PJRT plugin (jax's CUDA one registers here)
        return False
    return not any((d.metadata["Name"] or "").lower().startswith(("jax-cuda", "jax-rocm"))
                   for d in md.distributions())


def xla_flags(*extra: str, optimised: bool = False) -> str:
    """This run's XLA flags with `extra` (a subprocess's fake devices) added; `optimised`:
    without the optimisation level this suite set (`CPU_OPT_LEVEL`), for a subprocess whose
    time goes to running its programs rather than compiling them."""
    drop = CPU_OPT_LEVEL if optimised and os.environ.get(_LEVEL_MARK) else None
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if f != drop]
    return " ".join([*flags, *extra])


# On a CPU-only machine, XLA's LLVM back end at optimisation level 0: most of this suite's
# time goes to compiling many small programs. On the two-core development machine one
# compile-bound test took 23 s at level 0, 27 at level 1 and 31-33 at the default, while the
# chain model's 8 problems (execution-bound) took 161 s at level 0 against 83; over the
# whole suite level 0 came out fastest (19:38, level 1 20:55; 24:34 at the default the
# evening before). The level is how hard the generated code is optimised: every test
# compares programs built under the same flags, and the whole suite passes at levels 0, 1 and
# the default. Subprocesses inherit it through the environment (`xla_flags`), except the
# shipped models' accuracy runs, execution-bound, which run at the default level
# (`accuracy_record`); a level already in XLA_FLAGS is kept. _LEVEL_MARK tells the
# pytest-xdist workers, which inherit the flags, that the level is this suite's own.
CPU_OPT_LEVEL = "--xla_backend_optimization_level=0"
_LEVEL_MARK = "LACACHE_JAX_TESTS_SET_OPT_LEVEL"
if _cpu_only() and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = xla_flags(CPU_OPT_LEVEL)
    os.environ[_LEVEL_MARK] = "1"


import jax  # noqa: E402  (after XLA_FLAGS)
import ml_dtypes  # noqa: E402
import numpy as np
import pytest

import lacache_jax as lj
from convert.__main__ import main as convert_main
from lacache_jax.config import ModelConfig, tiny

ROOT = Path(__file__).resolve().parent.parent

# On the CPU, one XLA compilation cache for the whole run: its two pytest-xdist workers and
# the subprocesses they start (through the environment) share what each compiled, and
# programs traced again under new jit wrappers (closures made per test) are compiled once. A
# hit is the executable XLA built from the same program and options, so results are the same
# bits. Made fresh by the process that starts the run (pytest-xdist's controller, whose
# environment its workers inherit), which removes it at the end; a cache directory set by the
# user is used and kept. Not on the GPU, whose runs are few and whose custom calls (the
# cuBLASLt handler) need not survive serialisation.
_OWN_CACHE = None
if jax.default_backend() == "cpu":
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        _OWN_CACHE = tempfile.mkdtemp(prefix="lacache_jax_tests_jit_")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                      int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))

# REFERENCE.md §2: LLaDA name -> transformers Llama name ({i} is the block index).
LLADA_TO_LLAMA = {
    "model.transformer.wte.weight": "model.embed_tokens.weight",
    "model.transformer.ln_f.weight": "model.norm.weight",
    "model.transformer.ff_out.weight": "lm_head.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "q_proj.weight": "self_attn.q_proj.weight",
    "k_proj.weight": "self_attn.k_proj.weight",
    "v_proj.weight": "self_attn.v_proj.weight",
    "attn_out.weight": "self_attn.o_proj.weight",
    "ff_norm.weight": "post_attention_layernorm.weight",
    "ff_proj.weight": "mlp.gate_proj.weight",
    "up_proj.weight": "mlp.up_proj.weight",
    "ff_out.weight": "mlp.down_proj.weight",
}


def random_llada_state(cfg: ModelConfig, seed: int = 0,
                       head_std: float = 0.05) -> dict[str, np.ndarray]:
    """Random fp32 weights under LLaDA names and PyTorch shapes ([out, in]).

    Norm weights are drawn around 1 (not exactly 1) so a misplaced norm weight shows up. A
    large `head_std` makes the output distributions peaked, so that confidence thresholds
    are crossed as with a trained model.
    """
    rng = np.random.default_rng(seed)
    D, F, V, K = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.head_dim
    H, G = cfg.n_heads, cfg.n_kv_heads

    def mat(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    def norm():
        return (1.0 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    state = {"model.transformer.wte.weight": mat(V, D)}
    for i in range(cfg.n_layers):
        b = f"model.transformer.blocks.{i}."
        state.update({b + "attn_norm.weight": norm(), b + "q_proj.weight": mat(H * K, D),
                      b + "k_proj.weight": mat(G * K, D), b + "v_proj.weight": mat(G * K, D),
                      b + "attn_out.weight": mat(D, H * K), b + "ff_norm.weight": norm(),
                      b + "ff_proj.weight": mat(F, D), b + "up_proj.weight": mat(F, D),
                      b + "ff_out.weight": mat(D, F)})
    state["model.transformer.ln_f.weight"] = norm()
    if not cfg.tie_embeddings:
        state["model.transformer.ff_out.weight"] = mat(V, D) * (head_std / 0.05)
    return state


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Write with the `safetensors` package itself (through torch, which has bf16), never
    with the converter's own reader/writer, so the two cannot share a misreading."""
    import torch
    from safetensors.torch import save_file

    def to_torch(a):
        if a.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(a.view(np.uint16).astype(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(a))
    save_file({n: to_torch(a) for n, a in tensors.items()}, str(path))


def write_hf_llada(path: Path, cfg: ModelConfig, state: dict[str, np.ndarray], *,
                   dtype=np.float32, n_shards: int = 3, hf_config: dict | None = None) -> Path:
    """Write `state` as a HF LLaDA directory: config.json, `n_shards` safetensors shards and
    model.safetensors.index.json (or a single model.safetensors when n_shards == 1)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config or cfg.to_hf()))
    names = list(state)
    groups = [names[k::n_shards] for k in range(n_shards)]
    if n_shards == 1:
        write_safetensors(path / "model.safetensors", {n: state[n].astype(dtype) for n in names})
        return path
    weight_map = {}
    for k, group in enumerate(groups, 1):
        fname = f"model-{k:05d}-of-{n_shards:05d}.safetensors"
        write_safetensors(path / fname, {n: state[n].astype(dtype) for n in group})
        weight_map.update({n: fname for n in group})
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return path


def hf_llama(cfg: ModelConfig, state: dict[str, np.ndarray], torch_dtype):
    """transformers LlamaForCausalLM holding the LLaDA weights (REFERENCE.md §2)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(
        hidden_size=cfg.d_model, intermediate_size=cfg.d_ff, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_seq_len,
        tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, mlp_bias=False,
        hidden_act="silu", attn_implementation="eager")
    model = LlamaForCausalLM(config).eval()
    mapped = {}
    for name, w in state.items():
        if name in LLADA_TO_LLAMA:
            mapped[LLADA_TO_LLAMA[name]] = w
            continue
        _, _, _, i, *rest = name.split(".")
        mapped[f"model.layers.{i}.{LLADA_TO_LLAMA['.'.join(rest)]}"] = w
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)).to(torch_dtype)
               for k, v in mapped.items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # Tied heads legitimately have no lm_head entry; nothing else may be missing.
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if cfg.tie_embeddings else set())
    return model.to(torch_dtype)


def hf_logits(model, tokens: np.ndarray, key_mask: np.ndarray | None = None,
              positions: np.ndarray | None = None) -> np.ndarray:
    """Bidirectional forward: a 4-D additive mask that is zero except on padded keys."""
    import torch
    B, L = tokens.shape
    dtype = next(model.parameters()).dtype
    mask = torch.zeros(B, 1, L, L, dtype=dtype)
    if key_mask is not None:
        mask[torch.from_numpy(~key_mask.astype(bool))[:, None, None, :].expand(B, 1, L, L)] = (
            torch.finfo(dtype).min)
    kwargs = {} if positions is None else {"position_ids": torch.from_numpy(positions).long()}
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(tokens).long(), attention_mask=mask, **kwargs)
    return out.logits.float().numpy()


def record_forward_widths(monkeypatch) -> tuple[set, list]:
    """Patch `cache.run_blocks` (every forward's layer stack) to record its query-row count:
    (the widths traced, the widths of the forwards as they run, in order)."""
    from lacache_jax import cache
    traced, executed = set(), []
    real = cache.run_blocks

    def recording(x_BLD, *args, **kwargs):
        L = x_BLD.shape[1]
        traced.add(L)
        jax.debug.callback(lambda: executed.append(L))
        return real(x_BLD, *args, **kwargs)
    monkeypatch.setattr(cache, "run_blocks", recording)
    return traced, executed


def cpu_subprocess_env(out: Path, *flags: str, optimised: bool = False) -> dict[str, str]:
    """The environment of a subprocess running this checkout's modules on the CPU: this
    run's, with benchmark results under `out` and XLA's flags as `xla_flags(*flags,
    optimised=optimised)`."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": xla_flags(*flags, optimised=optimised), "OUT": str(out)}


def accuracy_record(checkpoint: Path, task: str, n: int, seed: int, modes: str,
                    out: Path) -> dict:
    """`python -m benchmarks.accuracy` on n held-out problems as one ragged batch (--slots 0),
    in a subprocess at XLA's default optimisation level (`xla_flags(optimised=True)`): the
    shipped models' accuracy runs are bound by executing their programs, not compiling them
    (the chain model's 8 problems: 59 s there against 118 s at level 0). Returns its JSON
    record, written under `out`."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.accuracy", "--checkpoint",
                           str(checkpoint), "--task", task, "--n", str(n), "--seed", str(seed),
                           "--slots", "0", "--modes", modes, "--no-plot"],
                          cwd=ROOT, env=cpu_subprocess_env(out, optimised=True),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (record,) = [json.loads(f.read_text()) for f in out.glob("accuracy*.json")]
    return record


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# The model of the generation tests (tests/test_generate.py, tests/test_lacache.py).
GEN_CFG = tiny(n_heads=4, n_kv_heads=2)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Our fp32 params (through convert + load) and the transformers reference, same weights;
    a large head makes confidences peaked like a trained model's, so thresholds matter."""
    tmp = tmp_path_factory.mktemp("gen")
    state = random_llada_state(GEN_CFG, seed=7, head_std=2.0)
    write_hf_llada(tmp / "hf", GEN_CFG, state)
    assert convert_main([str(tmp / "hf"), str(tmp / "ck"), "--dtype", "float32", "--quiet"]) == 0
    import torch
    return lj.load(tmp / "ck")[1], hf_llama(GEN_CFG, state, torch.float32)


# The longest files first, longest first (the multi-device cases ahead of generate: their one
# fixture's subprocess cannot be split) (seconds of work at optimisation level 0 on the
# development machine, 2026-12-07: the multi-device cases' subprocess 160-183, generate 187,
# the FP8 kernels 166, lm_eval 122, the chain model 104 (its subprocess at the default
# level), then 60-95 each; the rest under 60):
# under the README's `-n 2 --dist loadfile --no-loadscope-reorder` pytest-xdist deals whole
# files to its two workers in collection order and the short files fill in at the end. In
# name order a worker took a long file last while the other idled (the multi-device cases
# began at 99% of a run); without `--no-loadscope-reorder` (pytest-xdist 3.8+), pytest-xdist
# (3.5 and later) deals the files with the most tests first instead, whatever this order.
LONGEST_FIRST = ("test_multi_device.py", "test_generate.py", "test_fp8_kernels.py",
                 "test_lm_eval.py", "test_chain_model.py", "test_flash_cache.py",
                 "test_fp8_mgpu_ws.py", "test_lacache.py", "test_slots.py",
                 "test_cached_attention.py", "test_quant.py", "test_cached_attention_mgpu.py")


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    import jax
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: else as collected
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def bf16():
    return np.dtype(ml_dtypes.bfloat16)


def assert_valid_triton(fn, *args, n_kernels: int = 1):
    """Lower jitted `fn(*args)` for CUDA on the CPU and run MLIR's verifier on every Triton
    module it makes: catches what the GPU compiler first rejects (e.g. scf.for bounds of
    mixed types) without a GPU."""
    from benchmarks.triton_ptx import triton_modules
    verified = triton_modules(fn, *args, each=lambda module: module.operation.verify())
    assert verified == [True] * n_kernels
