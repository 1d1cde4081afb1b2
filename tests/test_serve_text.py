"""serve.engine.TextAssembler (no server): incremental text, exact stop-string cuts, held-back stop prefixes,
multi-byte characters split across tokens."""

from __future__ import annotations

import pytest

from ling_jax.tokenizer import load_tokenizer
from serve.engine import TextAssembler
from tests.serve_helpers import make_model_dir


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(make_model_dir(str(tmp_path_factory.mktemp("tok"))))


def feed(tok, text: str, stops=(), one_by_one: bool = True):
    """Feed text's tokens; returns (deltas, tokens consumed, assembler)."""
    ids = tok.encode(text)
    asm = TextAssembler(tok, tuple(stops))
    deltas, used = [], 0
    for chunk in ([i] for i in ids) if one_by_one else [ids]:
        n, d = asm.add(chunk)
        used += n
        deltas.append(d)
        if asm.matched is not None:
            break
    deltas.append(asm.finish())
    return deltas, used, asm


def test_no_stops_round_trip(tok):
    text = "The quick brown fox jumps over the lazy dog."
    for one in (True, False):
        deltas, used, _ = feed(tok, text, one_by_one=one)
        assert "".join(deltas) == text and used == len(tok.encode(text))


@pytest.mark.parametrize("stops,cut", [(["fox"], "The quick brown "), (["k b", "fox"], "The quic"),
                                       (["dog", "z"], "The quick brown fox jumps over the la"),
                                       (["never"], None)])
def test_stop_strings_cut_exactly(tok, stops, cut):
    text = "The quick brown fox jumps over the lazy dog."
    for one in (True, False):
        deltas, used, asm = feed(tok, text, stops, one_by_one=one)
        out = "".join(deltas)
        if cut is None:
            assert out == text and asm.matched is None
            continue
        assert out == cut and asm.matched in stops
        if one:  # the token that completes the stop string is the last one consumed
            ids = tok.encode(text)
            assert min(s_pos for s in stops if (s_pos := tok.decode(ids[:used]).find(s)) >= 0) == len(cut)
            assert all(s not in tok.decode(ids[: used - 1]) for s in stops)


def test_stop_prefix_is_held_back(tok):
    asm = TextAssembler(tok, ("brown fox",))
    seen = ""
    for i in tok.encode("The quick brown fax"):
        seen += asm.add([i])[1]
        assert not seen.endswith(("b", "br", "bro", "brown", "brown ", "brown f"))
    assert seen + asm.finish() == "The quick brown fax"  # released once it cannot match


def test_multibyte_split_across_tokens(tok):
    text = "naïve café ☕ done"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # byte-level: the non-ASCII characters span several tokens
    asm = TextAssembler(tok)
    deltas = [asm.add([i])[1] for i in ids] + [asm.finish()]
    assert all("\ufffd" not in d for d in deltas) and "".join(deltas) == text


def test_without_tokenizer():
    asm = TextAssembler(None, ())
    assert asm.add([5, 6, 7]) == (3, "") and asm.finish() == ""


@pytest.mark.parametrize("model", ["test", "ling-demo"])
def test_windowed_detokenizer_equals_whole_decodes(tok, model):
    """Random id streams (byte fragments of multi-byte characters, invalid UTF-8, special and added tokens), fed in
    random chunk sizes: the byte-level detokenizer decodes only the ids since its last whole-character point, and
    at every chunk the text it returned so far is the whole-sequence decode's (less a held-back incomplete tail)."""
    import os

    import numpy as np

    from ling_jax.tokenizer import IncrementalDetokenizer

    if model == "ling-demo":
        tok = load_tokenizer(os.path.join(os.path.dirname(os.path.dirname(__file__)), "models", "ling-demo"))
    assert tok.byte_level
    rng = np.random.default_rng(0)
    vocab = tok.tok.get_vocab_size()
    text_ids = tok.encode("naïve café ☕ — 日本語 ok")
    for trial in range(30):
        ids = rng.integers(0, vocab, 120).tolist() if trial % 2 else (text_ids * 4)[:: 1 + trial % 3]
        detok, got, i = IncrementalDetokenizer(tok), "", 0
        while i < len(ids):
            n = int(rng.integers(1, 5))
            got += detok.add(ids[i : i + n])
            i += n
            whole = tok.decode(ids[:i])
            assert whole.startswith(got), (trial, i)
            assert got == whole or whole.endswith("\ufffd"), (trial, i)
        assert detok.start > 0 or not ids  # it did window
        assert detok.text == tok.decode(ids)
