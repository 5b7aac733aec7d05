"""The lm-eval model `lacache_jax`: an `lm_eval.api.model.LM` over a converted checkpoint.

    generate_until         every request with the model args' settings, as the reference
                           harness (LLaDA's / Fast-dLLM's eval_llada.py) does: gen_kwargs
                           other than `until` (max_gen_toks, do_sample, temperature) are
                           ignored, with one log line; ragged batches of `batch_size`
                           prompts, longest first (or slot refill with `slots`); each row's
                           whole generated canvas decoded with its special tokens, cut at the
                           `until` strings, then the special tokens removed, so text after an
                           EOS stays, as in the reference (with `flash`, the first n positions,
                           n the tokens decoded, as Flash-dLLM's harness reads them).
    loglikelihood          the Monte-Carlo ELBO of REFERENCE.md §9 (elbo.py), is_greedy by
                           LLaDA's greedy check.
    loglikelihood_rolling  the same ELBO over each document, chunked by lm-eval's rolling
                           windows at the model's length (window + its one context token).

`chat=true` wraps generate_until's contexts (only) as one user turn of the chat template, as
Fast-dLLM's harness does for Instruct models; log-likelihood contexts stay plain text.
Model args: model_args.py. Contexts too long for the model lose their oldest tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval import utils as lm_utils
from tqdm.auto import tqdm

import lacache_jax as lj
from lacache_jax.lm_eval import elbo
from lacache_jax.lm_eval.model_args import EvalSettings, parse
from lacache_jax.quant import has_fp8_ffn
from lacache_jax.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# The one gen_kwargs key read (as by the reference harness); others are logged once.
_GEN_KWARGS = ("until",)


@register_model("lacache_jax")
class LaCacheLM(LM):
    """`LaCacheLM(checkpoint=DIR, gen_length=256, threshold=0.9, cache="dual", ...)`: every
    model arg of model_args.py as a keyword. `config` and `params` give a model already in
    memory instead of `checkpoint`, with `tokenizer` the directory of its tokenizer files
    (default: the checkpoint's); `mask_draws` (elbo.MaskDraws) replaces the seeded
    stratified draws of the ELBO."""

    def __init__(self, checkpoint: str | None = None, *, config: lj.ModelConfig | None = None,
                 params: lj.Params | None = None, tokenizer: str | Path | None = None,
                 mask_draws: elbo.MaskDraws | None = None, **model_args: Any):
        super().__init__()
        # `checkpoint` only when given: the reference's `model_path` names it too
        settings = parse({**({} if checkpoint is None else {"checkpoint": checkpoint}),
                          **model_args})
        if (config is None) != (params is None):
            raise ValueError("config and params come together (or neither, with checkpoint)")
        if config is None:
            if settings.checkpoint is None:
                raise ValueError("checkpoint is required: the directory written by "
                                 "`python -m convert`")
            dtype = None if settings.dtype is None else jnp.dtype(settings.dtype)
            config, params = lj.load(settings.checkpoint, dtype=dtype)
        elif settings.dtype is not None:
            raise ValueError("dtype applies when loading a checkpoint; convert params "
                             "yourself when you pass them")
        tokenizer = settings.checkpoint if tokenizer is None else tokenizer
        if tokenizer is None:
            raise ValueError("tokenizer (a directory with tokenizer.json) is required with "
                             "config/params and no checkpoint")
        if settings.gen.fp8_ffn and not has_fp8_ffn(params):
            log.info("quantising the FFN weights to FP8 at load (fp8_ffn=true)")
            params = lj.quantize_ffn(params)
        _check_max_length(settings, config)
        self.settings: EvalSettings = settings
        self.config, self.params, self.tok = config, params, Tokenizer(tokenizer)
        self.gen = settings.gen.resolve(config)
        # The ELBO's forward passes use FP8 FFN weights only if generation does.
        self._score_params = params if self.gen.fp8_ffn else dataclasses.replace(
            params, layers=[dataclasses.replace(layer, ffn8=None) for layer in params.layers])
        self.mask_draws = mask_draws or elbo.seeded_draws(settings.seed, settings.mc_num,
                                                          settings.mc_batch)
        self._specials = _special_tokens(Path(tokenizer) / "tokenizer.json")
        self._tokenizer = tokenizer
        if settings.save_dir is not None:
            if settings.checkpoint is None:
                raise ValueError("save_dir needs a checkpoint: answers are reused only for "
                                 "the model they came from, and params passed in have no "
                                 "identity to check")
            AnswerLog.check(settings.save_dir)
        self._warned: set[str] = set()

    # --- construction from lm-eval's --model_args ---------------------------------------

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string),
                                       additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        """`--model_args` win over the harness's own settings (`--batch_size` is always
        passed, 1 by default), so `batch_size=` in model args is never a duplicate."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        if str(extra.get("batch_size", "")).startswith("auto"):
            raise ValueError("batch_size=auto is not supported: give a number of rows")
        if not runs_on(extra.get("device", LM_EVAL_DEVICE)):
            log.warning("--device %s is not read: lacache_jax runs on jax's default device "
                        "(%s; pick it with JAX_PLATFORMS or CUDA_VISIBLE_DEVICES)",
                        extra["device"], jax.devices()[0])
        return cls(**{**extra, **arg_dict})

    # --- lm-eval interface --------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.config.eos_id

    @property
    def max_length(self) -> int:
        return self.settings.max_length or self.config.max_seq_len

    @property
    def tokenizer_name(self) -> str:
        return str(self.settings.checkpoint or "lacache_jax").replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tok.chat_template

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """The whole conversation through the checkpoint's chat template, rendered as
        `transformers` renders it (Tokenizer.render_chat). lm-eval calls it under
        `--apply_chat_template`, which `chat=true` would wrap a second time: refused."""
        if self.settings.chat:
            raise ValueError(CHAT_TWICE)
        return self.tok.render_chat(chat_history, add_generation_prompt)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        gen = self.gen
        saved = AnswerLog(self.settings.save_dir, self.rank, self._run_id())
        out: list[str | None] = [None] * len(requests)
        items = []
        for i, req in enumerate(requests):
            context, kwargs = req.args
            until = self._stop_strings(kwargs or {})
            if (answer := saved.get(i, context, until)) is not None:
                out[i] = answer
                self.cache_hook.add_partial("generate_until", req.args, answer)
                continue
            prompt = self._encode_context(context, self.max_length - gen.gen_length)
            items.append((i, prompt, until))
        if saved.reused:
            log.warning("%d of %d answers reused from %s", saved.reused, len(requests),
                        saved.path)
        items.sort(key=lambda it: -len(it[1]))  # similar lengths share a batch
        refill = self.settings.slots is not None  # slot refill: all requests in one call
        B = max(len(items), 1) if refill else self.settings.batch_size
        run = self._generate_slots if refill else self._generate
        bar = tqdm(total=-(-len(items) // B), desc="generate_until",
                   disable=disable_tqdm or self.rank)
        start, tokens, nfe = time.perf_counter(), 0, 0
        for lo in range(0, len(items), B):
            chunk = items[lo:lo + B]
            canvases, n_tokens, n_fe = run([p for _, p, _ in chunk], [i for i, *_ in chunk], gen)
            tokens, nfe = tokens + n_tokens, nfe + n_fe
            for (i, _, until), ids in zip(chunk, canvases):
                out[i] = self._postprocess(ids, until)
                self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
            saved.add([(i, requests[i].args[0], until, out[i]) for i, _, until in chunk])
            bar.update()
        bar.close()
        if self.settings.show_speed and items:
            seconds = time.perf_counter() - start
            log.warning("generate_until: %d tokens (each row's up to its first EOS) in %.1f s, "
                        "%.1f tokens/s, NFE %d (%.1f a request)", tokens, seconds,
                        tokens / seconds, nfe, nfe / len(items))
        return out

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self._encode_pair(*req.args) for req in requests]
        results = self._score(pairs, self.settings.check_greedy, not disable_tqdm)
        for req, res in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        prefix = self._prefix_id()
        windows, owner = [], []
        for r, req in enumerate(requests):
            tokens = self.tok.encode(req.args[0], add_special_tokens=False)  # prefix: below
            for win in lm_utils.get_rolling_token_windows(
                    token_list=tokens, prefix_token=prefix,
                    max_seq_len=self.max_length - 1, context_len=1):
                windows.append(lm_utils.make_disjoint_window(win))
                owner.append(r)
        totals = np.zeros(len(requests))
        for r, (ll, _) in zip(owner, self._score(windows, False, not disable_tqdm)):
            totals[r] += ll
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, float(total))
        return [float(t) for t in totals]

    # --- helpers ------------------------------------------------------------------------

    def _score(self, pairs, check_greedy: bool, progress: bool) -> list[tuple[float, bool]]:
        return elbo.loglikelihoods(
            self._score_params, self.config, pairs, mc_num=self.settings.mc_num,
            draws=self.mask_draws, batch_size=self.settings.batch_size,
            mask_id=self.gen.mask_id, cfg_scale=self.gen.cfg_scale, check_greedy=check_greedy,
            progress=progress and self.rank == 0)

    def _stop_strings(self, kwargs: dict) -> tuple[str, ...]:
        """A request's `until` strings; its other gen_kwargs are logged once and ignored."""
        unknown = sorted(set(kwargs) - set(_GEN_KWARGS))
        if unknown and repr(unknown) not in self._warned:
            self._warned.add(repr(unknown))
            log.warning("gen_kwargs %s are ignored: every request decodes with the model "
                        "args' settings (gen_length, temperature, ...), as the reference "
                        "harness does", unknown)
        until = kwargs.get("until", ())
        return (until,) if isinstance(until, str) else tuple(until or ())

    def _generate(self, prompts: list[list[int]], request_ids: list[int],
                  gen: lj.GenerationConfig) -> list[list[int]]:
        """Generated canvases (all gen_length tokens) of one ragged batch, padded to
        `batch_size` rows with copies of the last prompt so every full or partial batch has
        the same row count. Row keys come from the request index: a row's draws do not
        depend on its batch."""
        B, n = self.settings.batch_size, len(prompts)
        rows = prompts + [prompts[-1]] * (B - n)
        ids = request_ids + [request_ids[-1]] * (B - n)
        keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(self.settings.seed), i))(
            jnp.asarray(ids))
        # Each batch compiles for its own longest prompt; `slots=` compiles per power-of-two
        # bucket instead (slots.py).
        out = lj.generate(self.params, self.config, rows, gen, key=keys)
        return _answer_spans(out, gen)[:n], *_speed(out, n)

    def _generate_slots(self, prompts: list[list[int]], request_ids: list[int],
                        gen: lj.GenerationConfig) -> list[list[int]]:
        """Canvases of every prompt through slot refill (`slots` rows in flight), keys from
        the request index as in `_generate`: the same tokens, another schedule."""
        keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(self.settings.seed), i))(
            jnp.asarray(request_ids))
        out = lj.generate(self.params, self.config, prompts, gen, key=keys,
                          slots=self.settings.slots)
        return _answer_spans(out, gen), *_speed(out, len(prompts))

    def _run_id(self) -> str:
        """What decides a generate_until answer besides its request (and its position, which
        seeds its key: AnswerLog): the checkpoint (its path, metadata and files' sizes and
        times, so a re-conversion in place counts as another), the tokenizer, and the
        settings that change tokens (not batch_size or slots: rows draw from their own
        keys)."""
        s = self.settings
        return repr((checkpoint_fingerprint(s.checkpoint), str(Path(self._tokenizer).resolve()),
                     s.dtype, self.gen, s.seed, s.chat, self.max_length))

    def _postprocess(self, ids: list[int], until: tuple) -> str:
        """The reference's answer: the canvas decoded with its special tokens (so a special
        token can be a stop string), cut at each `until` string in turn, then the special
        tokens removed (text after an EOS stays)."""
        text = self.tok.decode(ids)
        for stop in until:
            if stop:
                text = text.split(stop, 1)[0]
        for special in self._specials:
            text = text.replace(special, "")
        return text

    def _prefix_id(self) -> int:
        """What an empty context conditions on: BOS when the tokenizer has one, else EOS."""
        bos = self.tok.token_id(self.tok.bos_token) if self.tok.bos_token else None
        return self.config.eos_id if bos is None else bos

    def _encode_context(self, context: str, budget: int) -> list[int]:
        if budget < 1:
            raise ValueError(f"no room for a prompt: the generation fills max_length="
                             f"{self.max_length}")
        ids = self.tok.encode(self.tok.chat_prompt(context) if self.settings.chat else context)
        ids = ids or [self._prefix_id()]
        if len(ids) > budget:
            self._warn_once("truncated", "contexts longer than the model allows lose their "
                            "oldest tokens")
        return ids[-budget:]

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """The reference's `_encode_pair` (lm-eval's convention): trailing spaces of the
        context move to the continuation, both texts are encoded as `tokenizer(text)` does,
        and the continuation's ids are the whole text's after as many as the context has
        (even where a token spans the boundary). An empty context stays empty, as there.
        Where that leaves no continuation token (the reference then fails on an empty
        target), the continuation is encoded alone."""
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        ctx = self.tok.encode(context)
        cont = self.tok.encode(context + continuation)[len(ctx):]
        cont = cont or self.tok.encode(continuation, add_special_tokens=False)
        room = self.max_length - len(cont)
        if room < 0:
            raise ValueError(f"a continuation of {len(cont)} tokens does not fit "
                             f"max_length={self.max_length}")
        if len(ctx) > room:
            self._warn_once("truncated", "contexts longer than the model allows lose their "
                            "oldest tokens")
        return ctx[len(ctx) - room:] if room < len(ctx) else ctx, cont

    def _warn_once(self, tag: str, message: str) -> None:
        if tag not in self._warned:
            self._warned.add(tag)
            log.warning(message)


