"""Flax decoder models, configs and weight loading.

Axis glossary (used in einsums and in names such as ``q_btnh``):
  B batch, T query tokens, S kv tokens, N query heads, K kv heads, G group (N / K),
  H head dim, D model width, F mlp width, V vocab, L layers, P pages.
"""

from model.config import ModelConfig, RopeScaling
from model.errors import ModelLoadError
from model.llama import Transformer, forward, init_params
from model.loading import convert, load_model, load_tokenizer, save_checkpoint
from model.tokenizer import Tokenizer

__all__ = [
    "ModelConfig",
    "ModelLoadError",
    "RopeScaling",
    "Tokenizer",
    "Transformer",
    "convert",
    "forward",
    "init_params",
    "load_model",
    "load_tokenizer",
    "save_checkpoint",
]
