"""Encoding ASCII text without the Rust pre-tokenizer's regex, for the byte-level BPE tokenizers (Qwen, gpt-oss).

Tokenizing what an agent appends is the largest share of a turn's CPU (P2): ~0.4 ms for a 150-token tool result
with Qwen's tokenizer, of which ~90 % is the pre-tokenizer's Oniguruma regex, not BPE. For ASCII text the same
split is Python's `re` with the same pattern, its Unicode classes cut to their ASCII members and `re.ASCII`
(Oniguruma's `\\s` on ASCII is `[ \\t\\n\\v\\f\\r]`, as `re.ASCII`'s is); NFC changes no ASCII text, byte-level
mapping is a `str.translate`, and each word is encoded by the tokenizer's own BPE model, remembered per word (an
agent's words repeat). Added tokens (`<|im_end|>`, `<tool_call>`) are split off first, leftmost-longest, as the
tokenizer's added vocabulary does.

Only the exact pipeline shape is accepted (NFC or no normalizer; a Split with an Isolated regex then a ByteLevel
without its own regex; BPE without dropout or byte fallback; added tokens without strip or single-word rules; no
truncation or padding), and only if it gives the Rust tokenizer's ids on probes built to disagree; anything else,
and any text that is not ASCII, is the Rust tokenizer's to encode. `tests/fast/test_ascii_words.py` holds it equal to
the Rust tokenizer on every golden and drift continuation and on generated text.

The pattern's own split costs ~0.1 µs a piece, and Qwen's makes every digit a piece. So text is first cut before
each space that follows a non-space character, where these patterns always end a piece (`splits_at_spaces`), and
each run (` item`, ` 7919:`) is remembered whole: a run seen before costs one lookup, not the pattern.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import orjson
import tokenizers

logger = logging.getLogger(__name__)

# Unicode property classes as their ASCII members (an empty string: the class has none).
ASCII_CLASSES = {
    "L": "A-Za-z", "Lu": "A-Z", "Ll": "a-z", "Lt": "", "Lm": "", "Lo": "", "M": "", "N": "0-9",
    "P": "!-#%-*,-/:;?@\\[-\\]_{}", "S": "$+<->^`|~",
}  # fmt: skip
PROPERTY = re.compile(r"\\p\{(\w+)\}")
WORD_CACHE = 200_000
RUN_CACHE = 100_000
RUN_MAX = 64  # a longer run (a blob without spaces) is split by the pattern each time and not remembered
# A space at the start or after whitespace (the pattern's: re.ASCII `\s`): there the text is not cut.
WHITESPACE = " \t\n\r\x0b\x0c"
# Substring tests find those spaces ~5x faster than the regex `^ |\s ` on a tool result.
SPACE_AFTER_WHITESPACE = tuple(c + " " for c in WHITESPACE)
SPANS_A_CUT = re.compile(r"\S ", re.ASCII)
PROBES = [
    "Hello, world! It's   fine\n\n\tok",
    "don't I'LL we've THEY'RE it'S 'd 's's",
    "x=1; y = 22 + 333*4444 - 55555/6 # 3.14159e-10",
    "def f(a, b):\n    return {'k': [a, b]}\r\n\r\n  \n",
    '{"role":"tool","content":"row 1: value=37 status=ok"}',
    "   leading and trailing   \n   ",
    "\x00\x01\x1c\x1d\x1e\x1f\x7f \x0b\x0c end",
    "CamelCaseWord lowerUPPER ABCdef aB1c2D3",
    "<|im_end|>\n<|im_start|>user\n<tool_call>\n{}\n</tool_call><think>\n\n</think>\n\n",
    "<|start|>assistant<|channel|>final<|message|>hi<|end|><|return|><|call|>",
    "<<|im_end|>> <|im_end <|im_start|><|im_start|>",
    "!!! ??? ... --- ___ *** ``` ~~~ @@@ ### $$$ %%% ^^^ &&& ||| \\\\ //",
    # every ASCII character beside letters, digits, punctuation, spaces and itself
    "".join(f"{c}a{c}Z{c}.{c}9{c} {c}{c}'s {c}\n" for c in map(chr, range(128))),
    "".join(f"x{c}7{c}-{c}\t{c}\r\n{c}{c}{c}" for c in map(chr, range(128))),
]


def _ascii_pattern(pattern: str) -> re.Pattern[str] | None:
    """`pattern` with each `\\p{X}` replaced by its ASCII members, compiled with re.ASCII; None if it names a class
    this table does not hold or uses a property outside a character class."""
    out = []
    position = 0
    depth = 0
    for index, char in enumerate(pattern):
        if index < position:
            continue
        if char == "\\":
            match = PROPERTY.match(pattern, index)
            if match is None:
                out.append(pattern[index : index + 2])
                position = index + 2
                continue
            members = ASCII_CLASSES.get(match.group(1))
            if members is None:
                return None
            out.append(members if depth else f"[{members}]" if members else "(?!)")
            position = match.end()
            continue
        if char == "[" and not depth:
            depth = 1
        elif char == "]" and depth:
            depth = 0
        out.append(char)
        position = index + 1
    try:
        return re.compile("".join(out), re.ASCII)
    except re.error:
        return None


def _byte_level_table() -> dict[int, str]:
    """GPT-2's byte-to-character map, for the ASCII bytes."""
    printable = list(range(ord("!"), ord("~") + 1))
    table = {}
    extra = 0
    for byte in range(128):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def splits_at_spaces(split: re.Pattern[str]) -> bool:
    """Whether text cut before each space that follows a non-space character encodes as the sum of its runs.

    It does when the pattern always ends a piece there, and when a run's pieces do not depend on what lies past
    its ends: no anchor, no lookbehind, and no lookahead but `(?!\\S)`, which reads the space after a run and the
    end of the run alike. The first is checked on the probes (no piece holds a non-space then a space), the rest on
    the parsed pattern; the Qwen and gpt-oss patterns pass both."""
    if any(SPANS_A_CUT.search(piece) for probe in PROBES for piece in split.findall(probe)):
        return False
    try:
        from re import _constants as sre_constants
        from re import _parser as sre_parse

        nodes: list[Any] = [sre_parse.parse(split.pattern, split.flags)]
    except (ImportError, re.error):
        return False
    not_before_a_non_space = [(sre_constants.IN, [(sre_constants.CATEGORY, sre_constants.CATEGORY_NOT_SPACE)])]
    while nodes:
        node = nodes.pop()
        if isinstance(node, sre_parse.SubPattern):
            for op, argument in node:
                if op is sre_constants.AT:
                    return False
                if op in (sre_constants.ASSERT, sre_constants.ASSERT_NOT):
                    direction, inner = argument
                    if direction < 0 or op is sre_constants.ASSERT or list(inner) != not_before_a_non_space:
                        return False
                    continue
                nodes.append(argument)
        elif isinstance(node, (list, tuple)):
            nodes.extend(node)
    return True


