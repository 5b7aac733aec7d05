"""`python -m convert`: formats it reads, what it writes, and clean refusals of bad input."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lacache_jax as lj
from convert import export_hf
from convert import safetensors_file as stf
from convert.__main__ import main as convert_main
from tests.conftest import ROOT, random_llada_state, write_hf_llada

CFG = lj.tiny(n_heads=4, n_kv_heads=2)


@pytest.fixture
def hf_dir(tmp_path):
    """A tiny HF LLaDA directory with a tokenizer (any: convert copies it unread)."""
    hf = write_hf_llada(tmp_path / "hf", CFG, random_llada_state(CFG), dtype=np.float32)
    shutil.copy2(ROOT / "demo_model" / "tokenizer.json", hf / "tokenizer.json")
    return hf


def _run(src, dst, *extra):
    return convert_main([str(src), str(dst), "--quiet", *extra])


def _assert_weights_match(params, state, dtype):
    """Every array equals its sources, transposed from [out, in], cast to `dtype`; fused
    matrices hold their parts side by side (q | k | v, gate | up)."""
    def same(ours, *hf, transposed=True):
        want = np.concatenate([h.T if transposed else h for h in hf], axis=-1)
        np.testing.assert_array_equal(np.asarray(ours), want.astype(dtype))
    same(params.embed, state["model.transformer.wte.weight"], transposed=False)
    same(params.head, state["model.transformer.ff_out.weight"])
    same(params.norm_f, state["model.transformer.ln_f.weight"], transposed=False)
    for i, layer in enumerate(params.layers):
        b = f"model.transformer.blocks.{i}."
        same(layer.w_qkv, *(state[b + f"{x}_proj.weight"] for x in "qkv"))
        same(layer.wo, state[b + "attn_out.weight"])
        same(layer.w_gate_up, state[b + "ff_proj.weight"], state[b + "up_proj.weight"])
        same(layer.w_down, state[b + "ff_out.weight"])
        same(layer.attn_norm, state[b + "attn_norm.weight"], transposed=False)
        same(layer.ff_norm, state[b + "ff_norm.weight"], transposed=False)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_sharded_safetensors(tmp_path, hf_dir, dtype):
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (hf_dir / f).write_text("{}")
    assert _run(hf_dir, tmp_path / "out", "--dtype", dtype) == 0
    cfg, params = lj.load(tmp_path / "out")
    assert cfg == CFG and params.dtype == jnp.dtype(dtype)
    _assert_weights_match(params, random_llada_state(CFG), jnp.dtype(dtype))
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()


def test_bf16_source_single_file_and_bare_names(tmp_path, bf16):
    state = random_llada_state(CFG, seed=1)
    bare = {k.removeprefix("model."): v for k, v in state.items()}
    src = write_hf_llada(tmp_path / "hf", CFG, bare, dtype=bf16, n_shards=1)
    assert _run(src, tmp_path / "out") == 0
    _, params = lj.load(tmp_path / "out")
    _assert_weights_match(params, {k: v.astype(bf16) for k, v in state.items()}, bf16)


def test_pytorch_state_dict(tmp_path):
    import torch
    state = random_llada_state(CFG, seed=2)
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(CFG.to_hf()))
    torch.save({k: torch.from_numpy(v).to(torch.bfloat16) for k, v in state.items()},
               src / "pytorch_model.bin")
    assert _run(src, tmp_path / "out", "--dtype", "float32") == 0
    _, params = lj.load(tmp_path / "out")
    bf16 = np.dtype(jnp.bfloat16)
    _assert_weights_match(params, {k: v.astype(bf16) for k, v in state.items()}, np.float32)


def test_tied_embeddings(tmp_path):
    cfg = lj.tiny(tie_embeddings=True)
    state = random_llada_state(cfg, seed=3)
    src = write_hf_llada(tmp_path / "hf", cfg, state)
    assert _run(src, tmp_path / "out", "--dtype", "float32") == 0
    cfg2, params = lj.load(tmp_path / "out")
    assert cfg2.tie_embeddings and params.head is None
    h = np.random.default_rng(0).standard_normal((1, 1, cfg.d_model)).astype(np.float32)
    logits = lj.model.lm_head(params, cfg, jnp.asarray(h))
    embed = state["model.transformer.wte.weight"]
    ref = lj.model.rms_norm(h, params.norm_f, cfg.norm_eps) @ embed.T
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), rtol=1e-6, atol=1e-6)


def test_export_then_convert_round_trip(tmp_path):
    params = lj.init_params(CFG, jax.random.key(0), jnp.float32)
    export_hf(tmp_path / "hf", CFG, params, dtype=jnp.float32, max_shard_bytes=40_000)
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert _run(tmp_path / "hf", tmp_path / "out", "--dtype", "float32") == 0
    cfg, back = lj.load(tmp_path / "out")
    assert cfg == CFG
    jax.tree.map(np.testing.assert_array_equal, back, params)


# --- bad input: one clean line naming the culprit, exit 1, nothing left behind ------------

def _drop(hf: Path, name: str):
    shard, tensors = _shard_of(hf, name)
    del tensors[name]
    stf.write_file(hf / shard, tensors)
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    del index["weight_map"][name]
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))


def _put(hf: Path, name: str, value: np.ndarray, shard: str = "model-00001-of-00003.safetensors"):
    tensors = {n: stf.read_tensor(i) for n, i in stf.read_header(hf / shard).items()}
    tensors[name] = value
    stf.write_file(hf / shard, tensors)
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    index["weight_map"][name] = shard
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))


def _shard_of(hf: Path, name: str):
    shard = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"][name]
    return shard, {n: stf.read_tensor(i) for n, i in stf.read_header(hf / shard).items()}


def _set_config(hf: Path, **kv):
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, **kv}))


def _del_config(hf: Path, key: str):
    cfg = json.loads((hf / "config.json").read_text())
    del cfg[key]
    (hf / "config.json").write_text(json.dumps(cfg))


def _set_shard(hf: Path, name: str, shard: str):
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    index["weight_map"][name] = shard
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))


def _overlap(path: Path):
    """Point a shard's second tensor at its first one's bytes (the file's size unchanged)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    first, second = sorted((k for k in header if k != "__metadata__"),
                           key=lambda k: header[k]["data_offsets"][0])[:2]
    size = header[second]["data_offsets"][1] - header[second]["data_offsets"][0]
    header[second]["data_offsets"] = [0, size]
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (n - len(head))
    assert len(head) == n, "the edited header must keep its length"
    path.write_bytes(raw[:8] + head + raw[8 + n:])


