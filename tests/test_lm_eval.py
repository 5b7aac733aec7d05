"""lm-eval integration (lacache_jax.lm_eval): the ELBO estimator and the greedy check against
an eager PyTorch implementation of REFERENCE.md §9 with the same mask draws, LLaDA's
stratification of the mask counts, model-arg parsing, and `lm_eval.simple_evaluate` on the
local tasks of tests/data over the shipped demo model (generation: the same answers and
accuracy as benchmarks/accuracy.py; multiple choice: the right answer scores best)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import re
import shutil
import sys
from pathlib import Path

import lm_eval  # the test extra installs it: a missing lm-eval fails here, never skips
import numpy as np
import pytest
import torch
from lm_eval.tasks import TaskManager

import lacache_jax as lj
from benchmarks import accuracy, arith
from convert.__main__ import main as convert_main
from lacache_jax.lm_eval import LaCacheLM, elbo
from lacache_jax.lm_eval.model_args import parse
from lacache_jax.tokenizer import Tokenizer
from tests.conftest import GEN_CFG, hf_logits

DATA = Path(__file__).resolve().parent / "data"
SHIPPED = Path(__file__).resolve().parent.parent / "demo_model"


# --- the estimator against eager PyTorch --------------------------------------------------

def reference_elbo(model, ctx, cont, masks_NL, mask_id, cfg_scale=0.0) -> float:
    """§9 written out in PyTorch: per sample, mask the drawn continuation positions (never the
    context), cross-entropy on the masked positions divided by the mask ratio; with CFG the
    logits are un + (s + 1)(cond - un), `un` having the context masked too; -mean."""
    seq = torch.tensor([*ctx, *cont])
    losses = []
    for m in masks_NL:
        is_mask = torch.cat([torch.zeros(len(ctx), dtype=torch.bool), torch.from_numpy(m)])
        noisy = torch.where(is_mask, mask_id, seq)
        logits = torch.from_numpy(hf_logits(model, noisy[None].numpy()))[0]
        if cfg_scale > 0:
            un = noisy.clone()
            un[:len(ctx)] = mask_id
            un_logits = torch.from_numpy(hf_logits(model, un[None].numpy()))[0]
            logits = un_logits + (cfg_scale + 1) * (logits - un_logits)
        ce = torch.nn.functional.cross_entropy(logits[is_mask], seq[is_mask], reduction="none")
        losses.append((ce / (m.sum() / len(cont))).sum().item())
    return -float(np.mean(losses))


def reference_greedy(model, ctx, length, mask_id) -> list[int]:
    """LLaDA's greedy check: continuation fully masked, each pass reveals the masked
    position whose argmax has the highest softmax probability."""
    x = torch.tensor([*ctx, *[mask_id] * length])
    for _ in range(length):
        masked = x == mask_id
        logits = torch.from_numpy(hf_logits(model, x[None].numpy()))[0][masked]
        x0 = logits.argmax(-1)
        conf = torch.softmax(logits.float(), -1).gather(-1, x0[:, None])[:, 0]
        pos = torch.nonzero(masked)[:, 0][conf.argmax()]
        x[pos] = x0[conf.argmax()]
    return x[len(ctx):].tolist()


class Recorder:
    """Injected mask draws: seeded stratified draws, each kept for the reference."""

    def __init__(self, mc_num, mc_batch):
        self.inner, self.drawn = elbo.seeded_draws(7, mc_num, mc_batch), {}

    def __call__(self, i, ctx, length):
        self.drawn[i] = self.inner(i, ctx, length)
        return self.drawn[i]


PAIRS = [  # lengths spread over two canvas buckets, continuations of 1 to 21 tokens
    ([5, 17, 99], [3, 250, 42, 7]),
    ([64, 128, 11, 9, 200, 31, 77], [1]),
    ([8] * 30, [12, 44, 13, 90, 91, 92, 93, 94, 95, 96, 97, 98, 2, 4, 6, 8, 10, 12, 14, 16,
                18]),
    ([250, 1, 2], [60, 61]),
    ([], [9, 33, 120]),  # an empty context, as the reference scores it (lm-eval's
]                        # loglikelihood requests may have one)


@pytest.mark.parametrize("cfg_scale", [0.0, 0.5])
def test_elbo_matches_pytorch_reference(models, cfg_scale):
    params, ref_model = models
    mc_num = 8
    draws = Recorder(mc_num, mc_batch=4)
    # batch_size 5 splits a pair's samples over two forward passes and pads the last one.
    got = elbo.loglikelihoods(params, GEN_CFG, PAIRS, mc_num=mc_num, draws=draws,
                              batch_size=5, mask_id=GEN_CFG.mask_id, cfg_scale=cfg_scale,
                              check_greedy=False)
    for i, (ctx, cont) in enumerate(PAIRS):
        want = reference_elbo(ref_model, ctx, cont, draws.drawn[i], GEN_CFG.mask_id, cfg_scale)
        # fp32 on both sides: logits agree to <= 1e-5 relative (the forward parity bound)
        # and the loss is a positive weighted sum of cross-entropies, so it inherits that
        # bound (measured: <= 3e-7). One masked token's term is >= 4e-3 of a total here, so a
        # wrong weight, mask, target or CFG input misses by far more than 1e-5.
        np.testing.assert_allclose(got[i][0], want, rtol=1e-5)
        assert got[i][1] is False  # not checked


def test_greedy_check_matches_pytorch_reference(models):
    params, ref_model = models
    ctxs = [[5, 17, 99, 3], [64, 128, 11, 9, 200, 31, 77, 8, 8]]
    greedy = [reference_greedy(ref_model, c, n, GEN_CFG.mask_id) for c, n in zip(ctxs, (5, 3))]
    wrong = [g[:1] + [(g[1] + 1) % 300] + g[2:] for g in greedy]  # one token off
    pairs = [(c, g) for c, g in zip(ctxs, greedy)] + [(c, w) for c, w in zip(ctxs, wrong)]
    got = elbo.loglikelihoods(params, GEN_CFG, pairs, mc_num=2, draws=Recorder(2, 2),
                              batch_size=3, mask_id=GEN_CFG.mask_id)
    # (No empty context here: its all-mask canvas gives mirror positions equal confidences,
    # an exact tie whose order is the implementation's, as for torch.topk: README.)
    assert [g for _, g in got] == [True, True, False, False]


def test_greedy_check_fails_when_the_argmax_is_the_mask_token(models):
    """LLaDA's check runs exactly one pass per continuation token; a pass whose argmax is the
    mask token leaves the position masked. Ours looped until nothing was masked, forever in
    that case (and with it the whole batch). Here the one-token continuation's argmax t is
    made the mask token's (its head column 3x t's, t's logit being the largest and > 0)."""
    params, ref_model = models
    ctx = [5, 17, 99, 3]
    t = reference_greedy(ref_model, ctx, 1, GEN_CFG.mask_id)[0]
    mask_id = GEN_CFG.mask_id
    check = functools.partial(elbo.loglikelihoods, cfg=GEN_CFG, pairs=[(ctx, [t])],
                              mc_num=2, draws=Recorder(2, 2), batch_size=2, mask_id=mask_id)
    assert check(params)[0][1] is True
    masking = dataclasses.replace(params, head=params.head.at[:, mask_id].set(
        3 * params.head[:, t]))
    assert check(masking)[0][1] is False


