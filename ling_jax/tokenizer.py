"""Tokenizer loading through HF `tokenizers` (tokenizer.json + tokenizer_config.json), as a Ling checkpoint ships it.

Also incremental detokenisation: text is emitted only once its bytes form complete UTF-8, so a multi-byte
character split across tokens never shows up as U+FFFD in a stream. With a byte-level decoder (Ling's: each token
is its bytes, the text is the UTF-8 of all of them) only the ids since the last point where the text was whole
complete characters are decoded, not the whole output again: decoding every id per chunk cost ~90 us per row per
step at a few hundred tokens, the largest host cost of a batched step (bench/batching_host.py --profile).
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
    # the decoder is `tokenizers`' ByteLevel alone: decode(a + b) == decode(a) + decode(b) whenever decode(a) ends
    # in a complete character (the bytes of a's tokens then end at a UTF-8 boundary; added / special tokens are
    # whole tokens too), which IncrementalDetokenizer relies on
    byte_level: bool = False

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
    from tokenizers import decoders

    return Tokenizer(tok, eos_ids, tid("bos_token"), conf.get("chat_template"),
                     byte_level=isinstance(tok.decoder, decoders.ByteLevel))


def _read_json(path: str) -> dict:
    """A JSON object file, {} when absent."""
    return read_json_object(path) if os.path.exists(path) else {}


class IncrementalDetokenizer:
    """Feed token ids, get the new text; holds back an incomplete UTF-8 tail until it completes."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        # byte-level decoder: ids[:start] decoded to whole characters, all returned; ids[start:] are decoded
        # together (else start stays 0: every id is decoded each time)
        self.start = 0
        self.emitted = 0  # characters of decode(ids[start:]) already returned

    def add(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids[self.start :])
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
            return ""
        new = text[self.emitted :]
        if self.tokenizer.byte_level:  # whole characters: later ids decode on their own
            self.start, self.emitted = len(self.ids), 0
        else:
            self.emitted = len(text)
        return new

    @property
    def text(self) -> str:
        return self.tokenizer.decode(self.ids)
