"""Tokenizers built without transformers, against transformers' own tokenizers (the reference).

The default model's GGUF names its pre-tokenizer `smollm`: llama.cpp splits such text by
isolating every digit (`\\p{N}`) before GPT-2's split, as SmolLM2's own tokenizer.json does with
`Digits(individual_digits=True)`. transformers' GGUF loader has no entry for `smollm` and falls
back to GPT-2's split, which differs where a run of spaces or a space precedes a number (one
line of wikitext-2's test split: "died 4 ½ months"). The reference is therefore transformers'
GGUF tokenizer with SmolLM2's declared pre-tokenizer put back; the unpatched loader is compared
too, and must differ only on lines with a number.
"""

import os
import re

import numpy as np
import pytest

from jaxgen.model import ModelLoadError, Tokenizer
from jaxgen.model.tokenizer import from_gguf_metadata
from tests.helpers import default_gguf

WIKITEXT = os.path.join(
    os.path.dirname(__file__), "..", "..", "..", "shared", "data", "wikitext-2", "test.txt"
)
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hi <|im_start|> there<|im_end|>\n  1,234 ½ 東京 🚀"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "<|endoftext|> and <file_sep> stay whole"},
    ],
]


def wikitext_lines():
    with open(WIKITEXT, encoding="utf-8") as f:
        return f.read().splitlines()


@pytest.fixture(scope="module")
def ours():
    directory, name = default_gguf()
    return Tokenizer.from_gguf(os.path.join(directory, name))


@pytest.fixture(scope="module")
def transformers_gguf():
    """transformers' tokenizer of the same GGUF file, unpatched."""
    import transformers

    directory, name = default_gguf()
    return transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)


@pytest.fixture(scope="module")
def reference(transformers_gguf):
    """transformers' GGUF tokenizer with SmolLM2's declared pre-tokenizer."""
    import copy

    from tokenizers import pre_tokenizers

    ref = copy.deepcopy(transformers_gguf)
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return ref


@pytest.mark.reference
def test_gguf_tokens_equal_reference_on_every_wikitext_line(ours, reference, transformers_gguf):
    lines = wikitext_lines()
    assert len(lines) > 4000
    differ_from_unpatched = []
    for line in lines:
        ids = ours.encode(line, add_special_tokens=False)
        assert ids == reference(line, add_special_tokens=False)["input_ids"], line
        assert ours.decode(ids) == line
        if ids != transformers_gguf(line, add_special_tokens=False)["input_ids"]:
            differ_from_unpatched.append(line)
    print(
        f"{len(lines)} lines equal; {len(differ_from_unpatched)} differ from the unpatched loader"
    )
    assert all(re.search(r"\s\d|\s½", line) for line in differ_from_unpatched)
    assert len(differ_from_unpatched) < 0.01 * len(lines)


@pytest.mark.reference
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["one-turn", "special-tokens"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_reference(ours, reference, conversation, add_generation_prompt):
    text = ours.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert text == reference.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == reference(text, add_special_tokens=False)["input_ids"]
    assert ids == ours.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt
    )
    # Special tokens in the text stay whole, one id each.
    assert ids.count(ours.backend.token_to_id("<|im_start|>")) == text.count("<|im_start|>")
    assert ours.decode(ids) == text
    assert ours.decode(ids, skip_special_tokens=True) == reference.decode(
        ids, skip_special_tokens=True
    )


@pytest.mark.reference
def test_special_ids_equal_reference(ours, reference):
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(ours, name) == getattr(reference, name), name
    assert len(ours) == len(reference)