class AsciiWords:
    def __init__(self, tokenizer: tokenizers.Tokenizer, split: re.Pattern[str], added: dict[str, int]) -> None:
        self.model = tokenizer.model
        self.split = split
        self.added = added
        self.added_lengths = sorted({len(token) for token in added}, reverse=True)
        starts = "".join(sorted({re.escape(token[0]) for token in added}))
        self.added_start = re.compile(f"[{starts}]") if starts else None
        self.table = str.maketrans(_byte_level_table())
        self.words: dict[str, tuple[int, ...]] = {}  # tuples of ints: the garbage collector stops walking them
        self.runs: dict[str, tuple[int, ...]] = {}
        self.spaced_runs: dict[str, tuple[int, ...]] = {}  # " " + key -> its ids
        self.cut_at_spaces = splits_at_spaces(split)
        self.fallback: Callable[[str], list[int]] = lambda text: tokenizer.encode(text, add_special_tokens=False).ids

    def __call__(self, text: str) -> list[int]:
        return self.encode(text) if text.isascii() else self.fallback(text)

    def encode(self, text: str) -> list[int]:
        """The ids of ASCII `text` (the caller checks `text.isascii()`)."""
        ids: list[int] = []
        start = 0
        if self.added_start is not None:
            for found in self.added_start.finditer(text):
                at = found.start()
                if at < start:
                    continue
                for length in self.added_lengths:
                    token_id = self.added.get(text[at : at + length])
                    if token_id is not None:
                        self._words(text[start:at], ids)
                        ids.append(token_id)
                        start = at + length
                        break
        self._words(text[start:], ids)
        return ids

    def _words(self, text: str, ids: list[int]) -> None:
        if not self.cut_at_spaces:
            self._pieces(text, ids)
            return
        parts = text.split(" ")
        if not text.startswith(" ") and not any(pair in text for pair in SPACE_AFTER_WHITESPACE):
            # Every space is a cut: the runs are the first part, then a space and each part after it. Those are
            # remembered by the part alone, so no run string is built for a run seen before.
            self._run(parts[0], parts[0], self.runs, ids)
            spaced = self.spaced_runs
            for part in parts[1:]:
                found = spaced.get(part)
                if found is None:
                    self._run(part, " " + part, spaced, ids)
                else:
                    ids += found
            return
        run = parts[0]
        for part in parts[1:]:
            if run and run[-1] not in WHITESPACE:
                self._run(run, run, self.runs, ids)
                run = " " + part
            else:
                run += " " + part
        self._run(run, run, self.runs, ids)

    def _run(self, key: str, run: str, known: dict[str, tuple[int, ...]], ids: list[int]) -> None:
        """Add the ids of `run`, remembered in `known` under `key` (`run` itself, or the part after its space)."""
        found = known.get(key)
        if found is None:
            if len(run) > RUN_MAX:
                self._pieces(run, ids)
                return
            encoded: list[int] = []
            self._pieces(run, encoded)
            if len(known) >= RUN_CACHE:
                known.clear()
            found = known[key] = tuple(encoded)
        ids += found

    def _pieces(self, text: str, ids: list[int]) -> None:
        pieces = self.split.findall(text)
        if sum(map(len, pieces)) != len(text):  # text the pattern left between matches is a piece of its own
            pieces = self._pieces_with_gaps(text)
        words = self.words
        for word in pieces:
            found = words.get(word)
            if found is None:
                if len(words) >= WORD_CACHE:
                    words.clear()
                found = words[word] = tuple([token.id for token in self.model.tokenize(word.translate(self.table))])
            ids += found

    def _pieces_with_gaps(self, text: str) -> list[str]:
        pieces = []
        position = 0
        for match in self.split.finditer(text):
            start, end = match.span()
            if start > position:
                pieces.append(text[position:start])
            if end > start:
                pieces.append(text[start:end])
            position = end
        if position < len(text):
            pieces.append(text[position:])
        return pieces