def _merging_tokenizer(directory: Path) -> Path:
    """A BPE over x, a, b, y and space that merges 'ab', with a post-processor adding <bos>
    (as a Llama-style tokenizer.json does)."""
    from tokenizers import Tokenizer as HFTokenizer, models, processors
    directory.mkdir()
    vocab = {t: i for i, t in enumerate(["<bos>", "<eos>", "x", "a", "b", "y", " ", "ab"])}
    tok = HFTokenizer(models.BPE(vocab, [("a", "b")]))
    tok.add_special_tokens(["<bos>", "<eos>"])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                       special_tokens=[("<bos>", 0)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>"}))
    return directory


def test_pairs_are_encoded_as_the_reference_harness_does(tmp_path, models):
    """The reference's `_encode_pair`: `tokenizer(text)` (so with the post-processor's BOS),
    trailing context spaces moved to the continuation, and the continuation the whole
    text's ids after as many as the context's, even where a token spans the boundary ('xa'
    + 'by': 'y' alone); an empty context stays empty. Before, ids had no BOS, a spanning
    token made us encode the continuation alone, and an empty context became [EOS]."""
    from transformers import PreTrainedTokenizerFast
    directory = _merging_tokenizer(tmp_path / "tok")
    hf = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))

    def reference(context, continuation):
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        whole, ctx = hf(context + continuation)["input_ids"], hf(context)["input_ids"]
        return ctx, whole[len(ctx):]

    params, _ = models
    lm = LaCacheLM(config=GEN_CFG, params=params, tokenizer=directory)
    for pair in (("xa", "by"), ("x a ", "b"), ("", "ab"), ("xab", "y"), ("yx", " ab")):
        assert lm._encode_pair(*pair) == reference(*pair), pair
    assert lm._encode_pair("", "ab") == ([0], [7])
    # 'xa' + 'b' is one token more than 'xa': the reference's continuation is empty (and its
    # ELBO then fails); ours falls back to the continuation alone.
    assert reference("xa", "b")[1] == [] and lm._encode_pair("xa", "b") == ([0, 2, 3], [4])
    assert lm._encode_context("xab", 10) == hf("xab")["input_ids"]


