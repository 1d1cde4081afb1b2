"""A reduced vocabulary for the MTP draft's lm_head (FR-Spec / EAGLE-3's "hot tokens"): the draft scores only the
N most frequent tokens of the target's own outputs; the target still verifies over the full vocabulary, so the
output is unchanged (a draft outside the hot set is just never proposed).

Shape legend: V full vocabulary, N draft vocabulary (hot tokens), D hidden, B batch.

    ids      int32[N]   the hot tokens, ascending (draft id i <-> target id ids[i])
    logits   = full(-inf, [B, V]).at[:, ids].set(h @ lm_head[ids]^T)          (the draft's distribution lives
                                                                               on the hot set; greedy picks
                                                                               ids[argmax h @ lm_head[ids]^T])
The scatter back to V keeps every transform of the full vocabulary (penalties, logit_bias, top-k / min-p, and
the q the sampled verdict needs) unchanged; it costs a V-wide write next to the N x D read it saves.

File format (EAGLE-3's, as its draft checkpoints ship it, in safetensors beside the target checkpoint):
    d2t  I64 [N]:  d2t[i] = ids[i] - i            (target id = draft id + d2t[draft id])
    t2d  BOOL [V]: t2d[t] = t is in the draft vocabulary
    metadata: {"source": what the counts were taken from, "tokens_counted": int}
SGLang's --speculative-token-map (FR-Spec) is the list `ids` itself; `hot_tokens` builds it from token counts.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np

from ling_jax.errors import CheckpointError
from ling_jax.model import RuntimeOptions, lm_argmax, lm_logits
from ling_jax.quant import dense
from ling_jax.safetensors_io import SafetensorsFile, save_file

FILE = "draft_vocab.safetensors"


def hot_tokens(counts: np.ndarray, n: int) -> np.ndarray:
    """counts int[V] (how often the target emitted each token) -> the n most frequent token ids, ascending
    (ties: the lower id first, so the set is a function of the counts alone)."""
    counts = np.asarray(counts)
    if counts.ndim != 1 or not 1 <= n <= counts.size:
        raise ValueError(f"need 1 <= n <= V for counts of shape {counts.shape}, got n={n}")
    order = np.lexsort((np.arange(counts.size), -counts.astype(np.int64)))  # by count desc, then id asc
    return np.sort(order[:n]).astype(np.int32)


def to_eagle3(ids: np.ndarray, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """ids int[N] ascending -> (d2t int64[N], t2d bool[V])."""
    ids = _check_ids(np.asarray(ids, np.int64), vocab_size, "ids")
    t2d = np.zeros(vocab_size, bool)
    t2d[ids] = True
    return ids - np.arange(ids.size, dtype=np.int64), t2d


def from_eagle3(d2t: np.ndarray, t2d: np.ndarray, where: str = "draft vocab") -> np.ndarray:
    """(d2t, t2d) -> ids int32[N]; the two tensors must describe the same set."""
    ids = np.asarray(d2t, np.int64) + np.arange(len(d2t), dtype=np.int64)
    _check_ids(ids, len(t2d), f"{where}: d2t")
    if t2d.dtype != bool or t2d.sum() != ids.size or not t2d[ids].all():
        raise CheckpointError(f"{where}: t2d marks {int(np.sum(t2d))} tokens but d2t maps {ids.size} "
                              "(they must describe the same draft vocabulary)")
    return ids.astype(np.int32)


def _check_ids(ids, vocab_size, where):
    if ids.ndim != 1 or ids.size == 0 or np.any(np.diff(ids) <= 0) or ids[0] < 0 or ids[-1] >= vocab_size:
        raise CheckpointError(f"{where}: expected ascending distinct token ids in [0, {vocab_size}), "
                              f"got {ids.size} ids in [{ids.min(initial=0)}, {ids.max(initial=0)}]")
    return ids


def save(path: str, ids: np.ndarray, vocab_size: int, source: str, tokens_counted: int) -> None:
    d2t, t2d = to_eagle3(ids, vocab_size)
    save_file({"d2t": d2t, "t2d": t2d}, path, {"source": source, "tokens_counted": str(tokens_counted)})


def load(path: str, vocab_size: int) -> np.ndarray:
    """The hot token ids of a draft vocabulary file (a directory: its draft_vocab.safetensors)."""
    if os.path.isdir(path):
        path = os.path.join(path, FILE)
    sf = SafetensorsFile(path)
    missing = {"d2t", "t2d"} - set(sf.header)
    if missing:
        raise CheckpointError(f"{path}: draft vocabulary needs tensors d2t and t2d; missing {sorted(missing)}")
    t2d = np.asarray(sf.tensor("t2d"))
    if t2d.shape != (vocab_size,):
        raise CheckpointError(f"{path}: t2d has {t2d.shape}, the model's vocabulary is {vocab_size}")
    return from_eagle3(np.asarray(sf.tensor("d2t")), t2d, path)


def metadata(path: str) -> dict:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n)).get("__metadata__", {})


# ---- in the model ----------------------------------------------------------------------------------------------


def with_draft_vocab(params: dict, ids) -> dict:
    """params plus params["draft_vocab"] = {"ids": int32[N], "lm_head": [N, D]} (the hot rows of the lm_head, or
    of the embedding when tied; an fp8 lm_head is dequantised first). ids=None: params without one."""
    params = {k: v for k, v in params.items() if k != "draft_vocab"}
    if ids is None:
        return params
    ids = jnp.asarray(ids, jnp.int32)
    head = params["lm_head"] if "lm_head" in params else params["embed"]
    rows = jnp.take(dense(head, params["embed"].dtype), ids, axis=0)
    return {**params, "draft_vocab": {"ids": ids, "lm_head": rows}}


def draft_logits(params, hidden, opts: RuntimeOptions = RuntimeOptions()):
    """The draft's logits [..., V] float32: over the hot set when params carries a draft_vocab (-inf elsewhere),
    else the model's own lm_logits over the full vocabulary."""
    dv = params.get("draft_vocab")
    if dv is None:
        return lm_logits(params, hidden, opts)
    hot = lm_logits({"lm_head": dv["lm_head"], "embed": params["embed"]}, hidden, opts)  # [..., N]
    full = jnp.full(hidden.shape[:-1] + (params["embed"].shape[0],), -jnp.inf, jnp.float32)
    return full.at[..., dv["ids"]].set(hot)


def draft_argmax(params, h, opts: RuntimeOptions = RuntimeOptions()):
    """The greedy draft token argmax draft_logits(params, RMSNorm h) without the logits (model.lm_argmax; over
    the hot rows when params carries a draft_vocab: ids[argmax of the hot logits], the lowest target id on ties
    as ids ascend, draft_logits' argmax whenever a hot logit is above -inf) -> (tokens int32[...], the normed rows [..., D]), or None where no kernel takes the call."""
    dv = params.get("draft_vocab")
    if dv is None:
        return lm_argmax(params, h, opts)
    got = lm_argmax({"lm_head": dv["lm_head"], "embed": params["embed"]}, h, opts)
    return None if got is None else (jnp.take(dv["ids"], got[0]), got[1])


__all__ = ["hot_tokens", "to_eagle3", "from_eagle3", "save", "load", "with_draft_vocab", "draft_logits", "draft_argmax", "FILE"]
