"""The command line: demo, and generate with a checkpoint's tokenizer and chat template."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import lacache_jax as lj
from convert.__main__ import main as convert_main
from lacache_jax.__main__ import main
from tests.conftest import random_llada_state, write_hf_llada

ROOT = Path(__file__).resolve().parents[1]
CFG = lj.tiny(d_model=128, d_ff=256)  # FP8 FFN needs multiples of 128
SPECIALS = {"<|startoftext|>": 312, "<|start_header_id|>": 313, "<|end_header_id|>": 314,
            "<|eot_id|>": 315, "<|endoftext|>": CFG.eos_id, "<|mdm_mask|>": CFG.mask_id}
CHAT_TEMPLATE = (
    "{% for m in messages %}{% set c = '<|start_header_id|>' + m['role'] + '<|end_header_id|>"
    "\\n\\n' + m['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set c = "
    "bos_token + c %}{% endif %}{{ c }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")


def write_char_tokenizer(directory: Path) -> None:
    from lacache_jax.tokenizer import save_char_tokenizer
    vocab = {ch: i for i, ch in enumerate([chr(c) for c in range(32, 127)] + ["\n"])}
    save_char_tokenizer(directory / "tokenizer.json", {**vocab, **SPECIALS},
                        ["<|endoftext|>", *(s for s in SPECIALS if s != "<|endoftext|>")])
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|startoftext|>", "chat_template": CHAT_TEMPLATE}))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    src = write_hf_llada(tmp / "hf", CFG, random_llada_state(CFG, head_std=2.0))
    write_char_tokenizer(src)
    assert convert_main([str(src), str(tmp / "ck"), "--quiet"]) == 0
    return tmp / "ck"


def test_chat_template_rendering(checkpoint):
    from lacache_jax.tokenizer import Tokenizer
    tok = Tokenizer(checkpoint)
    text = tok.chat_prompt("  What is 2+2? ")
    assert text == ("<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?"
                    "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = tok.encode(text)
    assert ids[:2] == [312, 313] and tok.decode(ids) == text


@pytest.mark.parametrize("chat", [False, True])
def test_generate_prints_text_and_speed(checkpoint, capsys, chat):
    extra = ["--chat", "--threshold", "0.9", "--cache", "dual"] if chat else []
    rc = main(["generate", "--checkpoint", str(checkpoint), "--prompt", "12+30=",
               "--gen-length", "16", "--block-length", "8", "--dtype", "float32", *extra])
    assert rc == 0
    out, err = capsys.readouterr()
    # The same generation through the library: the CLI prints exactly its decoded answer.
    from lacache_jax.tokenizer import Tokenizer
    tok = Tokenizer(checkpoint)
    config, params = lj.load(checkpoint, dtype="float32")
    gen = lj.GenerationConfig(gen_length=16, block_length=8, steps=16,
                              threshold=0.9 if chat else None, cache="dual" if chat else "none")
    prompt = tok.encode(tok.chat_prompt("12+30=") if chat else "12+30=")
    ref = lj.generate(params, config, [prompt], gen, key=jax.random.key(0))
    assert out == tok.decode(ref.answers(16)[0]) + "\n"
    assert f"[{int(ref.gen_lengths[0])} tokens in" in err and f"NFE {int(ref.nfe[0])}" in err
    assert "tokens/s" in err and "tokens per step" in err


def test_generate_batch_fp8_and_eos_flags(checkpoint, capsys):
    """Repeated --prompt is one ragged batch; --fp8-ffn quantises at load; the end-of-turn id
    of --confidence-eos-eot-inf comes from the tokenizer (<|eot_id|> = 315 here)."""
    from lacache_jax.tokenizer import Tokenizer
    prompts = ["12+30=", "7+5="]
    rc = main(["generate", "--checkpoint", str(checkpoint), "--prompt", prompts[0], "--prompt",
               prompts[1], "--gen-length", "16", "--block-length", "8", "--dtype", "float32",
               "--fp8-ffn", "--logits-eos-inf", "--confidence-eos-eot-inf"])
    assert rc == 0
    out, err = capsys.readouterr()
    tok = Tokenizer(checkpoint)
    config, params = lj.load(checkpoint, dtype="float32")
    gen = lj.GenerationConfig(gen_length=16, block_length=8, steps=16, fp8_ffn=True,
                              logits_eos_inf=True, confidence_eos_eot_inf=True, eot_id=315)
    ref = lj.generate(lj.quantize_ffn(params), config, [tok.encode(p) for p in prompts], gen,
                      key=jax.random.key(0))
    assert out == "".join(f"--- {i}: {p}\n{tok.decode(a)}\n"
                          for i, (p, a) in enumerate(zip(prompts, ref.answers(16))))
    assert "quantising the FFN weights to FP8 at load" in err and "[2 prompts, 32 tokens" in err


def test_generate_errors(tmp_path, checkpoint, capsys):
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "x"]) == 1
    assert "tokenizer.json: missing" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(checkpoint), "--prompt", "x",
                 "--gen-length", "10", "--block-length", "4"]) == 1
    assert "block_length=4 does not divide gen_length=10" in capsys.readouterr().err
    (tmp_path / "tokenizer.json").write_text((checkpoint / "tokenizer.json").read_text())
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "x"]) == 1
    assert "lacache.json: missing" in capsys.readouterr().err


def test_demo_runs():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "lacache_jax", "demo"], capture_output=True,
                          text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert "weights bit-identical: True" in done.stdout and "logits [2, 32, 320]" in done.stdout
