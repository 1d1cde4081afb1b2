"""Train the demo model's byte-level BPE tokenizer (HF `tokenizers`) on the corpus's train split.

Writes `tokenizer.json` and `tokenizer_config.json` (eos_token, pad_token, chat_template) into a model dir, the
files a real Ling checkpoint ships, so `ling_jax.tokenizer.load_tokenizer` reads both the same way.
Special tokens take the first ids: <|endoftext|> = 0 (eos, the file separator in training), <|pad|> = 1,
then the chat roles <|system|>, <|user|>, <|assistant|> = 2, 3, 4. Byte-level: any text round-trips exactly.

    python -m ling_jax.train.bpe --corpus .data/stdlib --out models/ling-demo --vocab-size 4096
    python -m ling_jax.train.bpe --corpus .data/code-v2 --out models/ling-demo-v2 --vocab-size 4096 --sample-mb 24

--sample-mb N trains on a deterministic sample of the train split (files in sha1(path) order until N MB), so a big
corpus trains in minutes on a small CPU; the merges then apply to the whole corpus like any BPE.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

EOS, PAD = "<|endoftext|>", "<|pad|>"
ROLES = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (EOS, PAD) + ROLES

# Each message: role token, newline, content, <|endoftext|>; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|endoftext|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def train_tokenizer(texts, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def save(tok, out_dir: str, max_length: int = 8192) -> None:
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    conf = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": list(ROLES),
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(conf, f, indent=1)


def sample(paths: list[str], texts: list[str], max_bytes: int | None) -> list[str]:
    """All texts when max_bytes is None, else those first in sha1(path) order while they fit in max_bytes."""
    if max_bytes is None:
        return list(texts)
    out, used = [], 0
    for i in sorted(range(len(paths)), key=lambda i: hashlib.sha1(paths[i].encode()).hexdigest()):
        n = len(texts[i].encode())
        if used + n <= max_bytes:
            out.append(texts[i])
            used += n
    return out


def main(argv=None):
    from ling_jax.train import corpus

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", default=".data/stdlib")
    p.add_argument("--out", default="models/ling-demo")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--sample-mb", type=float, default=None, help="train on a sample of the train split of N MB")
    a = p.parse_args(argv)
    c = corpus.load(a.corpus)
    texts = sample(c.paths("train"), c.split("train"), int(a.sample_mb * 1e6) if a.sample_mb else None)
    tok = train_tokenizer(texts, a.vocab_size)
    save(tok, a.out)
    print(f"vocab {tok.get_vocab_size()} -> {a.out}/tokenizer.json")


if __name__ == "__main__":
    main()
