"""The one exception for a checkpoint a user can fix: config.json, safetensors files, tokenizer files.

Raised by the loaders (ling_jax.config, ling_jax.safetensors_io, ling_jax.weights, ling_jax.tokenizer) with a
message naming the file or tensor and what was expected vs found. The CLIs (`python -m ling_jax.generate`,
`python -m serve.launch_server`) print it as one line `error: <message>` and exit with status 2, no traceback.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that does not match the model or cannot be read. The message is always one line."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def read_json_object(path: str) -> dict:
    """A JSON object file (config.json, tokenizer_config.json); unreadable JSON or another type is a CheckpointError
    naming the file."""
    import json
    import os

    try:
        with open(path) as f:
            d = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt {os.path.basename(path)}: expected JSON, found {e}") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{path}: corrupt {os.path.basename(path)}: expected a JSON object, found "
                              f"{type(d).__name__}")
    return d
