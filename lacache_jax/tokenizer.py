"""A checkpoint's tokenizer: `tokenizer.json` through the `tokenizers` package, plus the chat
template from `tokenizer_config.json`."""

from __future__ import annotations

import json
from pathlib import Path


class TokenizerError(ValueError):
    """Tokenizer files are missing or unusable."""


class Tokenizer:
    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{path}: missing (the checkpoint has no tokenizer; copy "
                                 "tokenizer.json next to it or pass token ids)")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise TokenizerError(f"{path}: unreadable ({e})") from None
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.chat_template: str | None = config.get("chat_template")
        self.bos_token: str = _token_text(config.get("bos_token")) or ""

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def token_id(self, token: str) -> int | None:
        """The id of a whole token (e.g. a special one), or None if the vocabulary lacks it."""
        return self._tok.token_to_id(token)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def chat_prompt(self, user_message: str) -> str:
        """The prompt text for one user turn followed by the assistant header."""
        if not self.chat_template:
            raise TokenizerError("tokenizer_config.json has no chat_template: drop --chat")
        messages = [{"role": "user", "content": user_message}]
        try:
            import jinja2
        except ImportError:
            jinja2 = None
        if jinja2 is not None:
            env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
            return env.from_string(self.chat_template).render(
                messages=messages, bos_token=self.bos_token, add_generation_prompt=True)
        if "<|start_header_id|>" in self.chat_template:  # LLaDA's Llama-3 style template
            return (f"{self.bos_token}<|start_header_id|>user<|end_header_id|>\n\n"
                    f"{user_message.strip()}<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
        raise TokenizerError("rendering this chat template needs jinja2 (pip install jinja2)")


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


def _token_text(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token
