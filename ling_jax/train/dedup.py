"""File-level deduplication of the training corpus: exact, normalised-content, and MinHash near-duplicates.

Files are offered in priority order (the held-out split first, so a training file that copies a held-out one is
dropped: decontamination); the first of each duplicate group is kept.
  exact:       sha1 of the raw bytes.
  normalised:  sha1 of the text with comment-only lines, blank lines and all whitespace removed (re-indented,
               re-wrapped or re-commented copies).
  near:        MinHash over the set of 3-line shingles of stripped, non-blank lines; a file is a near-duplicate of a
               kept one when their estimated Jaccard similarity is >= threshold. Candidates come from LSH (bands of
               `rows` hash values); every candidate is checked on the full signature.
Hashes are crc32 / fixed-seed universal hashing, so the result does not depend on PYTHONHASHSEED.
Shape legend: L lines of a file, S shingles, H = bands * rows MinHash values.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from dataclasses import dataclass, field

import numpy as np

_PRIME = (1 << 61) - 1
_WS = re.compile(r"\s+")


def normalised(text: str) -> str:
    lines = (ln.strip() for ln in text.splitlines())
    return _WS.sub("", "\n".join(ln for ln in lines if ln and not ln.startswith("#")))


def shingles(text: str, width: int = 3) -> np.ndarray:
    """uint64[S] hashes of the `width`-line windows of the stripped non-blank lines (one shingle if shorter)."""
    h = np.asarray([zlib.crc32(ln.encode()) for ln in (l.strip() for l in text.splitlines()) if ln], np.uint64)
    if h.size == 0:
        return np.zeros((1,), np.uint64)
    if h.size < width:
        return np.asarray([int(np.bitwise_xor.reduce(h * np.arange(1, h.size + 1, dtype=np.uint64)))], np.uint64)
    out = np.zeros(h.size - width + 1, np.uint64)
    for j in range(width):  # position-dependent mix of the window's line hashes (wraps mod 2^64, deterministic)
        out = out * np.uint64(1000003) + h[j : h.size - width + 1 + j]
    return np.unique(out)


@dataclass
class MinHasher:
    bands: int = 32
    rows: int = 4
    seed: int = 0

    def __post_init__(self):
        if self.bands < 1 or self.rows < 1:
            raise ValueError(f"bands={self.bands}, rows={self.rows} must be >= 1")
        rng = np.random.default_rng(self.seed)
        n = self.bands * self.rows
        self.a = rng.integers(1, 1 << 32, n, dtype=np.uint64)
        self.b = rng.integers(0, 1 << 32, n, dtype=np.uint64)

    def signature(self, sh: np.ndarray) -> np.ndarray:
        """uint64[H]: min over shingles of (a x + b) mod p, p = 2^61 - 1, x = shingle mod 2^31 (a, b < 2^32: the
        sum stays below 2^64, no wrap-around)."""
        x = (sh & np.uint64(0x7FFFFFFF))[None, :]
        return np.min((self.a[:, None] * x + self.b[:, None]) % np.uint64(_PRIME), axis=1)

    def band_keys(self, sig: np.ndarray) -> list[bytes]:
        return [bytes([i]) + sig[i * self.rows : (i + 1) * self.rows].tobytes() for i in range(self.bands)]


@dataclass
class Deduper:
    """Offer files in priority order; `offer` returns None (kept) or (kind, k): it duplicates the k-th kept file."""

    threshold: float = 0.7
    hasher: MinHasher = field(default_factory=MinHasher)

    def __post_init__(self):
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold={self.threshold} must be in (0, 1]")
        self.exact: dict[str, int] = {}
        self.norm: dict[str, int] = {}
        self.buckets: dict[bytes, list[int]] = {}
        self.sigs: list[np.ndarray] = []

    def offer(self, raw: bytes, text: str) -> tuple[str, int] | None:
        ex = hashlib.sha1(raw).hexdigest()
        if ex in self.exact:
            return "exact", self.exact[ex]
        nm = hashlib.sha1(normalised(text).encode()).hexdigest()
        if nm in self.norm:
            return "normalised", self.norm[nm]
        sig = self.hasher.signature(shingles(text))
        keys = self.hasher.band_keys(sig)
        cands = {k for key in keys for k in self.buckets.get(key, ())}
        for k in sorted(cands):
            if float(np.mean(self.sigs[k] == sig)) >= self.threshold:
                return "near", k
        i = len(self.sigs)
        self.exact[ex], self.norm[nm] = i, i
        for key in keys:
            self.buckets.setdefault(key, []).append(len(self.sigs))
        self.sigs.append(sig)
        return None