_serialized: tuple[tokenizers.Tokenizer, str] | None = None


def tokenizer_json(tokenizer: tokenizers.Tokenizer) -> str:
    """The tokenizer's whole pipeline as JSON (several MB): written once for the last tokenizer asked about, since
    reading its shape here and fingerprinting it for the records each took a quarter of a proxy's start."""
    global _serialized
    if _serialized is None or _serialized[0] is not tokenizer:
        _serialized = (tokenizer, tokenizer.to_str())
    return _serialized[1]


def ascii_words(tokenizer: tokenizers.Tokenizer | None) -> AsciiWords | None:
    """The ASCII encoder for `tokenizer`, or None where its pipeline is not the shape this module reproduces."""
    if tokenizer is None or tokenizer.truncation is not None or tokenizer.padding is not None:
        return None
    try:
        config: dict[str, Any] = orjson.loads(tokenizer_json(tokenizer))
    except (ValueError, TypeError):  # (orjson.JSONDecodeError is a ValueError)
        return None
    normalizer = config.get("normalizer")
    if normalizer not in (None, {"type": "NFC"}) and normalizer != {"type": "Sequence", "normalizers": []}:
        return None
    model = config.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout") is not None or model.get("byte_fallback"):
        return None
    steps = (config.get("pre_tokenizer") or {}).get("pretokenizers") or []
    if len(steps) != 2:
        return None
    split, byte_level = steps
    if (
        split.get("type") != "Split"
        or split.get("behavior") != "Isolated"
        or split.get("invert")
        or "Regex" not in (split.get("pattern") or {})
        or byte_level.get("type") != "ByteLevel"
        or byte_level.get("add_prefix_space")
        or byte_level.get("use_regex")
    ):
        return None
    pattern = _ascii_pattern(split["pattern"]["Regex"])
    added: dict[str, int] = {}
    for token in config.get("added_tokens") or []:
        if token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
            return None
        if token["content"].isascii() and token["content"]:
            added[token["content"]] = token["id"]
    if pattern is None or pattern.groups:
        return None
    encoder = AsciiWords(tokenizer, pattern, added)
    specials = "".join(list(added)[:64])
    for probe in [*PROBES, specials, specials + PROBES[0] + specials]:
        if encoder.encode(probe) != tokenizer.encode(probe, add_special_tokens=False).ids:
            logger.info("the ASCII word encoder disagrees with the tokenizer on %r; not used", probe[:60])
            return None
    return encoder
