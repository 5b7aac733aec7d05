"""The command line: demo, and generate with a checkpoint's tokenizer and chat template;
prompt files, JSONL output, progress, help, and one-line errors for bad input."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import pytest

import lacache_jax as lj
import lacache_jax.__main__ as cli
from convert.__main__ import main as convert_main
from lacache_jax.__main__ import main
from lacache_jax.tokenizer import Tokenizer, TokenizerError, TokenizerWarning
from tests.conftest import ROOT, random_llada_state, write_hf_llada

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


class Terminal(io.StringIO):
    """A stderr that says it is a terminal: the progress bar draws on it."""

    def isatty(self):
        return True


@pytest.mark.parametrize("chat", [False, True])
def test_generate_prints_text_and_speed(checkpoint, capsys, monkeypatch, chat):
    """The answer on stdout, the speed on stderr; on a terminal (chat=False here) a tqdm bar
    on stderr advances once per finished block (2 blocks, both decoded: no stop at EOS)."""
    extra = ["--chat", "--threshold", "0.9", "--cache", "dual"] if chat else ["--no-stop-at-eos"]
    if not chat:
        monkeypatch.setattr(sys, "stderr", Terminal())
    rc = main(["generate", "--checkpoint", str(checkpoint), "--prompt", "12+30=",
               "--gen-length", "16", "--block-length", "8", "--dtype", "float32", *extra])
    assert rc == 0
    out, err = capsys.readouterr()
    if not chat:
        err = sys.stderr.getvalue()
        assert "generating:   0%|" in err and "1/2 [" in err and "2/2 [" in err, err
    # The same generation through the library: the CLI prints exactly its decoded answer.
    from lacache_jax.tokenizer import Tokenizer
    tok = Tokenizer(checkpoint)
    config, params = lj.load(checkpoint, dtype="float32")
    gen = lj.GenerationConfig(gen_length=16, block_length=8, steps=16, stop_at_eos=chat,
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
    """Each mistake is one line naming what is wrong, exit 1, before any weight is loaded."""
    def error(*argv):
        assert main(["generate", *argv]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
        return err

    ck = str(checkpoint)
    assert "--checkpoint /nonexistent/ck: directory does not exist" in error(
        "--checkpoint", "/nonexistent/ck", "--prompt", "x")
    assert "lacache.json: missing (not a checkpoint" in error(
        "--checkpoint", str(tmp_path), "--prompt", "x")
    (tmp_path / "config.json").write_text("{}")
    assert "looks like a Hugging Face model directory: convert it first" in error(
        "--checkpoint", str(tmp_path), "--prompt", "x")
    (tmp_path / "config.json").unlink()
    for f in ("lacache.json", "params"):
        (tmp_path / f).symlink_to(checkpoint / f)
    assert "tokenizer.json: missing" in error("--checkpoint", str(tmp_path), "--prompt", "x")
    assert "--block-length 4 does not divide --gen-length 10" in error(
        "--checkpoint", ck, "--prompt", "x", "--gen-length", "10", "--block-length", "4")
    assert "no prompt: pass --prompt" in error("--checkpoint", ck)
    assert "--prompt 2: the prompt is empty" in error("--checkpoint", ck, "--prompt", "1",
                                                      "--prompt", "")
    assert "--out /nonexistent/o.txt: directory /nonexistent does not exist" in error(
        "--checkpoint", ck, "--prompt", "x", "--out", "/nonexistent/o.txt")
    (tmp_path / "o_dir").mkdir()
    assert "--out " + str(tmp_path / "o_dir") + " is a directory: name a file" in error(
        "--checkpoint", ck, "--prompt", "x", "--out", str(tmp_path / "o_dir"))
    assert "--slots must be a positive integer, got 0" in error(
        "--checkpoint", ck, "--prompt", "x", "--slots", "0")
    assert "--dpad-k, --dpad-keep without --dpad" in error(
        "--checkpoint", ck, "--prompt", "x", "--dpad-k", "2", "--dpad-keep", "8")
    assert "--dpad-scale must be a positive number, got -1.0" in error(
        "--checkpoint", ck, "--prompt", "x", "--dpad", "gaussian", "--dpad-scale", "-1")
    assert "--eot-id 9999 is outside the model's vocabulary" in error(
        "--checkpoint", ck, "--prompt", "x", "--eot-id", "9999", "--confidence-eos-eot-inf")
    assert "--eot-id without --confidence-eos-eot-inf" in error(
        "--checkpoint", ck, "--prompt", "x", "--eot-id", "5")
    assert (f"--prompt 2: holds the mask token (id {CFG.mask_id}), a position for the model "
            "to fill") in error("--checkpoint", ck, "--prompt", "1", "--prompt", "12<|mdm_mask|>=")
    assert "--threshold 0.9 and --factor 1.0 are alternatives" in error(
        "--checkpoint", ck, "--prompt", "x", "--threshold", "0.9", "--factor", "1")
    n = CFG.max_seq_len - 32 + 1  # one token too many: named before loading, with the prompt
    assert (f"--prompt 2: {n} prompt tokens + --gen-length 32 exceed the model's "
            f"max_sequence_length {CFG.max_seq_len}") in error(
        "--checkpoint", ck, "--prompt", "x", "--prompt", "1" * n, "--gen-length", "32")


def test_a_backend_that_fails_to_start_is_one_line(checkpoint, capsys, monkeypatch):
    """JAX_PLATFORMS naming a platform that is not installed: jax raises a bare
    AssertionError; the command names the setting and the install, exit 1."""
    def no_backend(*a, **k):
        raise AssertionError
    monkeypatch.setattr(jax, "devices", no_backend)
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert main(["generate", "--checkpoint", str(checkpoint), "--prompt", "1+2="]) == 1
    assert capsys.readouterr().err == (
        "error: jax could not start a backend (JAX_PLATFORMS=cuda): AssertionError. For NVIDIA "
        "GPUs install jax's CUDA plugin: pip install -e '.[cuda]'\n")


def test_generate_flash_flags(checkpoint, capsys):
    """--flash and its options build the library's FlashConfig ('all' lifts a budget; omitted
    options keep its defaults), and the CLI prints what lj.generate gives with it. Flash
    options without --flash, and block or step settings with it, are refused by name, exit 1;
    a budget that is not a count, exit 2."""
    def config(*flags):
        args = cli.build_parser().parse_args(["generate", "--checkpoint", "ck", "--prompt", "x",
                                              "--gen-length", "16", *flags])
        return cli.generation_config(args, None)
    base = dict(gen_length=16, threshold=0.5)
    flags = ["--threshold", "0.5", "--flash", "--flash-window", "4", "--flash-lookahead", "all",
             "--flash-track", "2", "--flash-verify", "--flash-gamma", "0.7", "--flash-accept",
             "agree"]
    want = lj.GenerationConfig(**base, flash=lj.FlashConfig(
        window=4, lookahead=None, track=2, verify=True, gamma=0.7, accept="agree"))
    assert config(*flags) == want
    assert config("--threshold", "0.5", "--flash") == lj.GenerationConfig(
        **base, flash=lj.FlashConfig())
    assert config("--threshold", "0.5", "--flash", "--flash-track", "all",
                  "--flash-lookahead", "5") == lj.GenerationConfig(
        **base, flash=lj.FlashConfig(track=None, lookahead=5))
    # 0 is a budget (no look-ahead, no tracked positions), not an omitted option
    assert config("--threshold", "0.5", "--flash", "--flash-track", "0",
                  "--flash-lookahead", "0") == lj.GenerationConfig(
        **base, flash=lj.FlashConfig(track=0, lookahead=0))
    # DPad's options the same way: every DPadConfig field has its --dpad-NAME flag.
    assert config("--block-length", "8", "--dpad", "gaussian", "--dpad-window", "8",
                  "--dpad-k", "2", "--dpad-scale", "1.5").dpad == lj.DPadConfig(
        window=8, k=2.0, scale=1.5)
    assert config("--block-length", "8", "--dpad", "uniform",
                  "--dpad-keep", "3").dpad == lj.DPadConfig(strategy="uniform", keep=3)

    rc = main(["generate", "--checkpoint", str(checkpoint), "--prompt", "12+30=",
               "--gen-length", "16", "--dtype", "float32", "--quiet", *flags])
    assert rc == 0
    out = capsys.readouterr().out
    tok = Tokenizer(checkpoint)
    params = lj.load(checkpoint, dtype="float32")[1]
    ref = lj.generate(params, CFG, [tok.encode("12+30=")], want, key=jax.random.key(0))
    assert out == tok.decode(ref.answers(16)[0]) + "\n"

    def error(*argv):
        assert main(["generate", "--checkpoint", str(checkpoint), "--prompt", "x",
                     "--gen-length", "16", *argv]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
        return err
    assert "--flash-window, --flash-gamma without --flash" in error(
        "--threshold", "0.5", "--flash-window", "16", "--flash-gamma", "0.8")
    assert "--flash-verify without --flash" in error("--flash-verify")
    assert "--flash-track without --flash" in error("--flash-track", "0")
    assert "--flash-window must be a positive integer, got 0" in error(
        "--threshold", "0.5", "--flash", "--flash-window", "0")
    assert "--flash-gamma, --flash-accept without --flash-verify" in error(
        "--threshold", "0.5", "--flash", "--flash-gamma", "0.7", "--flash-accept", "agree")
    assert "--block-length does not apply with --flash" in error(
        "--threshold", "0.5", "--flash", "--block-length", "32")
    assert "--steps does not apply with --flash" in error(
        "--threshold", "0.5", "--flash", "--steps", "16")
    assert "--threshold is required with flash" in error("--flash")
    with pytest.raises(SystemExit) as done:
        main(["generate", "--checkpoint", str(checkpoint), "--prompt", "x", "--flash",
              "--flash-track", "some"])
    assert done.value.code == 2 and "a count or 'all', got 'some'" in capsys.readouterr().err


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_stops_at_the_next_safe_point(checkpoint, capsys, monkeypatch, tmp_path, presses):
    """Ctrl-C during compilation: one press is recorded and honoured once compilation
    returns (jax is never interrupted mid-way), a second stops at once; either way one
    'interrupted' line, exit 130, no output file, and the previous SIGINT handler back."""
    import signal
    real, ran = lj.compile_generate, []

    def compile_with_ctrl_c(*a, **kw):
        for _ in range(presses):
            signal.raise_signal(signal.SIGINT)
        ran.append(True)
        return real(*a, **kw)
    monkeypatch.setattr(lj, "compile_generate", compile_with_ctrl_c)
    before = signal.getsignal(signal.SIGINT)
    out = tmp_path / "answers.txt"
    rc = main(["generate", "--checkpoint", str(checkpoint), "--prompt", "12+30=",
               "--gen-length", "16", "--block-length", "8", "--quiet", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 130 and captured.out == "" and not out.exists()
    assert captured.err.endswith("interrupted\n") and captured.err.count("interrupted") == 1
    assert "stopping at the next safe point" in captured.err
    assert ran == ([True] if presses == 1 else [])  # the second press stops before compiling
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="tensorstore's threads")
def test_a_damaged_checkpoint_is_one_line(checkpoint, tmp_path):
    """Data files of one weight group cut in half: the error names the group, in one line.
    Before, an absl warning came first and up to 133 lines of tensorstore's late callbacks
    into a closed event loop ('RuntimeError: Event loop is closed') followed."""
    import shutil
    damaged = tmp_path / "ck"
    shutil.copytree(checkpoint, damaged)
    for f in (damaged / "params" / "layer_001").rglob("d/*"):
        os.truncate(f, f.stat().st_size // 2)
    done = subprocess.run(
        [sys.executable, "-m", "lacache_jax", "generate", "--checkpoint", str(damaged),
         "--prompt", "12+30=", "--gen-length", "16", "--block-length", "8", "--quiet"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300)
    assert done.returncode == 1 and done.stdout == "", done
    assert done.stderr.startswith(f"error: {damaged.absolute() / 'params' / 'layer_001'}: "
                                  "unreadable (") and done.stderr.count("\n") == 1, done.stderr


def test_a_press_during_the_imports_is_honoured(checkpoint, capsys, monkeypatch):
    """`python -m lacache_jax` records a Ctrl-C pressed while the package imports jax
    (lacache_jax/__init__; Python's own handler lost it inside a gc callback, and the run
    went on to exit 0): the command stops at its first safe point, before loading."""
    import signal
    import lacache_jax
    monkeypatch.setattr(lacache_jax, "_import_interrupted", True)
    monkeypatch.setattr(lj, "load", lambda *a, **k: pytest.fail("loaded"))
    before = signal.getsignal(signal.SIGINT)
    try:
        rc = main(["generate", "--checkpoint", str(checkpoint), "--prompt", "12+30=",
                   "--quiet"], keep_handler=True)
    finally:
        signal.signal(signal.SIGINT, before)
    assert rc == 130 and capsys.readouterr().err == "interrupted\n"


def test_the_second_press_ends_the_process(monkeypatch, capfd):
    """The entry point's handler (`exit_at_once`) ends the process on a second press rather
    than raise inside jax (a crash at exit, or an exception a gc callback swallows); `main`
    called in-process raises as before."""
    def fake_exit(code):
        raise SystemExit(code)  # os._exit does not return
    monkeypatch.setattr(os, "_exit", fake_exit)
    interrupt = cli.Interrupt(exit_at_once=True)
    interrupt(2, None)
    assert interrupt.pending
    with pytest.raises(SystemExit) as done:
        interrupt(2, None)
    assert done.value.code == 130 and capfd.readouterr().err.endswith("\ninterrupted\n")
    in_process = cli.Interrupt()
    in_process(2, None)
    with pytest.raises(KeyboardInterrupt):
        in_process(2, None)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX signals")
def test_two_presses_end_the_process_cleanly(checkpoint, tmp_path):
    """Ctrl-C twice, early (here both may land while jax imports, or the second in
    compilation: the timing is the machine's): exit 130, no output file, no traceback, never
    the crash (-11) a second press raising inside jax caused."""
    import signal
    import time
    out = tmp_path / "answers.txt"
    p = subprocess.Popen(
        [sys.executable, "-m", "lacache_jax", "generate", "--checkpoint", str(checkpoint),
         "--prompt", "12+30=", "--gen-length", "64", "--block-length", "8", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    time.sleep(1.5)  # well past the interpreter's start-up (a press before it is Python's)
    p.send_signal(signal.SIGINT)
    time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and not out.exists(), (p.returncode, err)
    assert err.rstrip().endswith("interrupted") and "Traceback" not in err, err


def test_a_press_inside_a_write_to_stderr_is_still_recorded(monkeypatch, capfd):
    """Python runs a signal handler between bytecodes, possibly inside another write to
    stderr (the progress bar's), where printing raises "reentrant call" from the handler:
    the press must still be recorded, its line go to the descriptor, and no error escape."""
    class Busy(io.StringIO):
        def write(self, text):
            raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stderr>'>")
    monkeypatch.setattr(sys, "stderr", Busy())
    interrupt = cli.Interrupt()
    interrupt(2, None)
    assert interrupt.pending
    assert "stopping at the next safe point" in capfd.readouterr().err
    with pytest.raises(KeyboardInterrupt):
        interrupt.check()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX signals")
def test_ctrl_c_after_the_answers_changes_nothing(checkpoint, tmp_path):
    """SIGINT every millisecond from the moment the output file is in place until the process
    ends (jax's atexit clean-up, the interpreter's shutdown): exit 0, no traceback. Before,
    a late interrupt killed the process (exit -2)."""
    import signal
    import time
    out = tmp_path / "answers.txt"
    p = subprocess.Popen(
        [sys.executable, "-m", "lacache_jax", "generate", "--checkpoint", str(checkpoint),
         "--prompt", "12+30=", "--gen-length", "16", "--block-length", "8", "--quiet",
         "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    seen = False
    while p.poll() is None:
        seen = seen or out.exists()
        if seen:
            p.send_signal(signal.SIGINT)
        time.sleep(0.001)
    _, err = p.communicate(timeout=60)
    assert seen and p.returncode == 0 and "Traceback" not in err, (p.returncode, err)
    assert out.read_text().endswith("\n")


def test_unencodable_text_is_refused(checkpoint, capsys):
    """The char tokenizer maps unknown characters to <|endoftext|>, the model's EOS: 'é' would
    silently end the prompt, so it is refused, naming the character and its place in the
    user's text (not in the chat-templated one)."""
    for chat in ([], ["--chat"]):
        assert main(["generate", "--checkpoint", str(checkpoint), "--prompt", "12+30=",
                     "--prompt", "1é+2=", *chat]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: --prompt 2: cannot encode 'é' at position 1 of "
                              "'1é+2=': not in the vocabulary"), err
        assert "EOS, mask or padding" in err


def _word_tokenizer(directory: Path, unk: str, specials: list[str],
                    config: dict | None = None) -> Path:
    from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, models, pre_tokenizers
    directory.mkdir()
    vocab = {t: i for i, t in enumerate([*specials, "a", "b"])}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config or {}))
    return directory


