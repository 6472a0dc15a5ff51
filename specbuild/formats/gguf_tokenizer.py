"""A GGUF file's tokenizer metadata -> a Hugging Face `tokenizers` JSON string + special ids.

A GGUF carries no `tokenizer.json`; it stores llama.cpp's description of the tokenizer:

    tokenizer.ggml.model        "gpt2" (byte-level BPE) | "llama" (SentencePiece-style BPE)
    tokenizer.ggml.pre          the pre-tokenizer (split regex) family, e.g. "smollm", "llama-bpe"
    tokenizer.ggml.tokens       [n_vocab] token strings, index = token id
    tokenizer.ggml.token_type   [n_vocab] 1 normal, 2 unknown, 3 control, 4 user-defined,
                                5 unused, 6 byte
    tokenizer.ggml.merges       ["a b", ...] BPE merges, best first (gpt2; optional for llama)
    tokenizer.ggml.scores       [n_vocab] SentencePiece scores (llama; ranks derived merges)
    tokenizer.ggml.{bos,eos,eot,eom,unknown}_token_id, add_bos_token, add_eos_token,
    tokenizer.ggml.add_space_prefix, tokenizer.chat_template

We rebuild the tokenizer the model was trained with through the `tokenizers` API. Control and
unknown tokens become special added tokens (matched whole, skipped by `decode(...,
skip_special_tokens=True)`); user-defined tokens become plain added tokens (matched whole).
Token ids are the GGUF indices, so the vocabulary order is the file's.

Pre-tokenizers (the `tokenizer.ggml.pre` families we know, with the same splits as llama.cpp
and as the original Hugging Face `tokenizer.json` of those models):

    gpt2/default  GPT-2's byte-level regex
    smollm        each digit alone, then GPT-2's regex on the stretches between (SmolLM,
                  StarCoder). transformers' own GGUF loader drops the digit step; that only
                  shows on whitespace runs before a digit ("a  1"), where we follow the original
                  tokenizer and llama.cpp.
    llama-bpe     Llama 3's regex (digits in groups of 3), whole-word vocabulary hits skip merging
    qwen2         NFC, then Qwen2's regex (every digit alone)

BOS/EOS: when the file says `add_bos_token` (`add_eos_token`), the post-processor adds it, as a
Hugging Face `tokenizer.json` does, so `encode(text)` (add_special_tokens=True) yields the ids
the model expects and callers must not add BOS again; `special["add_bos_token"]` reports it.
Chat-template output already holds its BOS: encode it with add_special_tokens=False.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from specbuild.errors import CheckpointError

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
SPM_SPACE = "\u2581"  # SentencePiece's visible space

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> family (names grouped as llama.cpp's llama-vocab.cpp groups them)
PRE_FAMILIES: dict[str, str] = {
    "default": "gpt2",
    "gpt2": "gpt2",
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    "llama-bpe": "llama3",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "falcon3": "llama3",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
}
SUPPORTED_MODELS = ("gpt2", "llama")
# Control tokens whose text marks the end of a turn: stop ids besides EOS when present.
END_OF_TURN_TEXTS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


def field_value(reader: Any, name: str, default: Any = None) -> Any:
    """One metadata value of a `gguf.GGUFReader` as a Python value (str, int, float, bool, list).

    Reads `field.parts` at the indices in `field.data` (the layout of gguf 0.10 to 0.19), so it
    does not depend on `ReaderField.contents()`, which older gguf releases lack.
    """
    from gguf import GGUFValueType

    field = reader.fields.get(name)
    if field is None or not field.types:
        return default
    try:
        if field.types[0] == GGUFValueType.ARRAY:
            if field.types[-1] == GGUFValueType.STRING:
                return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            return [v for i in field.data for v in field.parts[i].tolist()]
        if field.types[0] == GGUFValueType.STRING:
            return bytes(field.parts[field.data[0]]).decode("utf-8")
        return field.parts[field.data[0]].tolist()[0]
    except UnicodeDecodeError as e:
        raise CheckpointError(f"GGUF metadata {name!r} holds a string that is not UTF-8: {e}") from None


def tokenizer_from_gguf(reader: Any) -> tuple[str, dict[str, Any]]:
    """(tokenizer JSON in HF `tokenizers` format, special dict) from a `gguf.GGUFReader`.

    special: bos_token_id, eos_token_id (int | None), eos_token_ids (list[int]: EOS plus the
    end-of-turn ids the file names), add_bos_token (bool), chat_template (str | None).
    Raises CheckpointError for a missing/inconsistent vocabulary or an unsupported
    tokenizer.ggml.model / tokenizer.ggml.pre.
    """
    model = field_value(reader, "tokenizer.ggml.model")
    if model not in SUPPORTED_MODELS:
        raise CheckpointError(
            f"GGUF tokenizer.ggml.model {model!r} is not supported (supported: {', '.join(SUPPORTED_MODELS)})"
        )
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise CheckpointError("GGUF metadata lacks tokenizer.ggml.tokens (the vocabulary)")
    n_vocab = len(tokens)
    types = field_value(reader, "tokenizer.ggml.token_type") or [TOKEN_NORMAL] * n_vocab
    if len(types) != n_vocab:
        raise CheckpointError(
            f"GGUF tokenizer.ggml.token_type has {len(types)} entries but tokenizer.ggml.tokens has {n_vocab}"
        )

    def token_id(key: str) -> int | None:
        value = field_value(reader, f"tokenizer.ggml.{key}")
        if value is None:
            return None
        if not 0 <= int(value) < n_vocab:
            raise CheckpointError(f"GGUF tokenizer.ggml.{key} = {value} is outside the vocabulary [0, {n_vocab})")
        return int(value)

    bos, eos = token_id("bos_token_id"), token_id("eos_token_id")
    add_bos = bool(field_value(reader, "tokenizer.ggml.add_bos_token", model == "llama"))
    add_eos = bool(field_value(reader, "tokenizer.ggml.add_eos_token", False))

    if model == "gpt2":
        pre = field_value(reader, "tokenizer.ggml.pre", "default")
        tokenizer = _byte_level_tokenizer(tokens, _merges(reader, tokens), pre)
    else:
        tokenizer = _sentencepiece_tokenizer(reader, tokens, types, token_id("unknown_token_id"))
    _add_marked_tokens(tokenizer, tokens, types, _vocab(tokens))
    _set_post_processor(tokenizer, model, tokens, bos if add_bos else None, eos if add_eos else None)

    eos_ids = [eos] if eos is not None else []
    for extra in (token_id("eot_token_id"), token_id("eom_token_id")):
        if extra is not None and extra not in eos_ids:
            eos_ids.append(extra)
    for i, (text, kind) in enumerate(zip(tokens, types)):
        if kind == TOKEN_CONTROL and text in END_OF_TURN_TEXTS and i not in eos_ids:
            eos_ids.append(i)
    special = {
        "bos_token_id": bos,
        "eos_token_id": eos,
        "eos_token_ids": eos_ids,
        "add_bos_token": add_bos and bos is not None,
        "chat_template": field_value(reader, "tokenizer.chat_template"),
    }
    return tokenizer.to_str(), special


def _merges(reader: Any, tokens: list[str]) -> list[tuple[str, str]]:
    raw = field_value(reader, "tokenizer.ggml.merges")
    if raw is None:
        raise CheckpointError("GGUF tokenizer.ggml.model 'gpt2' needs tokenizer.ggml.merges, which is missing")
    return _split_merges(raw)


def _split_merges(raw: list[str]) -> list[tuple[str, str]]:
    merges = []
    for i, line in enumerate(raw):
        parts = line.split(" ")
        if len(parts) != 2:
            raise CheckpointError(f"GGUF tokenizer.ggml.merges[{i}] = {line!r} is not two tokens separated by a space")
        merges.append((parts[0], parts[1]))
    return merges


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, text in enumerate(tokens):
        vocab.setdefault(text, i)  # a repeated string keeps its first id, as llama.cpp's lookup does
    return vocab


def _bpe(vocab: dict[str, int], merges: list[tuple[str, str]], **kwargs: Any) -> models.BPE:
    try:
        return models.BPE(vocab=vocab, merges=merges, **kwargs)
    except Exception as e:  # tokenizers raises a bare Exception for merges outside the vocabulary
        raise CheckpointError(f"GGUF tokenizer merges do not fit its vocabulary: {e}") from None


def _byte_level_tokenizer(tokens: list[str], merges: list[tuple[str, str]], pre: str) -> Tokenizer:
    family = PRE_FAMILIES.get(pre)
    if family is None:
        raise CheckpointError(
            f"GGUF tokenizer.ggml.pre {pre!r} is not supported (supported: {', '.join(sorted(PRE_FAMILIES))})"
        )
    tokenizer = Tokenizer(_bpe(_vocab(tokens), merges, ignore_merges=family == "llama3"))
    if family == "gpt2":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif family == "digits":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        split = _LLAMA3_SPLIT if family == "llama3" else _QWEN2_SPLIT
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        if family == "qwen2":
            tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_tokenizer(reader: Any, tokens: list[str], types: list[int], unk: int | None) -> Tokenizer:
    """Llama 2 / Mistral style: BPE over pieces with U+2581 for spaces, bytes as <0xNN> tokens."""
    vocab = _vocab(tokens)
    raw = field_value(reader, "tokenizer.ggml.merges")
    if raw is not None:
        merges = _split_merges(raw)
    else:
        scores = field_value(reader, "tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise CheckpointError(
                "GGUF tokenizer.ggml.model 'llama' without merges needs tokenizer.ggml.scores, one per token"
            )
        merges = derive_merges(tokens, scores, types)
    unk_token = tokens[unk] if unk is not None else None
    tokenizer = Tokenizer(_bpe(vocab, merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True))
    prefix = bool(field_value(reader, "tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPM_SPACE, prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def derive_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every way to cut a normal piece into two
    normal pieces, ranked by the whole piece's score (higher first), ties by the halves' ids."""
    ids = {}
    for i, (text, kind) in enumerate(zip(tokens, types)):
        if kind in (TOKEN_NORMAL, TOKEN_USER_DEFINED):
            ids.setdefault(text, i)
    ranked = []
    for text, i in ids.items():
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in ids and right in ids:
                ranked.append((-float(scores[i]), ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _add_marked_tokens(tokenizer: Tokenizer, tokens: list[str], types: list[int], vocab: dict[str, int]) -> None:
    """Control/unknown tokens -> special added tokens; user-defined -> plain added tokens.

    `tokenizers` reuses a vocabulary id for an added token already in the vocabulary, so the
    ids stay the file's (checked below; a repeated string is the one way that can fail)."""
    special = [(i, t) for i, (t, k) in enumerate(zip(tokens, types)) if k in (TOKEN_CONTROL, TOKEN_UNKNOWN)]
    user = [(i, t) for i, (t, k) in enumerate(zip(tokens, types)) if k == TOKEN_USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t in special])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for _, t in user])
    for i, text in special + user:
        got = tokenizer.token_to_id(text)
        if got != i and vocab[text] == i:
            raise CheckpointError(f"GGUF added token {text!r} should have id {i} but was given {got}")


def _set_post_processor(
    tokenizer: Tokenizer, model: str, tokens: list[str], bos: int | None, eos: int | None
) -> None:
    steps = []
    if model == "gpt2":
        steps.append(processors.ByteLevel(trim_offsets=False))
    if bos is not None or eos is not None:
        head = [tokens[bos]] if bos is not None else []
        tail = [tokens[eos]] if eos is not None else []
        single = head + ["$A:0"] + tail
        pair = single + [f"{t}:1" for t in head] + ["$B:1"] + [f"{t}:1" for t in tail]
        pairs = {tokens[i]: i for i in (bos, eos) if i is not None}
        steps.append(processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(pairs.items())))
    if steps:
        tokenizer.post_processor = steps[0] if len(steps) == 1 else processors.Sequence(steps)
