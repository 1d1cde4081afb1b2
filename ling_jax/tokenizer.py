"""Tokenizer loading through HF `tokenizers` (tokenizer.json + tokenizer_config.json), as a Ling checkpoint ships it.

Also incremental detokenisation: text is emitted only once its bytes form complete UTF-8, so a multi-byte
character split across tokens never shows up as U+FFFD in a stream.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ling_jax.errors import CheckpointError, read_json_object


@dataclass
class Tokenizer:
    tok: object  # tokenizers.Tokenizer
    eos_ids: tuple[int, ...]
    bos_id: int | None
    chat_template: str | None

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template (tokenizer_config.json: chat_template)")
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(messages=messages, add_generation_prompt=add_generation_prompt)


def load_tokenizer(model_dir: str) -> Tokenizer | None:
    """tokenizer.json (+ tokenizer_config.json, config.json's eos) of a checkpoint dir; None when it has no
    tokenizer.json. A file that cannot be read is a CheckpointError naming it."""
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.exists(path):
        return None
    from tokenizers import Tokenizer as HFTokenizer

    try:
        tok = HFTokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for any malformed file
        raise CheckpointError(f"{path}: corrupt tokenizer.json: expected a `tokenizers` JSON file, found {e}") from None
    conf = _read_json(os.path.join(model_dir, "tokenizer_config.json"))

    def tid(name):
        v = conf.get(name)
        if isinstance(v, dict):
            v = v.get("content")
        return tok.token_to_id(v) if isinstance(v, str) else None

    eos = [tid("eos_token")]
    e = _read_json(os.path.join(model_dir, "config.json")).get("eos_token_id")
    eos += e if isinstance(e, list) else [e]
    eos_ids = tuple(sorted({int(x) for x in eos if isinstance(x, int)}))
    return Tokenizer(tok, eos_ids, tid("bos_token"), conf.get("chat_template"))


def _read_json(path: str) -> dict:
    """A JSON object file, {} when absent."""
    return read_json_object(path) if os.path.exists(path) else {}


class IncrementalDetokenizer:
    """Feed token ids, get the new text; holds back an incomplete UTF-8 tail until it completes."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = 0  # characters already returned

    def add(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
            return ""
        new = text[self.emitted :]
        self.emitted = len(text)
        return new

    @property
    def text(self) -> str:
        return self.tokenizer.decode(self.ids)