@pytest.mark.reference
@pytest.mark.parametrize("writer", ["jaxgen", "transformers"])
def test_hf_directory_tokens_equal_reference(ours, transformers_gguf, writer, tmp_path):
    """A directory that ships tokenizer.json: written by jaxgen (a converted checkpoint) or by
    transformers (a Hugging Face model), read by both."""
    import transformers

    (ours if writer == "jaxgen" else transformers_gguf).save_pretrained(str(tmp_path))
    mine = Tokenizer.from_directory(str(tmp_path))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    texts = wikitext_lines()[:400] + [
        ours.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
        for c in CONVERSATIONS
    ]
    for text in texts:
        for special in (True, False):
            ids = mine.encode(text, add_special_tokens=special)
            assert ids == theirs(text, add_special_tokens=special)["input_ids"], text
        assert mine.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids, skip_special_tokens=True
        )
    assert (mine.eos_token_id, mine.bos_token_id) == (theirs.eos_token_id, theirs.bos_token_id)
    conversation = CONVERSATIONS[1]
    assert mine.apply_chat_template(conversation, tokenize=False) == theirs.apply_chat_template(
        conversation, tokenize=False
    )


def _write_sentencepiece_gguf(path):
    """A tiny SentencePiece-BPE ('llama') vocabulary with byte fallback, no merges (scores)."""
    import gguf

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for i, (piece, score) in enumerate(
        [
            ("▁", -1.0),
            ("a", -2.0),
            ("b", -2.5),
            ("c", -3.0),
            ("▁a", -1.5),
            ("ab", -1.2),
            ("▁ab", -0.5),
            ("bc", -4.0),
            ("▁c", -3.5),
            ("abc", -0.2),
        ]
    ):
        tokens.append(piece)
        types.append(1)
        scores.append(score - i * 1e-3)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


SPM_TEXTS = ["ab abc", "a b c", "abcab  c", "caba", "x ab é", "ab\nabc", ""]


def test_sentencepiece_gguf_round_trips(tmp_path):
    path = tmp_path / "spm.gguf"
    _write_sentencepiece_gguf(path)
    tok = Tokenizer.from_gguf(str(path))
    assert tok.encode("abc")[:1] == [1]  # BOS, as the file asks
    # "▁ab▁abc": the best-scored pair present merges first: ab, then abc, then ▁ab.
    assert tok.convert_ids_to_tokens(tok.encode("ab abc", add_special_tokens=False)) == [
        "▁ab",
        "▁",
        "abc",
    ]
    assert tok.convert_ids_to_tokens(tok.encode("é", add_special_tokens=False)) == [
        "▁",
        "<0xC3>",
        "<0xA9>",
    ]
    for text in SPM_TEXTS:
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == text


@pytest.mark.reference
def test_sentencepiece_gguf_equals_reference(tmp_path):
    import transformers

    path = tmp_path / "spm.gguf"
    _write_sentencepiece_gguf(path)
    tok = Tokenizer.from_gguf(str(path))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in SPM_TEXTS + [" leading", "  two"]:
        assert tok.encode(text) == ref(text)["input_ids"], text
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(
            ids, skip_special_tokens=True
        )


def test_round_trips_and_special_tokens(ours):
    for text in ["naïve café — 東京 🚀", "  leading and trailing spaces  ", "a\n\nb\tc", "x  2000"]:
        assert ours.decode(ours.encode(text)) == text
    ids = ours.encode("<|im_start|>user")
    assert ids[0] == 1 and ours.decode(ids, skip_special_tokens=True) == "user"
    assert ours.encode("hi") == ours("hi")["input_ids"]  # transformers' calling convention


def test_bad_sources_raise_typed_errors(tmp_path):
    base = {"ggml.model": "gpt2", "ggml.tokens": ["a", "b", "ab"], "ggml.merges": ["a b"]}
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.pre 'nonsense' is not known"):
        from_gguf_metadata({**base, "ggml.pre": "nonsense"})
    with pytest.raises(ModelLoadError, match="'bert' is not supported"):
        from_gguf_metadata({**base, "ggml.model": "bert"})
    with pytest.raises(ModelLoadError, match="merge 'b a' does not join"):
        from_gguf_metadata({**base, "ggml.merges": ["b a"]})
    with pytest.raises(ModelLoadError, match="out of range"):
        from_gguf_metadata({**base, "ggml.eos_token_id": 7})
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        Tokenizer.from_directory(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read the tokenizer"):
        Tokenizer.from_directory(str(tmp_path))
    plain = from_gguf_metadata(base)
    with pytest.raises(ValueError, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(TypeError, match="takes a str"):
        plain.encode(["a"])
