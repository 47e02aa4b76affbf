"""Tokenizers without torch or transformers: a `tokenizers.Tokenizer` plus the special tokens and
chat template of its model.

Sources: a directory with ``tokenizer.json`` (+ ``tokenizer_config.json``, as Hugging Face and
jaxgen checkpoints ship it), or a GGUF file, whose metadata (``tokenizer.ggml.*``) describes the
vocabulary, merges, token types and pre-tokenizer; `from_gguf_metadata` rebuilds that tokenizer.
`Tokenizer.save_pretrained` writes both files, so a converted model loads with `tokenizers`
directly (`model.loading.load_tokenizer` picks the source). The method names follow
transformers (``encode``, ``decode``, ``apply_chat_template``, ``save_pretrained``,
``tokenizer(text)["input_ids"]``) so code written for either runs on both.
"""

from __future__ import annotations

import functools
import json
import os
from datetime import datetime

from jaxgen.model.errors import ModelLoadError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")

# llama.cpp's token types (gguf.TokenType): how a vocabulary entry behaves in text.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer splits by `tokenizer.ggml.pre`, as llama.cpp's llama-vocab.cpp lists them (the
# regexes are the ones the models' own tokenizer.json files use).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# (regex splits applied in order, then byte-level mapping); None: GPT-2's own split.
_PRE_SPLITS: dict[str, tuple[str, ...] | None] = {
    "default": None,
    "gpt-2": None,
    "gpt2": None,
    # StarCoder-family vocabularies (SmolLM among them) isolate every digit first.
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "starcoder": (r"\p{N}", _GPT2_SPLIT),
    "refact": (r"\p{N}", _GPT2_SPLIT),
    "llama3": (_LLAMA3_SPLIT,),
    "llama-v3": (_LLAMA3_SPLIT,),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
}