def _truncate(hf: Path, nbytes: int = 100):
    path = hf / "model-00003-of-00003.safetensors"
    os.truncate(path, path.stat().st_size - nbytes)


HEAD = "model.transformer.ff_out.weight"
Q1 = "model.transformer.blocks.1.q_proj.weight"
BAD_INPUTS = {
    "missing_key": (lambda hf: _drop(hf, Q1), f"hf: missing key '{Q1}': no file of it holds"),
    "unexpected_key": (
        lambda hf: _put(hf, "model.transformer.extra.weight", np.ones(3, np.float32)),
        "unexpected key 'model.transformer.extra.weight'"),
    "wrong_shape": (lambda hf: _put(hf, Q1, np.ones((64, 60), np.float32),
                                    _shard_of(hf, Q1)[0]),
                    f"'{Q1}' has shape [64, 60], config.json implies [64, 64]"),
    "truncated_shard": (_truncate, "model-00003-of-00003.safetensors: truncated"),
    "corrupt_header": (lambda hf: (hf / "model-00002-of-00003.safetensors").write_bytes(
        b"\xff" * 64), "model-00002-of-00003.safetensors: corrupt or truncated header"),
    "missing_shard": (lambda hf: (hf / "model-00002-of-00003.safetensors").unlink(),
                      "shard model-00002-of-00003.safetensors is missing"),
    "unsupported_config": (lambda hf: _set_config(hf, alibi=True),
                           "unsupported value alibi=True"),
    "bad_config_value": (lambda hf: _set_config(hf, n_heads=3),
                         "d_model=64 is not divisible by n_heads=3"),
    "missing_config": (lambda hf: (hf / "config.json").unlink(), "config.json: no such file"),
    "int_weights": (lambda hf: _put(hf, Q1, np.ones((64, 64), np.int32), _shard_of(hf, Q1)[0]),
                    f"'{Q1}' has unsupported dtype int32"),
    "nan_in_last_tensor": (lambda hf: _put(hf, HEAD, np.full((320, 64), np.nan, np.float32),
                                           _shard_of(hf, HEAD)[0]),
                           f"'{HEAD}' holds NaN or Inf"),
    "tied_but_head_present": (lambda hf: _set_config(hf, weight_tying=True),
                              "separate LM head"),
    "no_weights": (lambda hf: [p.unlink() for p in hf.glob("model*")], "no weights found"),
    "fp8_skip_alone": (lambda hf: None, "--fp8-skip without --fp8-ffn", ("--fp8-skip", "1")),
    "missing_config_key": (lambda hf: _del_config(hf, "layer_norm_type"),
                           "missing required key 'layer_norm_type' (LLaDA's code default, "
                           "'default', is not implemented)"),
    "nan_rope_theta": (lambda hf: _set_config(hf, rope_theta=float("nan")),
                       "rope_theta must be a positive finite number, got nan"),
    "single_file_beside_index": (
        lambda hf: stf.write_file(hf / "model.safetensors", {"x": np.ones(2, np.float32)}),
        "holds both model.safetensors and model.safetensors.index.json"),
    "shard_outside_source": (lambda hf: _set_shard(hf, Q1, "../model-00001-of-00003.safetensors"),
                             "shard '../model-00001-of-00003.safetensors' is not a file inside"),
    "overlapping_tensors": (lambda hf: _overlap(hf / "model-00002-of-00003.safetensors"),
                            "model-00002-of-00003.safetensors: corrupt header: "),
    "llama_config": (lambda hf: (hf / "config.json").write_text(json.dumps(
        {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4})),
        "a llama config (hidden_size, not LLaDA's d_model)"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_refused_cleanly(tmp_path, hf_dir, capsys, case):
    damage, message, *flags = BAD_INPUTS[case]
    damage(hf_dir)
    capsys.readouterr()
    assert _run(hf_dir, tmp_path / "out", *(flags[0] if flags else ())) == 1
    err = capsys.readouterr().err
    assert err.startswith("convert: error: ") and err.count("\n") == 1, err
    assert message in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no DST, no temporary dir


def test_existing_destination(tmp_path, hf_dir, capsys):
    """An existing DST needs --force, which replaces a checkpoint or an empty directory and
    refuses anything else (a directory of other files, a file), leaving it as it was."""
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep").write_text("x")
    assert _run(hf_dir, dst) == 1
    assert "already exists (--force replaces it)" in capsys.readouterr().err
    assert _run(hf_dir, dst, "--force") == 1
    err = capsys.readouterr().err
    assert err.startswith("convert: error: ") and "holds no lacache.json" in err, err
    assert (dst / "keep").read_text() == "x"
    (tmp_path / "file").write_text("y")
    assert _run(hf_dir, tmp_path / "file", "--force") == 1
    assert (tmp_path / "file").read_text() == "y"
    (dst / "keep").unlink()
    assert _run(hf_dir, dst, "--force") == 0 and lj.load(dst)[0] == CFG  # empty: replaced
    (dst / "stray").write_text("z")
    assert _run(hf_dir, dst, "--force") == 0  # a checkpoint: replaced whole
    assert not (dst / "stray").exists() and lj.load(dst)[0] == CFG
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "hf", "out"]


def test_failed_force_keeps_the_old_destination(tmp_path, hf_dir):
    assert _run(hf_dir, tmp_path / "out") == 0
    _truncate(hf_dir)
    assert _run(hf_dir, tmp_path / "out", "--force") == 1
    assert lj.load(tmp_path / "out")[0] == CFG


def test_refuses_to_overwrite_source(hf_dir, capsys):
    assert _run(hf_dir, hf_dir, "--force") == 1
    assert "would overwrite the source" in capsys.readouterr().err
    assert (hf_dir / "config.json").is_file()


def test_cli_subprocess(tmp_path, hf_dir):
    """The real entry point: progress on stderr, summary on stdout, no traceback on error."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ok = subprocess.run([sys.executable, "-m", "convert", str(hf_dir), str(tmp_path / "out")],
                        capture_output=True, text=True, env=env, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "wrote" in ok.stdout and "2 layers" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "convert", str(tmp_path / "nope"),
                          str(tmp_path / "out2")], capture_output=True, text=True, env=env,
                         cwd=tmp_path)
    assert bad.returncode == 1
    assert "Traceback" not in bad.stderr and "source directory not found" in bad.stderr


def test_missing_tokenizer_warns(tmp_path, hf_dir, capsys):
    """Weights without a tokenizer convert (the Python API needs none), with a warning that
    the command line and lm-eval will want one."""
    (hf_dir / "tokenizer.json").unlink()
    capsys.readouterr()
    assert _run(hf_dir, tmp_path / "out") == 0
    assert capsys.readouterr().err == (
        f"convert: warning: {hf_dir} has no tokenizer.json: `python -m lacache_jax generate` "
        "and lm-eval need one beside the checkpoint (copy it into DST)\n")


def test_leftovers_of_a_killed_conversion_are_named(tmp_path, hf_dir, capsys):
    """A conversion killed outright (SIGKILL: no handler runs) leaves its `.DST.tmp-*`
    directory, as large as the weights written; the next conversion names it, deletes
    nothing, and converts."""
    left = tmp_path / ".out.tmp-0123abcd"
    (left / "params").mkdir(parents=True)
    (left / "params" / "w").write_bytes(b"x" * 3000)
    assert _run(hf_dir, tmp_path / "out") == 0
    err = capsys.readouterr().err
    assert ("convert: warning: 1 temporary directory of an earlier conversion to out "
            f"(2.93 KiB): {left}; delete unless a conversion is still running") in err, err
    assert left.is_dir() and lj.load(tmp_path / "out")[0] == CFG


def test_a_hugging_face_cache_snapshot_converts(tmp_path, hf_dir):
    """huggingface_hub's cache: snapshots/<rev>/ holds links into ../../blobs/. Shards are
    judged inside SRC by name, links not followed (following them refused every shard)."""
    snap = tmp_path / "hub" / "snapshots" / "abc123"
    blobs = tmp_path / "hub" / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in hf_dir.iterdir():
        f.rename(blobs / f.name)
        (snap / f.name).symlink_to(Path("..", "..", "blobs", f.name))
    assert _run(snap, tmp_path / "out") == 0
    assert lj.load(tmp_path / "out")[0] == CFG


def test_a_symlink_destination_is_written_and_measured_at_its_target(
        tmp_path, hf_dir, monkeypatch):
    """DST a link into another directory (another disk, typically): the checkpoint lands at
    the target, and the free space checked is the target's file system, not the link's."""
    import shutil as shutil_module
    (tmp_path / "big").mkdir()
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "ck").symlink_to(tmp_path / "big" / "ck")
    asked, usage = [], shutil_module.disk_usage
    monkeypatch.setattr("shutil.disk_usage", lambda p: asked.append(Path(p)) or usage(p))
    assert _run(hf_dir, tmp_path / "links" / "ck") == 0
    assert asked == [tmp_path / "big"]
    assert lj.load(tmp_path / "big" / "ck")[0] == CFG
    assert (tmp_path / "links" / "ck").is_symlink()


def test_free_space_is_checked_before_writing(tmp_path, hf_dir, capsys, monkeypatch):
    """Under 70% of the uncompressed weights free: one line, nothing written; under 100%
    (orbax's compression may still make it fit): a warning, and the conversion runs."""
    import collections
    from convert.llada import SURELY_TOO_LITTLE
    usage = collections.namedtuple("usage", "total used free")
    need = CFG.n_params * 2  # bf16
    for share, rc in ((SURELY_TOO_LITTLE - 0.05, 1), (0.95, 0)):
        free = int(share * need)
        monkeypatch.setattr("shutil.disk_usage", lambda p: usage(10**12, 10**12 - free, free))
        assert _run(hf_dir, tmp_path / "out") == rc
        err = capsys.readouterr().err
        # a tiny model's sizes in KiB, not "0.00 GiB free for 0.00 GiB"
        assert err.count("\n") == 1 and re.search(r"\d\.\d\d KiB free for \d", err), err
        if rc:
            assert err.startswith("convert: error: ")
            assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
        else:
            assert err.startswith("convert: warning: ") and "may run out of space" in err
            assert lj.load(tmp_path / "out")[0] == CFG


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE, SIGXFSZ")
def test_a_failing_write_is_one_error_line(tmp_path):
    """A write the file system refuses midway (here a 500 KiB file-size limit; a full disk
    takes the same path, errno 28): its errno in one `convert: error:` line and nothing else
    (orbax's thread logs, and tensorstore's late 'Event loop is closed' tracebacks, which 5
    of 12 runs printed before: checkpoint.drop_late_tensorstore_errors), nothing left
    beside DST."""
    # In a shell, not preexec_fn: forking this (threaded) process to set a limit can deadlock.
    # SIGXFSZ ignored: the write fails instead of the process.
    p = subprocess.run(["bash", "-c", 'trap "" XFSZ; ulimit -f 500; exec "$@"', "-",
                        sys.executable, "-m", "convert", str(ROOT / "demo_model"),
                        str(tmp_path / "dst"), "--quiet"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 1 and p.stderr == (
        f"convert: error: writing {tmp_path / 'dst'}: [Errno 27] layer_000: File too large\n"
    ), p.stderr[-800:]
    assert list(tmp_path.iterdir()) == []


# --- config.json keys we do not know: converted, with a warning naming them ----------------

# The keys of the published LLaDA-8B-Instruct config.json (values are irrelevant here).
LLADA_8B_KEYS = (
    "activation_type alibi alibi_bias_max architectures attention_dropout attention_layer_norm "
    "attention_layer_norm_with_affine auto_map bias_for_layer_norm block_group_size block_type "
    "d_model embedding_dropout embedding_size eos_token_id flash_attention include_bias "
    "include_qkv_bias init_cutoff_factor init_device init_fn init_std input_emb_norm "
    "layer_norm_type layer_norm_with_affine mask_token_id max_sequence_length mlp_hidden_size "
    "mlp_ratio model_type multi_query_attention n_heads n_kv_heads n_layers pad_token_id "
    "precision residual_dropout rms_norm_eps rope rope_full_precision rope_theta scale_logits "
    "transformers_version use_cache vocab_size weight_tying").split()


def test_unknown_config_keys_warn(tmp_path, hf_dir, capsys):
    from convert.llada import unknown_config_keys
    assert unknown_config_keys(dict.fromkeys(LLADA_8B_KEYS)) == []
    assert unknown_config_keys(CFG.to_hf()) == []
    _set_config(hf_dir, rope_scaling_factor=2.0, layer_norm_eps=1e-6)
    assert _run(hf_dir, tmp_path / "out") == 0
    assert capsys.readouterr().err == (
        f"convert: warning: {hf_dir / 'config.json'}: ignoring unknown key(s) layer_norm_eps, "
        "rope_scaling_factor\n")
    assert lj.load(tmp_path / "out")[0] == CFG


# --- Ctrl-C: nothing left beside DST, one line, exit 130 -----------------------------------

def _interrupt_when(ready, tmp_path: Path, quiet: bool = True, until_exit: bool = False,
                    sig: int = signal.SIGINT) -> tuple[int, str, str, bool]:
    """Convert the demo model to tmp_path/dst and send `sig` once `ready(pid, tmp dir or
    None)` holds (`until_exit`: again every millisecond until the process ends): (exit
    status, stdout, stderr, whether the moment was seen while running)."""
    import time
    cmd = [sys.executable, "-m", "convert", str(ROOT / "demo_model"), str(tmp_path / "dst")]
    p = subprocess.Popen(cmd + ["--quiet"] * quiet, cwd=tmp_path, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    seen = False
    while p.poll() is None:
        try:
            tmp = next((d for d in tmp_path.iterdir() if d.name.startswith(".dst.tmp-")), None)
            seen = ready(p.pid, tmp)
        except OSError:  # a directory renamed or removed while we looked
            pass
        if seen:
            p.send_signal(sig)
            if not until_exit:
                break
        time.sleep(0.001 if seen else 0.002)
    out, err = p.communicate(timeout=120)
    return p.returncode, out, err, seen


def _importing_numpy(pid, tmp):
    # numpy loads only with jax, after `main` installed its handler: the imports are running.
    return "_multiarray_umath" in Path(f"/proc/{pid}/maps").read_text()


INTERRUPT_POINTS = {
    "while importing jax": _importing_numpy,
    "before the first group": lambda pid, tmp: tmp is not None,
    "while orbax writes layer_003": lambda pid, tmp: tmp is not None and any(
        p.name.startswith("layer_003") for p in (tmp / "params").iterdir()),
}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/maps")
def test_ctrl_c_leaves_nothing_behind(tmp_path):
    """SIGINT at three moments of converting the demo model (during the imports, as the
    temporary directory appears, while orbax's threads write a layer, without --quiet: no
    bar, stderr not being a terminal): one line, exit 130, no file beside DST. Then just
    before DST is put in place, where the conversion may also complete: then it says `wrote`,
    exits 0 and leaves DST only."""
    message = "convert: interrupted; nothing was written\n"
    for i, (moment, ready) in enumerate(INTERRUPT_POINTS.items()):
        work = tmp_path / str(i)
        work.mkdir()
        rc, out, err, seen = _interrupt_when(ready, work, quiet=i != 2)
        assert seen, f"the conversion ended before the moment {moment!r}"
        assert (rc, out, list(work.iterdir())) == (130, "", []), (moment, err)
        assert err == message, (moment, err)
        assert "Traceback" not in err and err.count("interrupted") == 1

    work = tmp_path / "last"
    work.mkdir()
    rc, out, err, _ = _interrupt_when(
        lambda pid, tmp: (work / "dst").exists() or tmp is not None and (
            tmp / "lacache.json").exists(), work)
    if rc == 130:
        assert (out, err, list(work.iterdir())) == ("", message, [])
    else:
        assert rc == 0 and out.startswith(f"wrote {work / 'dst'}: 8 layers") and err == ""
        assert [p.name for p in work.iterdir()] == ["dst"]
        assert lj.load(work / "dst")[0].n_layers == 8


def test_sigterm_leaves_nothing_behind(tmp_path):
    """SIGTERM (what `timeout` and job schedulers send) while orbax writes a layer stops at
    the next safe point as Ctrl-C does: one line, exit 143, no file beside DST."""
    rc, out, err, seen = _interrupt_when(INTERRUPT_POINTS["while orbax writes layer_003"],
                                         tmp_path, sig=signal.SIGTERM)
    assert seen and (rc, out, err) == (143, "", "convert: terminated; nothing was written\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/maps")
def test_ctrl_c_after_the_conversion_changes_nothing(tmp_path):
    """SIGINT every millisecond from the moment DST is in place until the process ends (its
    return, jax's atexit clean-up, the interpreter's shutdown): the finished conversion exits
    0 and says so. Before SIGINT was ignored after the command, a Python handler reset to the
    default at shutdown let such an interrupt kill the process (exit -2)."""
    rc, out, err, seen = _interrupt_when(lambda pid, tmp: (tmp_path / "dst").exists(), tmp_path,
                                         until_exit=True)
    assert seen and rc == 0, (rc, err)
    assert out.startswith(f"wrote {tmp_path / 'dst'}: 8 layers") and err == ""
