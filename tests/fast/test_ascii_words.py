"""ASCII text is encoded without the Rust pre-tokenizer's regex (engine/ascii_words.py) for the byte-level BPE
families, and gives the Rust tokenizer's ids on every shared text, the template, and generated text."""

from __future__ import annotations

import json
import re

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from support.basics import SHARED, cached_engine, examples

from tito_addon.engine import ascii_words as module
from tito_addon.engine.ascii_words import AsciiWords, ascii_words
from tito_addon.engine.role_pieces import CONTENT_PROBES

WORD_FAMILIES = ["qwen3", "qwen2.5", "gpt-oss"]


def rust(family: str) -> tokenizers.Tokenizer:
    engine = cached_engine(family, roles=("tool", "user"))
    assert engine._fast is not None
    return engine._fast


def words(family: str) -> AsciiWords:
    encoder = cached_engine(family, roles=("tool", "user")).encode
    assert isinstance(encoder, AsciiWords)
    return encoder


def shared_texts() -> list[str]:
    texts = [json.loads(line)["text"] for line in (SHARED / "tokenizers" / "render_examples.jsonl").open()]
    for path in (SHARED / "drift_cases").glob("*.jsonl"):
        for line in path.open():
            if line.strip():
                texts += [v for v in json.loads(line).values() if isinstance(v, str)]
    texts += list(CONTENT_PROBES)
    for family in ["qwen3", "qwen2.5", "deepseek-r1", "gpt-oss", "mistral"]:
        texts.append(cached_engine(family, roles=("tool", "user")).template)
    # The ASCII-only texts, and every other one with what is not ASCII left out (markers, JSON, code stay).
    return [text if text.isascii() else text.encode("ascii", "ignore").decode() for text in texts]


def test_the_byte_level_bpe_families_encode_ascii_by_words_and_the_others_do_not() -> None:
    for family in WORD_FAMILIES:
        words(family)
    for family in ["deepseek-r1", "mistral"]:  # several splits / Metaspace: the Rust tokenizer's alone
        assert not isinstance(cached_engine(family, roles=("tool", "user")).encode, AsciiWords)
        assert ascii_words(cached_engine(family, roles=("tool", "user"))._fast) is None


@pytest.mark.parametrize("family", WORD_FAMILIES)
def test_the_same_ids_on_every_shared_text(family: str) -> None:
    encoder, tokenizer = words(family), rust(family)
    texts = shared_texts()
    assert len(texts) > 400
    for text in texts:
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids, text[:80]


@pytest.mark.parametrize("family", WORD_FAMILIES)
def test_text_that_is_not_ascii_is_the_rust_tokenizers(family: str) -> None:
    encoder, tokenizer = words(family), rust(family)
    for text in ["Zürich 21 °C", "東京 🙂", "e\u0301", "<|im_end|>é"]:
        assert encoder(text) == tokenizer.encode(text, add_special_tokens=False).ids
    assert encoder("plain") == tokenizer.encode("plain", add_special_tokens=False).ids


FRAGMENTS = st.sampled_from(
    ["'s", "'T", "'re", "'LL", "'d", "'ve", "'m", "<|im_end|>", "<|im_start|>", "<tool_call>", "</tool_call>",
     "<think>", "</think>", "<|end|>", "<|start|>", "<|channel|>", "<|message|>", "<|call|>", "<|return|>",
     "<|", "|>", "<", "\r\n", "\n\n", "   ", "\t", "\x0b", "\x0c", "\x1f", "12345", "ABCdef", "don't"]
)  # fmt: skip


@pytest.mark.parametrize("family", WORD_FAMILIES)
@settings(max_examples=examples(400), deadline=None)
@given(data=st.data())
def test_generated_ascii_text(family: str, data: st.DataObject) -> None:
    parts = data.draw(st.lists(st.one_of(st.text(st.characters(max_codepoint=127), max_size=12), FRAGMENTS)))
    text = "".join(parts)
    assert words(family).encode(text) == rust(family).encode(text, add_special_tokens=False).ids, repr(text)


def test_a_wrong_split_is_caught_by_the_probes_and_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = rust("qwen3")
    assert ascii_words(tokenizer) is not None
    monkeypatch.setitem(module.ASCII_CLASSES, "N", "0-8")  # a digit class missing 9
    assert ascii_words(tokenizer) is None
    monkeypatch.setitem(module.ASCII_CLASSES, "N", "0-9")
    monkeypatch.delitem(module.ASCII_CLASSES, "L")  # a class it cannot write in ASCII
    assert ascii_words(tokenizer) is None


def test_a_tokenizer_that_truncates_is_not_taken() -> None:
    tokenizer = tokenizers.Tokenizer.from_str(rust("qwen3").to_str())
    tokenizer.enable_truncation(8)
    assert ascii_words(tokenizer) is None


@pytest.mark.parametrize("family", WORD_FAMILIES)
def test_text_is_encoded_by_runs_cut_before_spaces_that_follow_a_word(family: str) -> None:
    """Runs are remembered whole; each cut must leave the ids unchanged, where the text is cut and where it is not
    (spaces after spaces or other whitespace, a leading space, a run too long to remember)."""
    encoder, tokenizer = words(family), rust(family)
    assert encoder.cut_at_spaces
    texts = [
        "item 7: 7919 ok item 8: 7919 ok", "  leading", "a  b   c", "tab\t x", "line\n y", "x\x1c y\x1f z",
        " ", "end ", "x" * 200 + " " + "y" * 65 + " short", "don't 'll 's stop", "<|im_end|> after <think> x",
    ]  # fmt: skip
    for text in texts:
        for _ in range(2):  # the second time from remembered runs
            assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids, repr(text)
    # A run after a cut is remembered by what follows its space; runs too long are not remembered at all.
    assert "7919" in encoder.spaced_runs and "item" in encoder.runs and "  leading" in encoder.runs
    assert "x" * 200 not in encoder.runs and "y" * 65 not in encoder.spaced_runs


@pytest.mark.parametrize(
    "pattern",
    [
        r"[A-Za-z]+ [A-Za-z]+|[\s\S]",  # a piece that holds a space after a word: no cut is safe
        r"[A-Za-z]+(?=\s)|[\s\S]",  # a lookahead that reads past a run's end
        r"(?<=a)b|[\s\S]",  # a lookbehind that reads before a run's start
        r"\b[A-Za-z]+|[\s\S]",
        r"^ |[\s\S]",
    ],
)
def test_a_pattern_whose_runs_depend_on_their_context_is_not_cut(pattern: str) -> None:
    assert not module.splits_at_spaces(re.compile(pattern, re.ASCII))
    assert module.splits_at_spaces(words("qwen3").split) and module.splits_at_spaces(words("gpt-oss").split)
