"""Tokenizers via `transformers` (the fast tokenizer file directly when there is one), from an
HF/jaxgen directory or a GGUF file."""

from __future__ import annotations

import json
import os

from model.errors import ModelLoadError

GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _tokenizer_class(directory: str) -> str | None:
    try:
        with open(os.path.join(directory, "tokenizer_config.json")) as f:
            return json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        return None


def load_tokenizer(source: str | None = None):
    """The tokenizer (with its chat template) for a model source; None = default model."""
    import transformers

    from model.loading import resolve_source

    path = resolve_source(source)
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file or directory")
    try:
        if os.path.isfile(path):
            return transformers.AutoTokenizer.from_pretrained(
                os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path)
            )
        if _tokenizer_class(path) in GENERIC_CLASSES:
            # The class AutoTokenizer would pick anyway, without its registry imports (over a
            # second of start-up).
            return transformers.PreTrainedTokenizerFast.from_pretrained(path)
        return transformers.AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"{path}: cannot build a tokenizer: {e}") from e