def _special_tokens(path: Path) -> list[str]:
    """Texts of the tokenizer's special tokens (tokenizer.json `added_tokens`), stripped
    from generated text; longest first so no special hides inside another."""
    added = json.loads(path.read_text()).get("added_tokens", [])
    return sorted({t["content"] for t in added if t.get("special")}, key=len, reverse=True)


def _speed(out: lj.GenerateOutput, n: int) -> tuple[int, int]:
    """Generated tokens up to each row's first EOS (REFERENCE.md §10) and forward passes,
    summed over the first n rows (the rest pad the batch)."""
    return int(np.asarray(out.gen_lengths)[:n].sum()), int(np.asarray(out.nfe)[:n].sum())


class AnswerLog:
    """`save_dir`'s answers: one JSON line per generate_until answer, appended (and synced)
    after each batch, so a run that dies keeps what it made; a rerun reuses the answers
    whose key (the run's id, the request's position, context and stop strings) matches.
    An unreadable line (the last one, cut by a crash) is skipped. Without `save_dir`, a
    no-op."""

    def __init__(self, save_dir: str | None, rank: int, run_id: str):
        self.path = None if save_dir is None else Path(save_dir) / f"rank_{rank}.jsonl"
        self.run_id, self.reused, self.answers = run_id, 0, {}
        if self.path is None:
            return
        self.check(save_dir)
        if self.path.is_file():
            text = self.path.read_text(encoding="utf-8")
            if text and not text.endswith("\n"):  # cut by a crash: the next line starts anew
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write("\n")
            for line in text.splitlines():
                try:
                    entry = json.loads(line)
                    self.answers[entry["key"]] = entry["answer"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    log.warning("%s: skipping an unreadable line", self.path)

    @staticmethod
    def check(save_dir: str) -> None:
        """Create `save_dir` if needed and make sure files can be written there (before the
        model loads, not after the first batch); ValueError if not."""
        try:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=save_dir):
                pass
        except OSError as e:
            raise ValueError(f"save_dir={save_dir}: cannot write there ({e.strerror or e})") \
                from None

    def _key(self, i: int, context: str, until: tuple) -> str:
        raw = json.dumps([self.run_id, i, context, list(until)], ensure_ascii=False)
        return hashlib.sha256(raw.encode()).hexdigest()

    def get(self, i: int, context: str, until: tuple) -> str | None:
        answer = self.answers.get(self._key(i, context, until))
        self.reused += answer is not None
        return answer

    def add(self, done: list[tuple[int, str, tuple, str]]) -> None:
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            for i, context, until, answer in done:
                f.write(json.dumps({"key": self._key(i, context, until), "answer": answer},
                                   ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())


def checkpoint_fingerprint(checkpoint: str | None) -> tuple:
    """A checkpoint's identity for reusing answers: its absolute path, and the size and
    modification time of each file it is made of (a conversion in place changes them): the
    files at its top (metadata, tokenizer) and under params/, not other directories there (a
    save_dir inside it, which grows with every run)."""
    if checkpoint is None:
        return (None,)
    root = Path(checkpoint).resolve()
    files = sorted(f for f in [*root.iterdir(), *(root / "params").rglob("*")] if f.is_file())
    return (str(root), *((str(f.relative_to(root)), f.stat().st_size, f.stat().st_mtime_ns)
                         for f in files))


def _answer_spans(out: lj.GenerateOutput, gen: lj.GenerationConfig) -> list[list[int]]:
    """Each row's generated tokens that `_postprocess` reads: the whole canvas, as LLaDA's
    and Fast-dLLM's harnesses decode it; with `flash`, its first n positions, n the tokens
    the row decoded, as Flash-dLLM's harness slices them (`x[prompt : num_decoded]`), so a
    token accepted beside an EOS past the row's first n positions is not read."""
    canvas = np.asarray(out.tokens)[:, -gen.gen_length:]
    if gen.flash is None:
        return canvas.tolist()
    return [row[:n].tolist() for row, n in zip(canvas, np.asarray(out.revealed))]


LM_EVAL_DEVICE = "cuda:0"  # what lm-eval passes when --device is not given
CHAT_TWICE = ("chat=true wraps each context in the chat template, which "
              "--apply_chat_template has done already: give one of them")


def runs_on(device: str) -> bool:
    """Whether lm-eval's `device` names what jax runs on (lm-eval's own default counts as
    asked for nothing: the model cannot tell it from a `--device` naming it; the command
    line can, `__main__`)."""
    return device == LM_EVAL_DEVICE or names_jax_device(device)


def names_jax_device(device: str) -> bool:
    actual = jax.devices()[0]
    kind, _, index = str(device).partition(":")
    if kind == "cpu":
        return actual.platform == "cpu"
    return kind in ("cuda", "gpu") and actual.platform == "gpu" and (index or "0") == str(
        actual.id)


def preflight(model_args: dict[str, Any]) -> EvalSettings:
    """What constructing the model checks before its weights load (the model args, the
    checkpoint's metadata and tokenizer, the ids against its vocabulary) and, where
    `gen_length` is given, that it leaves room for a prompt in the model's length (otherwise
    refused at the first generate_until request; log-likelihood tasks do not generate).
    Raises ValueError naming the problem (the command line's one-line errors); returns the
    parsed settings."""
    from lacache_jax.checkpoint import read_meta
    model_args = dict(model_args)
    tokenizer = model_args.pop("tokenizer", None)  # a keyword of LaCacheLM, not a model arg
    settings = parse(model_args)
    if settings.checkpoint is None:
        raise ValueError("checkpoint is required: the directory written by `python -m convert`")
    config, _, _ = read_meta(settings.checkpoint)
    Tokenizer(tokenizer or settings.checkpoint)
    gen = settings.gen.resolve(config)
    _check_max_length(settings, config)
    if settings.save_dir is not None:
        AnswerLog.check(settings.save_dir)
    limit = settings.max_length or config.max_seq_len
    if "gen_length" in model_args and gen.gen_length >= limit:
        raise ValueError(f"gen_length={gen.gen_length} leaves no room for a prompt in "
                         f"{limit} tokens (max_length, else the model's max_sequence_length)")
    return settings


def _check_max_length(settings: EvalSettings, config: lj.ModelConfig) -> None:
    if settings.max_length is not None and settings.max_length > config.max_seq_len:
        raise ValueError(f"max_length={settings.max_length} exceeds the model's "
                         f"max_sequence_length {config.max_seq_len}")
