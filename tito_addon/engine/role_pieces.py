"""The appended messages' text without Jinja: pieces read off the chat template once per shape, holes filled per turn.

`TokenEngine._synthetic_suffix` renders a turn's appended messages (tool results, user messages) in a small synthetic
context, twice, with Jinja: a fifth of the proxy's CPU per turn, more with big tool schemas (rendered into the system
prompt each time). The five known families' templates insert an appended message's content (and Mistral its
tool_call_id) verbatim, so the suffix is a fixed text with holes for a given *shape*: the roles and names of the
appended messages, which of their tool_call_ids are equal and how long each is, the called tool names, the tools and
the kwargs. A shape is rendered once with sentinel strings in the holes (a per-process random nonce), split at the
sentinels, and verified against Jinja on adversarial probes (edge whitespace, quotes, backslashes, braces, JSON,
non-ASCII, empty, partial markers, odd ids of the same length); a shape that fails is never used. At run time a turn
takes the pieces only when every hole string is free of the nonce and of the markers the template could branch on
(its added tokens and bos/eos, and the literals it tests with `in`, `startswith`, `split`...): otherwise, and for any
other family or template, Jinja renders it as before.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import string
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from tito_addon.canonical_chat import ChatMessage
from tito_addon.engine.template_messages import template_message

CACHE_ENTRIES = 4096
# The families whose templates were read to hold for this (content and ids go in verbatim, no branch on them but
# through markers): the fixed template files, and Qwen2.5's own template (the official one, by its digest).
VETTED_FAMILIES = frozenset({"qwen3", "deepseek-r1", "gpt-oss", "mistral"})
VETTED_TEMPLATE_SHA256 = frozenset({"cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f"})
MIN_ID_LENGTH = 4  # a sentinel id as short as the real one must still be unmistakable in the render
_ALNUM = string.ascii_letters + string.digits
# The literals a template compares content with: `'x' in s`, `s.startswith('x')`, `s.split('x')`...
_TEST_LITERAL = re.compile(
    r"""(?:startswith|endswith|split|rstrip|lstrip|strip|replace|find|index|count)\(\s*"""
    r"""('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")|('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")\s+(?:not\s+)?in\b"""
)
# Contents every shape is checked with (each message gets each, in turn): what templates trim, escape or test.
CONTENT_PROBES = (
    "",
    " \n\t leading and trailing whitespace \t\n ",
    "\n",
    " plain \"double\" 'single' back\\slash {{ x }} {% if y %} {# z #} <b>html</b> &amp; ünïcödé 你好 🎉 \u2028\r\n",
    '{"json": [1, 2.5, null, true], "s": "a\\nb\\u00e9"}',
    "x",
    "null",
    "partial markers: <tool_resp <|im_ [INS </thin <｜tool ｜> <|channel|analysis",
    " ",
    'ends with a backslash and a quote \\"',
    "line one\n\nline two\n",
)


def _test_literals(template: str) -> set[str]:
    literals = set()
    for match in _TEST_LITERAL.finditer(template):
        quoted = match.group(1) or match.group(2)
        try:
            literal = orjson.loads(quoted) if quoted[0] == '"' else orjson.loads('"' + quoted[1:-1] + '"')
        except orjson.JSONDecodeError:
            literal = quoted[1:-1]
        if isinstance(literal, str) and literal.strip():
            literals.add(literal)
    return literals


def branch_markers(template: str, tokenizer: Any) -> list[str]:
    """Strings a template could branch on in content: the added tokens it spells, bos/eos, and its test literals.
    Whitespace is not among them: every shape is verified on contents with and without edge whitespace."""
    markers = {str(token.content) for token in tokenizer.added_tokens_decoder.values() if token.content in template}
    markers |= {str(t) for t in (getattr(tokenizer, "bos_token", None), getattr(tokenizer, "eos_token", None)) if t}
    markers |= _test_literals(template)
    # One that holds another is found by that one.
    return sorted(m for m in markers if not any(other != m and other in m for other in markers))


SuffixRenderer = Callable[[list[ChatMessage], Any, dict[str, Any], Sequence[str]], tuple[str, str]]


class RolePieces:
    """Per engine: shapes -> pieces (literal texts and holes), with hit and fallback counts."""

    def __init__(self, render_suffix: SuffixRenderer, *, family: str, template: str, tokenizer: Any) -> None:
        self._render_suffix = render_suffix
        sha = hashlib.sha256(template.encode()).hexdigest()
        self.enabled = family in VETTED_FAMILIES or (family == "qwen2.5" and sha in VETTED_TEMPLATE_SHA256)
        self.nonce = secrets.token_hex(8)
        self.markers = branch_markers(template, tokenizer) if self.enabled else []
        self._guard = (self.nonce, *self.markers)
        self._shapes: dict[bytes, tuple[list[Any], str] | None] = {}
        self.hits = 0
        self.fallbacks = 0

    def suffix(
        self,
        appended: list[ChatMessage],
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any],
        called_names: Sequence[str] = (),
    ) -> tuple[str, str] | None:
        """`(messages_text, generation_text)` exactly as `render_suffix` would give them, or None: render them."""
        found = self._pieces(appended, tools, kwargs, called_names) if self.enabled else None
        if found is None:
            self.fallbacks += 1
            return None
        pieces, generation_text, holes = found
        self.hits += 1
        return "".join(piece if isinstance(piece, str) else holes[piece[0]][piece[1]] for piece in pieces), (
            generation_text
        )

    def _pieces(
        self,
        appended: list[ChatMessage],
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any],
        called_names: Sequence[str],
    ) -> tuple[list[Any], str, tuple[list[str], list[str]]] | None:
        contents: list[str] = []
        ids: list[str] = []  # one per id class, in order of first appearance
        shape: list[Any] = []
        unnamed: set[str] = set()
        leading = True
        for message in appended:
            if message.tool_calls or message.role not in ("tool", "user", "system"):
                return None
            rendered = template_message(message)
            if set(rendered) - {"role", "content", "tool_call_id", "name"}:
                return None
            content = rendered["content"]
            if not isinstance(content, str) or self._guarded(content):
                return None
            contents.append(content)
            leading = leading and message.role == "tool"
            call_id = message.tool_call_id
            if call_id is None:
                if leading:  # the synthetic base names this call `call_<index>`: no other id may be that
                    unnamed.add(f"call_{len(shape)}")
                shape.append([message.role, message.name, None, 0])
                continue
            if len(call_id) < MIN_ID_LENGTH or self._guarded(call_id):
                return None
            if call_id not in ids:
                ids.append(call_id)
            shape.append([message.role, message.name, ids.index(call_id), len(call_id)])
        if not unnamed.isdisjoint(ids):
            return None
        try:
            key = orjson.dumps([shape, list(called_names), tools, kwargs], option=orjson.OPT_SORT_KEYS)
        except TypeError:
            return None
        if key in self._shapes:
            compiled = self._shapes[key]
        else:
            if len(self._shapes) >= CACHE_ENTRIES:
                self._shapes.clear()
            compiled = self._shapes[key] = self._compile(appended, [len(i) for i in ids], tools, kwargs, called_names)
        if compiled is None:
            return None
        pieces, generation_text = compiled
        return pieces, generation_text, (contents, ids)

    def _guarded(self, text: str) -> bool:
        return any(marker in text for marker in self._guard)

    def _compile(
        self,
        appended: list[ChatMessage],
        id_lengths: list[int],
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any],
        called_names: Sequence[str],
    ) -> tuple[list[Any], str] | None:
        """Render the shape with sentinels, split it at them, and check the pieces against Jinja on probes."""
        content_sentinels = [f"tito{self.nonce}c{i}z" for i in range(len(appended))]
        id_sentinels = self._id_sentinels(id_lengths)
        try:
            messages_text, generation_text = self._render(
                appended, content_sentinels, id_sentinels, tools, kwargs, called_names
            )
        except Exception:  # the Jinja path raises its own error for this request
            return None
        holes = {s: (0, i) for i, s in enumerate(content_sentinels)} | {s: (1, c) for c, s in enumerate(id_sentinels)}
        pieces: list[Any] = [messages_text]
        if holes:
            splitter = re.compile("(" + "|".join(map(re.escape, holes)) + ")")
            if splitter.search(generation_text):
                return None
            parts = splitter.split(messages_text)
            pieces = [holes[part] if index % 2 else part for index, part in enumerate(parts) if part or index % 2]
        for probe in range(len(CONTENT_PROBES)):
            contents = [CONTENT_PROBES[(probe + i) % len(CONTENT_PROBES)] for i in range(len(appended))]
            probe_ids = self._probe_ids(id_lengths, probe)
            try:
                expected = self._render(appended, contents, probe_ids, tools, kwargs, called_names)
            except Exception:
                return None
            filled = "".join(p if isinstance(p, str) else (contents, probe_ids)[p[0]][p[1]] for p in pieces)
            if expected != (filled, generation_text):
                return None
        return pieces, generation_text

    def _render(
        self,
        appended: list[ChatMessage],
        contents: list[str],
        id_strings: list[str],
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any],
        called_names: Sequence[str],
    ) -> tuple[str, str]:
        """The Jinja suffix of the shape of `appended` with these contents and ids (by class) filled in."""
        classes: list[str] = []
        messages = []
        for message, content in zip(appended, contents, strict=True):
            call_id = message.tool_call_id
            if call_id is not None:
                if call_id not in classes:
                    classes.append(call_id)
                call_id = id_strings[classes.index(call_id)]
            messages.append(ChatMessage(role=message.role, content=content, tool_call_id=call_id, name=message.name))
        return self._render_suffix(messages, tools, kwargs, called_names)

    def _id_sentinels(self, lengths: list[int]) -> list[str]:
        sentinels: list[str] = []
        while len(sentinels) < len(lengths):
            candidate = "".join(secrets.choice(_ALNUM) for _ in range(lengths[len(sentinels)]))
            if candidate not in sentinels and not any(candidate in s or s in candidate for s in sentinels):
                sentinels.append(candidate)
        return sentinels

    @staticmethod
    def _probe_ids(lengths: list[int], probe: int) -> list[str]:
        """Ids of the given lengths, distinct per class: alphanumeric, then quotes, braces, spaces and non-ASCII."""
        alphabets = (_ALNUM, "\"'\\{}<>[] \n|é你", "_-.:/0123456789")
        alphabet = alphabets[probe % len(alphabets)]
        out: list[str] = []
        for index, length in enumerate(lengths):
            shift = probe * 7 + index * 3
            candidate = "".join(alphabet[(shift + k * (index + 1)) % len(alphabet)] for k in range(length))
            while candidate in out:
                candidate = "".join(secrets.choice(_ALNUM) for _ in range(length))
            out.append(candidate)
        return out
