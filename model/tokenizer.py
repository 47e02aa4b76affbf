"""Tokenizers via `transformers.AutoTokenizer`, from an HF/jaxgen directory or a GGUF file."""

from __future__ import annotations

import os

from model.errors import ModelLoadError


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
        return transformers.AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"{path}: cannot build a tokenizer: {e}") from e