def test_mask_counts_are_llada_stratification():
    """Counts per group as LLaDA's eval computes them (in torch, from the same offset k);
    each sample masks exactly its count."""
    L, n, b = 13, 12, 4
    masks = elbo.stratified_masks(np.random.default_rng(3), L, n, b)
    rng = np.random.default_rng(3)
    for g in range(n // b):
        k = int(rng.integers(1, L + 1))
        x = torch.round(torch.linspace(float(k), k + (b - 1) * (L / b), steps=b)).long()
        x = ((x - 1) % L) + 1
        np.testing.assert_array_equal(masks[g * b:(g + 1) * b].sum(-1), x.numpy())
        rng.random((b, L))  # the group's position draws
    assert masks.dtype == bool and masks.shape == (n, L)


def test_bad_draws_and_pairs_are_refused(models):
    params, _ = models
    run = lambda pairs, draws: elbo.loglikelihoods(
        params, GEN_CFG, pairs, mc_num=2, draws=draws, batch_size=2, mask_id=GEN_CFG.mask_id,
        check_greedy=False)
    with pytest.raises(ValueError, match="must return bool"):
        run([([1], [2, 3])], lambda i, c, n: np.ones((3, n), bool))
    with pytest.raises(ValueError, match="no masked token"):
        run([([1], [2, 3])], lambda i, c, n: np.zeros((2, n), bool))
    with pytest.raises(ValueError, match="mask id"):
        run([([1, GEN_CFG.mask_id], [2])], Recorder(2, 2))
    with pytest.raises(ValueError, match="max_seq_len"):
        run([([1] * GEN_CFG.max_seq_len, [2])], Recorder(2, 2))
    assert run([([1], [])], Recorder(2, 2)) == [(0.0, False)]  # empty continuation: log 1
    assert run([([], [])], Recorder(2, 2)) == [(0.0, False)]  # and with an empty context


# --- model args ---------------------------------------------------------------------------

def test_model_args_are_typed_and_validated():
    s = parse({"gen_length": "128", "threshold": 0.9, "cache": None, "dpad": "uniform",
               "dpad_keep": "8", "stop_at_eos": "false", "batch_size": 4, "chat": True,
               "mc_num": 16, "steps": 64, "cfg_scale": 1})
    assert s.gen == lj.GenerationConfig(gen_length=128, steps=64, threshold=0.9, cache="none",
                                        dpad=lj.DPadConfig(strategy="uniform", keep=8),
                                        stop_at_eos=False, cfg_scale=1.0)
    # mc_batch: the reference's stratification spreads over its batch_size
    assert (s.batch_size, s.chat, s.mc_num, s.mc_batch) == (4, True, 16, 4)
    assert parse({"batch_size": 48}).mc_batch == 32  # the largest divisor of 128 below 48
    assert parse({"batch_size": 64, "mc_num": 8}).mc_batch == 8
    # The reference harness decodes the whole canvas: no early stop unless asked for; with
    # flash the predicted length of §8 is the decoder's own.
    assert parse({}).gen.stop_at_eos is False
    assert parse({"threshold": 0.9, "flash": True}).gen.stop_at_eos is True
    # The reference harness's (eval_llada.py's) names carry over.
    ref = parse({"model_path": "ck", "is_check_greedy": "False", "cfg": "0.5",
                 "use_cache": "True", "dual_cache": "True", "gen_length": 64})
    assert (ref.checkpoint, ref.check_greedy, ref.gen.cfg_scale, ref.gen.cache) == (
        "ck", False, 0.5, "dual")
    assert parse({"use_cache": True}).gen.cache == "prefix"
    # Fast-dLLM's eval commands pass show_speed (and save_dir): read, not refused.
    fast = parse({"show_speed": "True", "save_dir": "out", "max_length": "2048"})
    assert (fast.show_speed, fast.save_dir, fast.max_length) == (True, "out", 2048)
    assert parse({"use_cache": False, "dual_cache": True}).gen.cache == "none"
    assert parse({"dpad": True}).gen.dpad == lj.DPadConfig()
    assert parse({"dpad_window": 64}).gen.dpad == lj.DPadConfig(window=64)
    assert parse({"gen_length": 64}).gen.steps == 64  # default: one token per step
    flash = parse({"threshold": 0.9, "flash": True, "flash_window": 8, "flash_verify": True})
    assert flash.gen.flash == lj.FlashConfig(window=8, verify=True)
    cases = [({"gen_length": "many"}, "gen_length must be an integer"),
             ({"threshold": "high"}, "threshold must be a number"),
             ({"fp8_ffn": "yes"}, "fp8_ffn must be true or false"),
             ({"cache": "full"}, "cache must be one of"),
             ({"dpad_window": 1}, "dpad.window must be at least 2"),
             ({"dpad": False, "dpad_keep": 8}, "dpad is off"),
             ({"mc_batch": 3}, "mc_batch=3 must be a positive divisor of mc_num=128"),
             ({"batch_size": 0}, "batch_size must be a positive integer"),
             ({"flash_window": 16}, "threshold is required with flash"),
             ({"temperatur": 0.5}, "unknown model args"),
             ({"model_path": "a", "checkpoint": "b"}, "model_path and checkpoint"),
             ({"use_cache": True, "cache": "dual"}, "use_cache/dual_cache and cache"),
             ({"dtype": "int8"}, "dtype must be"),
             ({"max_length": 0}, "max_length must be a positive integer"),
             ({"dropout": "gaussian", "sigma": 4}, r"\['dropout', 'sigma'\]: DPad's harness "
                                                  "args are not read here; DPad is dpad=")]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            parse(args)


# --- lm-eval end to end over the demo model -----------------------------------------------

@pytest.fixture(scope="module")
def demo_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("lm_eval_demo") / "ckpt"
    assert convert_main([str(SHIPPED), str(out), "--quiet"]) == 0
    return out


def _evaluate(lm, task):
    results = lm_eval.simple_evaluate(model=lm, tasks=[task],
                                      task_manager=TaskManager(include_path=str(DATA)),
                                      log_samples=True, bootstrap_iters=0)
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return results["results"][task]["acc,none"], samples


def reference_answer(tokenizer_json: Path, ids: list[int], until: list[str]) -> str:
    """eval_llada.py's generate_until answer, with the `tokenizers` library: the whole canvas
    decoded with special tokens, split at each stop string in turn, encoded again, decoded
    without special tokens."""
    from tokenizers import Tokenizer as HFTokenizer
    tok = HFTokenizer.from_file(str(tokenizer_json))
    text = tok.decode(ids, skip_special_tokens=False)
    for stop in until:
        if stop in text:
            text = text.split(stop)[0]
    return tok.decode(tok.encode(text).ids, skip_special_tokens=True)


def test_generation_task_scores_as_accuracy_py(demo_ckpt):
    lm = LaCacheLM(checkpoint=str(demo_ckpt), gen_length=64, block_length=32, threshold=0.9,
                   batch_size=16)
    acc, samples = _evaluate(lm, "lacache_arith_gen")
    docs = [json.loads(line) for line in (DATA / "arith_gen.jsonl").read_text().splitlines()]
    problems = [(d["a"], d["b"]) for d in docs]
    assert [(s["doc"]["a"], s["doc"]["b"]) for s in samples] == problems
    tok = Tokenizer(demo_ckpt)
    want = accuracy.evaluate(lm.params, lm.config, tok, problems,
                             dict(threshold=0.9, stop_at_eos=False))
    assert acc == want["accuracy"]
    # The very answers: accuracy.py's canvas through the reference's decoding, against
    # lm-eval's responses.
    for row, s in zip(want["tokens"][:, -64:], samples):
        assert s["resps"][0][0] == reference_answer(demo_ckpt / "tokenizer.json",
                                                    row.tolist(), ["<|user|>"])
    assert acc >= 0.9  # the demo model solves held-out problems (RESULTS.md: 100%)
    # slots=4: slot refill instead of ragged batches, the same responses.
    lm_slots = LaCacheLM(checkpoint=str(demo_ckpt), gen_length=64, block_length=32,
                         threshold=0.9, batch_size=16, slots=4)
    _, slot_samples = _evaluate(lm_slots, "lacache_arith_gen")
    assert [s["resps"] for s in slot_samples] == [s["resps"] for s in samples]


def test_multiple_choice_task_prefers_the_right_answer(demo_ckpt):
    lm = LaCacheLM(checkpoint=str(demo_ckpt), mc_num=8, batch_size=64, check_greedy=False)
    acc, samples = _evaluate(lm, "lacache_arith_mc")
    assert len(samples) == 8
    # Chance is 1/4 and the right answer's slot rotates, so a broken scorer (ties, constant
    # or position-biased scores) lands near 0.25; 8 Monte-Carlo samples suffice for 6 of 8.
    assert acc >= 0.75


def test_command_line_runs_the_registered_model(demo_ckpt, monkeypatch, capsys):
    """`python -m lacache_jax.lm_eval`: lm-eval's CLI with the model registered (shapes as
    in the test above, so the compiled program is reused)."""
    import runpy
    monkeypatch.setattr("sys.argv", [
        "lacache_jax.lm_eval", "--model", "lacache_jax", "--model_args",
        f"checkpoint={demo_ckpt},mc_num=8,batch_size=64,check_greedy=false,cache=none",
        "--tasks", "lacache_arith_mc", "--include_path", str(DATA), "--limit", "2"])
    runpy.run_module("lacache_jax.lm_eval", run_name="__main__")
    table = capsys.readouterr().out
    assert "|lacache_arith_mc|" in table and "|acc   |" in table


def test_command_line_checks_model_args_first_and_passes_our_batch_size(
        demo_ckpt, monkeypatch, capsys, tmp_path):
    """Mistakes in the model args are one line and exit 1 before lm-eval starts; with no
    --batch_size, lm-eval gets the model's (its default 1 would override the model arg's)."""
    from lacache_jax.lm_eval.__main__ import main
    seen = []
    monkeypatch.setattr("lm_eval.__main__.cli_evaluate", lambda: seen.append(sys.argv[1:]))
    for model_args, message in [
            ("checkpoint=/nonexistent/ck", "/nonexistent/ck: checkpoint directory does not exist"),
            (f"checkpoint={demo_ckpt},gen_lenght=64", "unknown model args ['gen_lenght']"),
            (f"checkpoint={demo_ckpt},cache=exakt", "cache must be one of"),
            (f"checkpoint={demo_ckpt},gen_length=96", "gen_length=96 leaves no room for a prompt"),
            (f"checkpoint={demo_ckpt},max_length=4096", "max_length=4096 exceeds the model's"),
            ("gen_length=64", "checkpoint is required")]:
        assert main(["--model", "lacache_jax", "--tasks", "t", "--model_args", model_args]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not seen
    # chat=true with --apply_chat_template wraps twice: one line, before lm-eval starts
    assert main(["--model", "lacache_jax", "--tasks", "t", "--apply_chat_template",
                 "--model_args", f"checkpoint={demo_ckpt},chat=true"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: chat=true wraps" in err and not seen, err
    # --device cuda:0 given on a machine without it: lm-eval's default value, so only the
    # command line can tell it was asked for
    assert main(["--model", "lacache_jax", "--tasks", "t", "--device", "cuda:0",
                 "--model_args", f"checkpoint={demo_ckpt}"]) == 0
    assert "warning: --device cuda:0 is not read" in capsys.readouterr().err
    seen.clear()
    base = ["--model", "lacache_jax", "--tasks", "t", "--model_args"]
    yaml = tmp_path / "eval.yaml"  # lm-eval's --config: flags override it
    yaml.write_text(f"model: lacache_jax\ntasks: [t]\nmodel_args:\n  checkpoint: {demo_ckpt}\n")
    sized = tmp_path / "sized.yaml"
    sized.write_text(yaml.read_text() + "batch_size: 8\n")
    runs = [  # argv, what lm-eval is handed
        ([*base, f"checkpoint={demo_ckpt},gen_length=64"], ["--batch_size", "32"]),
        ([*base, f"checkpoint={demo_ckpt}", "batch_size=4"], ["--batch_size", "4"]),
        ([*base, f"checkpoint={demo_ckpt}", "-b", "2"], []),
        ([*base, f"checkpoint={demo_ckpt}", "--batch", "2"], []),  # lm-eval reads --batch
        (["--model", "lacache_jax", "--tasks", "t", "--model_arg", f"checkpoint={demo_ckpt}",
          f"tokenizer={demo_ckpt}"], ["--batch_size", "32"]),
        (["--config", str(yaml)], ["--batch_size", "32"]),
        (["--config", str(sized)], []),
        (["--model", "hf", "--tasks", "t"], []),  # other models: untouched
    ]
    for argv, added in runs:
        assert main(argv) == 0 and seen.pop() == argv + added, argv
    assert main(["--config", str(tmp_path / "nope.yaml")]) == 0  # lm-eval says what is wrong


def test_flash_answers_read_the_decoded_positions(demo_ckpt):
    """With flash, as Flash-dLLM's harness (`x[prompt : num_decoded]`), the answer is read from
    the first n generated positions, n the tokens the row decoded: a token accepted beside the
    EOS further right is not read. Without flash the whole canvas is, as LLaDA's harness."""
    from lacache_jax.lm_eval.harness import _answer_spans
    lm = LaCacheLM(checkpoint=str(demo_ckpt), gen_length=8, block_length=8)
    eos, tok = lm.config.eos_id, lm.tok
    one, two, seven = (tok.encode(c)[0] for c in "127")
    # decoded: "1", "2", EOS and (beside it, to the right) "7"; the rest is the EOS fill
    canvas = [[tok.encode("3")[0], tok.encode("3")[0], one, two, eos, eos, seven, eos, eos, eos]]
    out = lj.GenerateOutput(tokens=np.asarray(canvas), prompt_lengths=np.asarray([2]),
                            nfe=np.asarray([3]), steps=np.asarray([3]),
                            revealed=np.asarray([4]), gen_lengths=np.asarray([2]))
    flash = lj.GenerationConfig(gen_length=8, threshold=0.9, flash=lj.FlashConfig())
    assert _answer_spans(out, flash) == [[one, two, eos, eos]]
    assert lm._postprocess(_answer_spans(out, flash)[0], ()) == "12"
    fixed = lj.GenerationConfig(gen_length=8, block_length=8, steps=8)
    assert lm._postprocess(_answer_spans(out, fixed)[0], ()) == "127"


def test_save_dir_resumes_and_show_speed_reports(demo_ckpt, tmp_path, caplog):
    """Fast-dLLM's `save_dir` and `show_speed` (once refused as unknown): each answer is
    appended to SAVE_DIR/rank_0.jsonl with its batch; a rerun of the same requests and
    settings reuses them and generates nothing; a line cut by a crash is skipped and its
    request generated again; other settings reuse nothing. show_speed logs the totals."""
    Request = collections.namedtuple("Request", "args")
    requests = [Request((f"{a}+{b}=", {"until": [";"]})) for a, b in ((1, 2), (3, 4), (10, 5))]
    args = dict(checkpoint=str(demo_ckpt), gen_length=32, block_length=32, steps=32,
                batch_size=2, save_dir=str(tmp_path / "answers"))
    with caplog.at_level("WARNING"):
        first = LaCacheLM(**args, show_speed=True).generate_until(requests)
    assert re.search(r"generate_until: \d+ tokens \(each row's up to its first EOS\) in "
                     r"[\d.]+ s, [\d.]+ tokens/s, NFE \d+", caplog.text), caplog.text
    path = tmp_path / "answers" / "rank_0.jsonl"
    lines = path.read_text().splitlines()
    assert sorted(json.loads(x)["answer"] for x in lines) == sorted(first)  # batch order

    def counting(lm):
        made, run = [], lm._generate
        lm._generate = lambda prompts, ids, gen: made.append(sorted(ids)) or run(prompts, ids,
                                                                                 gen)
        return lm, made
    again, made = counting(LaCacheLM(**args))
    assert again.generate_until(requests) == first and made == []
    cut = next(i for i, x in enumerate(lines) if json.loads(x)["answer"] == first[2])
    path.write_text("".join(x + "\n" for j, x in enumerate(lines) if j != cut) + lines[cut][:9])
    resumed, made = counting(LaCacheLM(**args))
    assert resumed.generate_until(requests) == first and made == [[2]]
    again, made = counting(LaCacheLM(**args))  # the answer written after the cut line reads
    assert again.generate_until(requests) == first and made == []
    for changed in ({"steps": 16}, {"dtype": "float32"}):  # other settings: nothing reused
        other, made = counting(LaCacheLM(**{**args, **changed}))
        other.generate_until(requests)
        assert sorted(sum(made, [])) == [0, 1, 2], changed
    inside = LaCacheLM(**{**args, "save_dir": str(demo_ckpt / "answers")})  # save_dir in
    first_inside = inside.generate_until(requests)  # the checkpoint: not part of its identity
    again, made = counting(LaCacheLM(**{**args, "save_dir": str(demo_ckpt / "answers")}))
    assert again.generate_until(requests) == first_inside and made == []
    shutil.rmtree(demo_ckpt / "answers")
    meta = demo_ckpt / "lacache.json"  # a re-conversion in place: another checkpoint
    os.utime(meta, ns=(meta.stat().st_atime_ns, meta.stat().st_mtime_ns + 1))
    other, made = counting(LaCacheLM(**args))
    other.generate_until(requests)
    assert sorted(sum(made, [])) == [0, 1, 2]
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match="save_dir=.*a_file: cannot write there"):
        LaCacheLM(**{**args, "save_dir": str(tmp_path / "a_file")})
    lm = LaCacheLM(checkpoint=str(demo_ckpt))
    with pytest.raises(ValueError, match="save_dir needs a checkpoint"):
        LaCacheLM(config=lm.config, params=lm.params, tokenizer=demo_ckpt,
                  save_dir=str(tmp_path / "answers"))


def test_the_reference_harness_model_path_names_the_checkpoint(demo_ckpt):
    """`model_path=` (eval_llada.py's name) was refused as naming the checkpoint twice."""
    lm = LaCacheLM(model_path=str(demo_ckpt), gen_length=64)
    assert lm.settings.checkpoint == str(demo_ckpt)
    with pytest.raises(ValueError, match="model_path and checkpoint name the same setting"):
        LaCacheLM(str(demo_ckpt), model_path=str(demo_ckpt))


def test_a_context_is_cut_to_the_room_left(demo_ckpt):
    """max_length equal to the continuation leaves no context at all (ctx[-0:] kept it
    whole, silently exceeding max_length)."""
    lm = LaCacheLM(checkpoint=str(demo_ckpt), max_length=8)
    ctx, cont = lm._encode_pair("1+2+3=", "12345678")
    assert (ctx, len(cont)) == ([], 8)
    ctx, cont = lm._encode_pair("1+2+3=", "1234567")
    assert (ctx, len(cont)) == (lm.tok.encode("="), 7)


def test_rolling_windows_cover_the_document_once(demo_ckpt):
    seen = []

    def draws(i, ctx, length):
        seen.append((list(ctx), length))
        return elbo.stratified_masks(np.random.default_rng(i), length, 2, 2)

    lm = LaCacheLM(checkpoint=str(demo_ckpt), mc_num=2, batch_size=8, mask_draws=draws)
    text = ";".join(arith.answer_text(a, b) for a, b in [(12345, 678), (9, 99999), (4, 5)] * 2)
    ids = lm.tok.encode(text)
    assert len(ids) > 2 * lm.config.max_seq_len  # at least three windows

    class Req:
        args = (text,)
    (total,) = lm.loglikelihood_rolling([Req()])
    lengths = [n for _, n in seen]
    assert sum(lengths) == len(ids) and len(seen) >= 3
    assert seen[0][0] == [lm.config.eos_id]  # the demo tokenizer has no BOS
    assert all(len(c) + n <= lm.config.max_seq_len for c, n in seen)
    assert np.isfinite(total) and total < 0
    seen.clear()  # max_length bounds the windows too
    short = LaCacheLM(checkpoint=str(demo_ckpt), mc_num=2, batch_size=8, mask_draws=draws,
                      max_length=20)
    short.loglikelihood_rolling([Req()])
    assert sum(n for _, n in seen) == len(ids) and all(len(c) + n <= 20 for c, n in seen)


def test_generation_settings_and_answer_cleanup(demo_ckpt, caplog):
    lm = LaCacheLM(checkpoint=str(demo_ckpt), gen_length=64, block_length=32, steps=32)
    # As in the reference harness, only `until` is read: the model args decide the rest.
    with caplog.at_level("WARNING"):
        assert lm._stop_strings({"max_gen_toks": 40, "until": "#", "do_sample": True,
                                 "temperature": 0.7}) == ("#",)
    assert "['do_sample', 'max_gen_toks', 'temperature'] are ignored" in caplog.text
    assert lm._stop_strings({}) == () and lm._stop_strings({"until": ["a", "b"]}) == ("a", "b")
    # No request: nothing to run, with or without slot refill.
    assert lm.generate_until([]) == []
    assert LaCacheLM(checkpoint=str(demo_ckpt), gen_length=64, slots=4).generate_until([]) == []
    ids = lm.tok.encode("1+2+0=3c0;<|user|>#3<|assistant|>")
    assert lm._postprocess(ids, ("#",)) == "1+2+0=3c0;"          # cut, then specials gone
    assert lm._postprocess(ids, ("<|user|>",)) == "1+2+0=3c0;"   # a special as stop string
    assert lm._postprocess(ids, ()) == "1+2+0=3c0;#3"
    eos = lm.config.eos_id
    after_eos = lm.tok.encode("1+2=3") + [eos] + lm.tok.encode("4;") + [eos, eos]
    assert lm._postprocess(after_eos, ()) == "1+2=34;"  # text after an EOS stays
    for case, until in ((ids, ["#"]), (ids, ["<|user|>", "3"]), (ids, []), (after_eos, ["4"]),
                        (after_eos, [])):
        assert lm._postprocess(case, tuple(until)) == reference_answer(
            demo_ckpt / "tokenizer.json", case, until)
    # chat=true wraps generation prompts only, as Fast-dLLM's harness; lm-eval's
    # --apply_chat_template renders as transformers does (the same text as chat_prompt), and
    # with chat=true would wrap a prompt twice ('<|user|><|user|>1+2=...'): refused.
    chat = LaCacheLM(checkpoint=str(demo_ckpt), gen_length=64, block_length=32, chat=True)
    assert chat._encode_pair("1+2=", "3") == (chat.tok.encode("1+2="), chat.tok.encode("3"))
    assert chat._encode_context("1+2=", 60) == chat.tok.encode(chat.tok.chat_prompt("1+2="))
    assert lm.apply_chat_template([{"role": "user", "content": "1+2="}]) == \
        chat.tok.chat_prompt("1+2=")
    with pytest.raises(ValueError, match="chat=true .* --apply_chat_template .* give one"):
        chat.apply_chat_template([{"role": "user", "content": "1+2="}])


def test_harness_batch_size_does_not_clash_with_model_args(demo_ckpt, caplog):
    with caplog.at_level("WARNING"):
        lm = LaCacheLM.create_from_arg_string(f"checkpoint={demo_ckpt},batch_size=8,cache=none",
                                              {"batch_size": 1, "device": "cuda:0"})
        assert "not read" not in caplog.text  # lm-eval's default device: nothing asked for
        LaCacheLM.create_from_arg_string(f"checkpoint={demo_ckpt}", {"device": "cuda:3"})
    assert "--device cuda:3 is not read: lacache_jax runs on jax's default device" in caplog.text
    assert lm.settings.batch_size == 8 and lm.gen.cache == "none"
    assert LaCacheLM.create_from_arg_string(f"checkpoint={demo_ckpt}",
                                            {"batch_size": "3"}).settings.batch_size == 3
    with pytest.raises(ValueError, match="batch_size=auto"):
        LaCacheLM.create_from_arg_string(f"checkpoint={demo_ckpt}", {"batch_size": "auto"})
    with pytest.raises(ValueError, match="checkpoint is required"):
        LaCacheLM(gen_length=64)