@functools.cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (Radford et al. 2019, encoder.py):
    printable Latin-1 bytes map to themselves, the other 68 to U+0100 onwards."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """A `tokenizers.Tokenizer` with its special tokens and chat template.

    Args:
      backend: the `tokenizers.Tokenizer` (normalizer, pre-tokenizer, model, post-processor
        that adds BOS/EOS when asked, decoder).
      special: {"bos_token": "<s>", ...}; absent or None where the model has none.
      chat_template: the Jinja chat template, or None.
      clean_up_tokenization_spaces: transformers' decode clean-up (" ." -> "."), off unless the
        model's config turns it on.
    """

    def __init__(
        self,
        backend,
        special=None,
        chat_template=None,
        clean_up_tokenization_spaces=False,
        add_bos_token=None,
        add_eos_token=None,
    ):
        self.backend = backend
        self.special = {k: v for k, v in (special or {}).items() if v is not None}
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        for name in self.special.values():
            if backend.token_to_id(name) is None:
                raise ModelLoadError(f"special token {name!r} is not in the vocabulary")
        self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
        if add_bos_token is not None or add_eos_token is not None:
            self._set_post_processor(bool(add_bos_token), bool(add_eos_token))

    # ------------------------------------------------------------------------------------------
    # Loading and saving
    # ------------------------------------------------------------------------------------------
    @classmethod
    def from_directory(cls, directory: str) -> Tokenizer:
        """Loads ``tokenizer.json`` and ``tokenizer_config.json`` (Hugging Face layout)."""
        from tokenizers import Tokenizer as Backend

        path = os.path.join(directory, TOKENIZER_FILE)
        if not os.path.isfile(path):
            raise ModelLoadError(
                f"{directory}: no {TOKENIZER_FILE}; jaxgen reads fast-tokenizer files only "
                "(re-save the tokenizer with transformers' save_pretrained, or convert the model "
                "with `jaxgen convert`)"
            )
        try:
            backend = Backend.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ModelLoadError(f"{path}: cannot read the tokenizer: {e}") from e
        config = _read_json(os.path.join(directory, TOKENIZER_CONFIG), default={})
        template = config.get("chat_template")
        jinja_path = os.path.join(directory, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        if template is None:
            template = _read_json(os.path.join(directory, "chat_template.json"), default={}).get(
                "chat_template"
            )
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default", next(iter(named.values()), None))
        return cls(
            backend,
            {name: _token_text(config.get(name)) for name in SPECIAL_NAMES},
            chat_template=template,
            clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
            add_bos_token=config.get("add_bos_token"),
            add_eos_token=config.get("add_eos_token"),
        )

    @classmethod
    def from_gguf(cls, path: str) -> Tokenizer:
        from jaxgen.model.gguf_io import read_tokenizer_metadata

        return from_gguf_metadata(read_tokenizer_metadata(path), source=path)

    def save_pretrained(self, directory: str) -> None:
        """Writes ``tokenizer.json`` and ``tokenizer_config.json`` (readable by transformers)."""
        os.makedirs(directory, exist_ok=True)
        self.backend.save(os.path.join(directory, TOKENIZER_FILE))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **self.special,
            "clean_up_tokenization_spaces": self.clean_up_tokenization_spaces,
        }
        if self.add_bos_token is not None:
            config["add_bos_token"] = self.add_bos_token
        if self.add_eos_token is not None:
            config["add_eos_token"] = self.add_eos_token
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        with open(os.path.join(directory, TOKENIZER_CONFIG), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)

    # ------------------------------------------------------------------------------------------
    # Special tokens
    # ------------------------------------------------------------------------------------------
    def _id(self, name: str) -> int | None:
        token = self.special.get(name)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self.special.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def _set_post_processor(self, bos: bool, eos: bool) -> None:
        """BOS/EOS around every encoded text, as the model's config asks."""
        from tokenizers import processors

        single, pair, tokens = "$A:0", "$B:1", []
        if bos and self.bos_token is not None:
            single, pair = f"{self.bos_token}:0 {single}", f"{self.bos_token}:1 {pair}"
            tokens.append((self.bos_token, self.bos_token_id))
        if eos and self.eos_token is not None:
            single, pair = f"{single} {self.eos_token}:0", f"{pair} {self.eos_token}:1"
            tokens.append((self.eos_token, self.eos_token_id))
        self.backend.post_processor = processors.TemplateProcessing(
            single=single, pair=f"{single} {pair}", special_tokens=list(dict(tokens).items())
        )

    # ------------------------------------------------------------------------------------------
    # Text <-> ids
    # ------------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        """transformers' calling convention: ``tokenizer(text)["input_ids"]``."""
        return {"input_ids": self.encode(text, add_special_tokens)}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self.clean_up_tokenization_spaces else text

    def convert_ids_to_tokens(self, ids) -> list[str | None]:
        return [self.backend.id_to_token(int(i)) for i in ids]

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes one token stands for (a piece of a character for some tokens, which
        `decode` shows as U+FFFD): byte-level BPE spells bytes in GPT-2's byte alphabet,
        SentencePiece's byte fallback as <0xNN>, its spaces as U+2581."""
        token = self.backend.id_to_token(int(token_id))
        if token is None:
            raise ValueError(f"token id {token_id} is not in the vocabulary")
        added = {t.content for t in self.backend.get_added_tokens_decoder().values()}
        if token in added:
            return token.encode("utf-8")
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            try:
                return bytes([int(token[3:5], 16)])
            except ValueError:
                pass
        if type(self.backend.decoder).__name__ == "ByteLevel":
            inverse = {c: b for b, c in _byte_alphabet().items()}
            if all(c in inverse for c in token):
                return bytes(inverse[c] for c in token)
        return token.replace("\u2581", " ").encode("utf-8")

    def apply_chat_template(
        self, conversation, *, add_generation_prompt: bool = False, tokenize: bool = True, **kwargs
    ):
        """Renders a conversation with the model's chat template (Jinja, as transformers renders
        it); token ids unless ``tokenize=False``. Extra keyword arguments reach the template."""
        if self.chat_template is None:
            raise ValueError(
                "this tokenizer has no chat template; pass a prompt string instead of messages"
            )
        text = _compiled_template(self.chat_template).render(
            messages=conversation,
            add_generation_prompt=add_generation_prompt,
            **self.special,
            **kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


# ----------------------------------------------------------------------------------------------
# Chat templates
# ----------------------------------------------------------------------------------------------
class TemplateError(ValueError):
    """A chat template called raise_exception (e.g. roles out of order)."""


def _raise_exception(message):
    raise TemplateError(message)


@functools.lru_cache(maxsize=16)
def _compiled_template(source: str):
    """The template compiled in a sandbox, with the globals chat templates rely on."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _clean_up_spaces(text: str) -> str:
    """transformers' clean_up_tokenization: no space before punctuation and English clitics."""
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text


def _read_json(path: str, default):
    if not os.path.isfile(path):
        return default
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not valid JSON: {e}") from e


# ----------------------------------------------------------------------------------------------
# GGUF metadata -> tokenizer
# ----------------------------------------------------------------------------------------------
def from_gguf_metadata(meta: dict, source: str = "GGUF file") -> Tokenizer:
    """Rebuilds the tokenizer a GGUF file describes.

    Args:
      meta: the ``tokenizer.*`` metadata without its ``tokenizer.`` prefix: ``ggml.model``
        ("gpt2": byte-level BPE; "llama": SentencePiece BPE with byte fallback), ``ggml.tokens``,
        ``ggml.token_type``, ``ggml.merges``, ``ggml.scores``, ``ggml.pre``, the special token
        ids, ``ggml.add_bos_token`` / ``ggml.add_eos_token`` and ``chat_template``.
    """
    kind = meta.get("ggml.model")
    tokens = list(meta.get("ggml.tokens") or ())
    if not tokens:
        raise ModelLoadError(f"{source}: no tokenizer.ggml.tokens in the metadata")
    types = list(meta.get("ggml.token_type") or [NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise ModelLoadError(f"{source}: {len(types)} token types for {len(tokens)} tokens")
    as_written = tokens  # the marked-token checks read the file's own spelling
    if kind == "gpt2":
        backend, tokens = _byte_level_bpe(meta, tokens, source)
    elif kind == "llama":
        backend = _sentencepiece_bpe(meta, tokens, types, source)
    else:
        raise ModelLoadError(
            f"{source}: tokenizer.ggml.model {kind!r} is not supported (jaxgen builds 'gpt2' "
            "byte-level BPE and 'llama' SentencePiece BPE vocabularies)"
        )
    _add_marked_tokens(backend, as_written, types, byte_level=kind == "gpt2")
    special = {}
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        index = meta.get(f"ggml.{key}")
        if index is not None:
            if not 0 <= int(index) < len(tokens):
                raise ModelLoadError(f"{source}: tokenizer.ggml.{key}={index} is out of range")
            special[name] = tokens[int(index)]
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    add_bos = meta.get("ggml.add_bos_token", True if kind == "llama" else None)
    return Tokenizer(
        backend,
        special,
        chat_template=meta.get("chat_template"),
        add_bos_token=None if add_bos is None else bool(add_bos),
        add_eos_token=meta.get("ggml.add_eos_token"),
    )


def _byte_level_bpe(meta, tokens, source):
    """GPT-2-style byte-level BPE; the split regexes come from ``tokenizer.ggml.pre``."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    pre = meta.get("ggml.pre", "default")
    if pre not in _PRE_SPLITS:
        raise ModelLoadError(
            f"{source}: tokenizer.ggml.pre {pre!r} is not known to jaxgen (known: "
            f"{', '.join(sorted(_PRE_SPLITS))}); tokenizing with another split would give "
            "different ids than the model was trained on"
        )
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # A token written in plain text (some converters store added tokens that way) is respelled
    # in the byte alphabet, as the BPE model sees text.
    tokens = [
        t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8")) for t in tokens
    ]
    if meta.get("ggml.merges") is None:
        raise ModelLoadError(f"{source}: a 'gpt2' vocabulary without tokenizer.ggml.merges")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = _merges(meta["ggml.merges"], vocab, source)
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    splits = _PRE_SPLITS[pre]
    if splits is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    backend.decoder = decoders.ByteLevel()
    return backend, tokens


def _merges(merges, vocab, source) -> list[tuple[str, str]]:
    """ "left right" strings as pairs, each part and its merge in the vocabulary (`tokenizers`
    panics on a merge outside it)."""
    pairs = []
    for m in merges:
        left, sep, right = m.partition(" ")
        if not sep or left not in vocab or right not in vocab or left + right not in vocab:
            raise ModelLoadError(
                f"{source}: merge {m!r} does not join two tokens of the vocabulary into a third"
            )
        pairs.append((left, right))
    return pairs


def _sentencepiece_bpe(meta, tokens, types, source):
    """SentencePiece BPE (Llama 1/2, Mistral): '▁' for spaces, a leading '▁' on the first word,
    bytes as <0xNN> tokens. Files without merges get them from the scores: a merge of two
    tokens into a third ranks by that third's score (higher merges first), as SentencePiece
    applies them."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    if meta.get("ggml.merges") is not None:
        pairs = _merges(meta["ggml.merges"], vocab, source)
    else:
        scores = meta.get("ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ModelLoadError(
                f"{source}: a 'llama' vocabulary needs merges or one score a token"
            )
        ranked = []
        for token, index in vocab.items():
            if types[index] != NORMAL:
                continue
            for cut in range(1, len(token)):
                left, right = token[:cut], token[cut:]
                if left in vocab and right in vocab:
                    ranked.append((-float(scores[index]), vocab[left], vocab[right], left, right))
        ranked.sort()
        pairs = [(left, right) for *_, left, right in ranked]
    unk = meta.get("ggml.unknown_token_id")
    backend = Backend(
        models.BPE(
            vocab=vocab,
            merges=pairs,
            byte_fallback=True,
            fuse_unk=True,
            unk_token=tokens[int(unk)] if unk is not None else None,
        )
    )
    prefix = meta.get("ggml.add_space_prefix", True)
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _add_marked_tokens(backend, tokens, types, byte_level):
    """Control tokens (``<|im_start|>``) become special added tokens and user-defined ones
    (``<think>``) plain added tokens, so text that contains them keeps them whole. A byte-level
    vocabulary's control token outside the byte alphabet is a converter's mislabel and stays
    out, as does a user-defined token the vocabulary does not hold as written: adding either
    would grow the vocabulary past the model's embedding."""
    from tokenizers import AddedToken

    spelled = set(_byte_alphabet().values())
    control, user = [], []
    for token, kind in zip(tokens, types, strict=True):
        if kind == CONTROL and (not byte_level or set(token) <= spelled):
            control.append(AddedToken(token, special=True, normalized=False))
        elif kind == USER_DEFINED and backend.token_to_id(token) is not None:
            user.append(AddedToken(token, special=False, normalized=False))
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)


def read_text_tokens(tokenizer, path: str, max_tokens: int | None = None) -> list[int]:
    """Tokenizes a text file (no special tokens), keeping the first `max_tokens` tokens."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[:max_tokens] if max_tokens else ids