def test_tokenizer_unknown_token_policy(tmp_path):
    """A real unknown token (not EOS, mask or padding) warns once and keeps the text; one that
    doubles as EOS (named by tokenizer_config.json or by the caller's ids) is refused; a BPE
    without any unknown token drops characters silently, which is refused too."""
    real = Tokenizer(_word_tokenizer(tmp_path / "real", "<unk>", ["<eos>", "<unk>"],
                                     {"eos_token": "<eos>"}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert real.encode("axb") == [2, 1, 3] and real.encode("ay") == [2, 1]
    assert [str(w.message) for w in caught] == [
        "cannot encode 'x' at position 1 of 'axb': encoded as the unknown token '<unk>' "
        "(warned once)"]
    assert caught[0].category is TokenizerWarning
    assert real.encode("a<unk>b") == [2, 1, 3]  # the unknown token written out is text

    eos = _word_tokenizer(tmp_path / "eos", "<eos>", ["<eos>"], {"eos_token": "<eos>"})
    with pytest.raises(TokenizerError, match="cannot encode 'x' at position 2 of 'abx'"):
        Tokenizer(eos).encode("abx")
    by_id = _word_tokenizer(tmp_path / "by_id", "<unk>", ["<pad>", "<unk>"])
    assert Tokenizer(by_id).encode("ab") == [2, 3]
    with pytest.raises(TokenizerError, match="one the model uses for EOS, mask or padding"):
        Tokenizer(by_id, reserved_ids={1}).encode("ax")

    from tokenizers import Regex, Tokenizer as HFTokenizer, models, pre_tokenizers
    (tmp_path / "bpe").mkdir()
    bpe = HFTokenizer(models.BPE({"a": 0, "b": 1, " ": 2}, []))
    bpe.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    bpe.save(str(tmp_path / "bpe" / "tokenizer.json"))
    tok = Tokenizer(tmp_path / "bpe")
    assert tok.encode("a b") == [0, 2, 1]
    with pytest.raises(TokenizerError, match="cannot encode 'z' at position 1 of 'azb': the "
                                             "tokenizer has no token for it"):
        tok.encode("azb")


def test_chat_template_renders_as_transformers_does(tmp_path):
    """Hugging Face renders chat templates with trim_blocks/lstrip_blocks, loop controls and
    its own tojson; a template whose output depends on each (indented tags, newlines after
    block tags, break, non-ASCII through tojson) renders the same here as in transformers."""
    from transformers import PreTrainedTokenizerFast
    template = ("{% for m in messages %}\n"
                "    {% if m['role'] == 'system' %}{% continue %}{% endif %}\n"
                "<|{{ m['role'] }}|>{{ m['content'] | trim }}{{ eos_token }}\n"
                "{{ {'n': loop.index, 'c': m['content']} | tojson }}\n"
                "{% endfor %}\n"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    d = _word_tokenizer(tmp_path / "t", "<eos>", ["<eos>"],
                        {"eos_token": "<eos>", "chat_template": template})
    ours = Tokenizer(d).chat_prompt("  héllo ")
    hf = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), eos_token="<eos>")
    theirs = hf.apply_chat_template([{"role": "user", "content": "  héllo "}],
                                    chat_template=template, tokenize=False,
                                    add_generation_prompt=True)
    assert ours == theirs


def test_prompts_file_jsonl_output_and_out_file(tmp_path, checkpoint, capsys, monkeypatch):
    """--prompt and --prompts-file (text; JSONL) form one ragged batch in input order; each
    JSONL row holds the row's answer and counters as the library reports them. --quiet: no
    progress callback compiled in and nothing on stderr. --out is written whole."""
    progress_args = []
    real_run_batch = cli.run_batch
    monkeypatch.setattr(cli, "run_batch", lambda *a: progress_args.append(a[5])
                        or real_run_batch(*a))
    (tmp_path / "p.txt").write_text("7+5=\n\n1+1=\r\n")
    base = ["generate", "--checkpoint", str(checkpoint), "--gen-length", "16",
            "--block-length", "8", "--dtype", "float32", "--quiet"]
    assert main([*base, "--prompt", "12+30=", "--prompts-file", str(tmp_path / "p.txt"),
                 "--output", "jsonl"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and progress_args == [None]
    rows = [json.loads(line) for line in out.splitlines()]

    prompts = ["12+30=", "7+5=", "1+1="]
    tok = Tokenizer(checkpoint)
    config, params = lj.load(checkpoint, dtype="float32")
    gen = lj.GenerationConfig(gen_length=16, block_length=8, steps=16)
    ref = lj.generate(params, config, [tok.encode(p) for p in prompts], gen,
                      key=jax.random.key(0))
    assert rows == [{"prompt": p, "text": tok.decode(a), "gen_length": int(ref.gen_lengths[i]),
                     "nfe": int(ref.nfe[i]), "steps": int(ref.steps[i]),
                     "tokens_per_step": float(ref.tokens_per_step[i])}
                    for i, (p, a) in enumerate(zip(prompts, ref.answers(16)))]

    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n"
                                              for i, p in enumerate(prompts)))
    (tmp_path / "o.txt").write_text("old")
    (tmp_path / "o.txt").chmod(0o644)
    assert main([*base, "--prompts-file", str(tmp_path / "p.jsonl"),
                 "--out", str(tmp_path / "o.txt")]) == 0
    assert capsys.readouterr() == ("", "")
    text = "".join(f"--- {i}: {r['prompt']}\n{r['text']}\n" for i, r in enumerate(rows))
    assert (tmp_path / "o.txt").read_text() == text
    assert (tmp_path / "o.txt").stat().st_mode & 0o777 == 0o644  # the old file's mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.txt", "p.jsonl", "p.txt"]
    # A write that fails after generating (a full disk) loses nothing: stdout gets the text.
    def no_room(path, text):
        raise OSError(28, "No space left on device")
    with monkeypatch.context() as m:
        m.setattr(cli, "write_atomically", no_room)
        assert main([*base, "--prompts-file", str(tmp_path / "p.jsonl"),
                     "--out", str(tmp_path / "o.txt")]) == 1
    assert capsys.readouterr() == (text, f"error: --out {tmp_path / 'o.txt'}: No space left "
                                         "on device; the answers went to stdout instead\n")
    # --slots 2: slot refill, two rows in flight, the same rows in the same order.
    assert main([*base, "--prompt", "12+30=", "--prompts-file", str(tmp_path / "p.txt"),
                 "--output", "jsonl", "--slots", "2"]) == 0
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == rows


@pytest.mark.parametrize("content, message", [
    (None, "--prompts-file {f}: no such file"),
    ("\n \n", "--prompts-file {f}: holds no prompt"),
    ('{"prompt": "1+1="}\n{"prompt": 3}\n', '{f}:2: expected a JSON object with a string '
                                             '"prompt" field'),
    ('{"prompt": "1+1="}\n\n{"prompt": \n', "{f}:3: not valid JSON"),
])
def test_prompts_file_errors(tmp_path, checkpoint, capsys, content, message):
    f = tmp_path / "p.jsonl"
    if content is not None:
        f.write_text(content)
    assert main(["generate", "--checkpoint", str(checkpoint), "--prompts-file", str(f)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message.format(f=f)}") and err.count("\n") == 1, err


def test_help_states_every_default(capsys):
    """--help: a one-line description, and every option's default (or that it is required)."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        fmt = p._get_formatter()
        for action in p._actions:
            if action.dest == "help":
                continue
            text = fmt._get_help_string(action) or ""
            assert "default:" in text or (action.required and "(required)" in text), (
                name, action.option_strings, text)
    with pytest.raises(SystemExit) as done:
        main(["generate", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "Generate answers to prompts" in out and "(default: 128)" in out


def test_engine_never_imports_the_converter():
    """The engine stands without `convert` (the demo below checks the imports at run time)."""
    import re
    for path in [*(ROOT / "lacache_jax").glob("*.py"), *(ROOT / "kernels").glob("*.py")]:
        found = re.findall(r"^\s*(?:from|import)\s+convert\b.*$", path.read_text(), re.M)
        assert not found, f"{path.name}: {found}"


def test_ctrl_c_stops_the_demo_and_removes_its_files(tmp_path, capsys, monkeypatch):
    """The demo said 'stopping at the next safe point' and then ran to the end (exit 0): it
    had no safe point. It now stops between its stages, its temporary directory removed."""
    import signal
    import tempfile
    from lacache_jax import hf_export
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    real = hf_export.export_hf

    def export_then_press(*a, **k):
        real(*a, **k)
        signal.raise_signal(signal.SIGINT)
    monkeypatch.setattr(hf_export, "export_hf", export_then_press)
    assert main(["demo"]) == 130
    captured = capsys.readouterr()
    assert captured.err.endswith("interrupted\n") and "2. $ python -m convert" not in captured.out
    assert list(tmp_path.iterdir()) == []


def test_demo_runs_and_cleans_up(tmp_path):
    """Without --workdir the demo's files go to a temporary directory removed at the end. Its
    process (export, load, forward) never imports the converter: it runs `python -m convert`."""
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path / "tmp")}
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "lacache_jax", "demo"],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:")]
    assert "lacache_jax.hf_export" in imported
    assert not [m for m in imported if m == "convert" or m.startswith("convert.")]
    assert "weights bit-identical: True" in done.stdout and "logits [2, 32, 320]" in done.stdout
    assert str(tmp_path / "tmp" / "lacache_demo_") in done.stdout
    assert list((tmp_path / "tmp").iterdir()) == []
