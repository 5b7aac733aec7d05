"""A checkpoint's tokenizer: `tokenizer.json` through the `tokenizers` package, the chat template
of `tokenizer_config.json` (or `chat_template.jinja`) rendered with Jinja as Hugging Face
renders it, and a refusal of text the vocabulary cannot encode."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Iterable


class TokenizerError(ValueError):
    """Tokenizer files are missing or unusable, or text cannot be encoded."""


class TokenizerWarning(UserWarning):
    """Text had characters that became the tokenizer's own unknown token."""


class Tokenizer:
    """`reserved_ids`: ids with a role in generation (the model's EOS, mask, padding). Text the
    vocabulary lacks is refused when it would become one of them (or vanish); it only warns,
    once, when the tokenizer has an unknown token of its own."""

    def __init__(self, directory: str | Path, reserved_ids: Iterable[int] = ()):
        from tokenizers import Tokenizer as HFTokenizer

        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{path}: missing (the checkpoint has no tokenizer; copy the "
                                 "model's tokenizer.json into it)")
        try:
            self._tok = HFTokenizer.from_file(str(path))
            model = json.loads(path.read_text()).get("model", {})
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise TokenizerError(f"{path}: unreadable ({e})") from None
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.chat_template = _chat_template(config.get("chat_template"), directory)
        self.special_tokens = {k: text for k in ("bos_token", "eos_token", "unk_token",
                                                 "pad_token", "mask_token")
                               if (text := _token_text(config.get(k))) is not None}
        self.bos_token: str = self.special_tokens.get("bos_token", "")
        self._unk_text, self._unk_id = _unknown_token(model, self._tok)
        roles = {self._tok.token_to_id(t) for k, t in self.special_tokens.items()
                 if k != "unk_token"}
        self._reserved = (set(reserved_ids) | roles) - {None}
        self._warned = False

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, as `transformers`' `tokenizer(text)` gives them (what LLaDA's
        generate.py and eval harness call): with the special tokens tokenizer.json's
        post-processor adds, if it has one (the shipped tokenizers have none), unless
        `add_special_tokens` is off. A character the vocabulary lacks
        raises TokenizerError naming it and its position, unless the tokenizer has an unknown
        token distinct from every reserved id (then: one TokenizerWarning per tokenizer)."""
        enc = self._tok.encode(text, add_special_tokens=add_special_tokens)
        covered = [False] * len(text)
        for token_id, (a, b) in zip(enc.ids, enc.offsets):
            if token_id == self._unk_id and text[a:b] != self._unk_text:
                self._unknown(text, a, became_unk=True)
            covered[a:b] = [True] * (b - a)
        # Characters no token covers were dropped (a BPE without an unknown token does that).
        # Whitespace is left out: pre-tokenizers may drop it by design.
        for i, ch in enumerate(text):
            if not covered[i] and not ch.isspace():
                self._unknown(text, i, became_unk=False)
                break
        return enc.ids

    def _unknown(self, text: str, pos: int, became_unk: bool) -> None:
        where = f"cannot encode {text[pos]!r} at position {pos} of {_excerpt(text)}"
        if not became_unk:
            raise TokenizerError(f"{where}: the tokenizer has no token for it")
        if self._unk_id in self._reserved:
            raise TokenizerError(f"{where}: not in the vocabulary, and the tokenizer's unknown "
                                 f"token {self._unk_text!r} (id {self._unk_id}) is one the model "
                                 "uses for EOS, mask or padding")
        if not self._warned:
            self._warned = True
            warnings.warn(f"{where}: encoded as the unknown token {self._unk_text!r} (warned "
                          "once)", TokenizerWarning, stacklevel=3)

    def token_id(self, token: str) -> int | None:
        """The id of a whole token (e.g. a special one), or None if the vocabulary lacks it."""
        return self._tok.token_to_id(token)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def chat_prompt(self, user_message: str) -> str:
        """The prompt text for one user turn followed by the assistant header."""
        return self.render_chat([{"role": "user", "content": user_message}])

    def render_chat(self, messages: list[dict[str, str]],
                    add_generation_prompt: bool = True) -> str:
        """A conversation rendered the way `transformers`' `apply_chat_template(messages,
        tokenize=False, add_generation_prompt=...)` renders it."""
        if not self.chat_template:
            raise TokenizerError("the tokenizer has no chat template (tokenizer_config.json "
                                 "chat_template or chat_template.jinja): drop --chat")
        import jinja2
        try:
            template = _jinja_env().from_string(self.chat_template)
            return template.render(messages=messages,
                                   add_generation_prompt=add_generation_prompt,
                                   **self.special_tokens)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template: {type(e).__name__}: {e}") from None


def save_char_tokenizer(path: str | Path, vocab: dict[str, int], specials: list[str]) -> None:
    """Write a character-level `tokenizer.json`: every character of the text is one token of
    `vocab` (unknown ones map to the first special), `specials` are matched whole."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer(models.WordLevel(vocab, unk_token=specials[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")  # (?m): dotall
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    tok.save(str(path))


def _jinja_env():
    """Hugging Face's rendering settings: sandboxed, trim/lstrip blocks, loop controls,
    `raise_exception` and a `tojson` that keeps non-ASCII text (Jinja's own escapes HTML)."""
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


def _chat_template(value, directory: Path) -> str | None:
    if isinstance(value, list):  # named templates: [{"name": "default", "template": ...}, ...]
        value = {t.get("name"): t.get("template") for t in value}.get("default")
    if value is None and (directory / "chat_template.jinja").is_file():
        value = (directory / "chat_template.jinja").read_text()
    return value if isinstance(value, str) else None


def _unknown_token(model: dict, tok) -> tuple[str | None, int | None]:
    """(text, id) of the model's unknown token, or (None, None). Unigram names it by id; a BPE
    with byte fallback never produces it."""
    if model.get("type") == "Unigram":
        unk_id = model.get("unk_id")
        return (None, None) if unk_id is None else (tok.id_to_token(unk_id), unk_id)
    if model.get("byte_fallback") or model.get("unk_token") is None:
        return None, None
    return model["unk_token"], tok.token_to_id(model["unk_token"])


def _excerpt(text: str, n: int = 40) -> str:
    return repr(text) if len(text) <= n else repr(text[:n]) + "..."


def _token_text(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token
