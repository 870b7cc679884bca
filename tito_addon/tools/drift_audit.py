"""Drift audit: how far would a re-tokenizing pipeline have drifted from what the model actually saw and sampled?

Each recorded branch's ids are compared, id by id, with a re-render of its final messages through the
tokenizer's stock chat template, tokenized as an OpenAI-compatible server would. Every differing span is
classified from the ids and their text (never from text alone, which hides BPE re-splits):

- `bpe_resplit`: the same text, other ids (non-canonical splits, byte-split UTF-8);
- `special_token_collision`: ordinary tokens spelling a control token (`<think>`, `<|im_end|>`) or the reverse;
- `unicode_normalization`: the same text after NFC (the tokenizer normalises what the model emitted);
- `eos_newline`: the newline the template writes after an end-of-turn token the model stopped on;
- `template_kwarg`: an empty `<think></think>` block (a thinking switch the re-render did not apply);
- `stripped_think`: reasoning the template drops from history;
- `tool_call_json`: tool-call JSON re-serialised (spacing, escapes, string vs object arguments);
- `whitespace`: whitespace the template strips or rewrites;
- `template_other`: any other template difference.
"""

from __future__ import annotations

import difflib
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tito_addon.canonical_chat import ChatMessage
from tito_addon.engine.template_messages import template_message
from tito_addon.records.record_models import TurnRecord
from tito_addon.records.record_reader import RecordError, SessionFile
from tito_addon.records.recorded_routes import routes_summary

CLASSES = (
    "bpe_resplit",
    "special_token_collision",
    "unicode_normalization",
    "eos_newline",
    "template_kwarg",
    "stripped_think",
    "tool_call_json",
    "whitespace",
    "template_other",
)
_WHITESPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class DriftSpan:
    kind: str
    recorded: tuple[int, int]  # half-open span of the recorded ids
    rerendered: tuple[int, int]  # half-open span of the re-rendered ids
    recorded_text: str
    rerendered_text: str

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def classify(recorded: list[int], rerendered: list[int], tokenizer: Any) -> list[DriftSpan]:
    """Align two id sequences and classify each differing span."""
    # Control tokens: every added token (`<think>` and `<tool_call>` are added but not flagged special in Qwen).
    special = set(getattr(tokenizer, "all_special_ids", []) or []) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)  # noqa: E731
    spans = []
    matcher = difflib.SequenceMatcher(None, recorded, rerendered, autojunk=False)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal":
            continue
        a_ids, b_ids = recorded[i1:i2], rerendered[j1:j2]
        a, b = decode(a_ids), decode(b_ids)
        context = decode(recorded[max(0, i1 - 400) : i1])
        kind = _kind(a, b, a_ids, b_ids, special, context)
        spans.append(DriftSpan(kind, (i1, i2), (j1, j2), a, b))
    return spans


def _kind(a: str, b: str, a_ids: list[int], b_ids: list[int], special: set[int], context: str) -> str:
    if a == b:
        if any(i in special for i in a_ids) != any(i in special for i in b_ids):
            return "special_token_collision"
        return "bpe_resplit"
    if unicodedata.normalize("NFC", a) == unicodedata.normalize("NFC", b):
        return "unicode_normalization"
    one_sided = b if not a else a if not b else None
    if one_sided is not None and one_sided.strip() == "" and "\n" in one_sided and len(one_sided) <= 2:
        return "eos_newline"
    a_think, b_think = ("<think>" in a or "</think>" in a), ("<think>" in b or "</think>" in b)
    if a_think != b_think:  # one side has a think block the other lacks (whitespace may have merged in)
        think_side = a if a_think else b
        return "template_kwarg" if _WHITESPACE.sub("", think_side) == "<think></think>" else "stripped_think"
    in_tool_call = context.rfind("<tool_call>") > context.rfind("</tool_call>")
    if in_tool_call or "\\u" in a + b or '\\"' in a + b:
        return "tool_call_json"
    if _WHITESPACE.sub("", a) == _WHITESPACE.sub("", b):
        return "whitespace"
    return "template_other"


@dataclass
class BranchAudit:
    session_id: str
    leaf_turn_id: int
    tokens: int
    spans: list[DriftSpan] = field(default_factory=list)
    per_turn: dict[int, int] = field(default_factory=dict)  # turn id -> differing recorded tokens
    # turn id -> where a weight update cut its generation (completion offsets), for the branch's resumed turns
    resumed: dict[int, list[int]] = field(default_factory=dict)
    # Where the branch recorded MoE routes: what `recorded_routes.routes_summary` says of them (the weight versions
    # they were routed under; a drifted position would replay a route onto another token than it was computed for).
    routes: dict[str, Any] | None = None

    def kinds(self) -> Counter[str]:
        return Counter(span.kind for span in self.spans)

    def as_dict(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "leaf_turn_id": self.leaf_turn_id,
            "tokens": self.tokens,
            "differing_tokens_per_turn": self.per_turn,
            "resumed_turns": self.resumed,
            "routes": self.routes,
            "kinds": dict(self.kinds()),
            "spans": [span.as_dict() for span in self.spans],
        }


def audit_session(session_file: SessionFile, tokenizer: Any) -> list[BranchAudit]:
    """Every branch of the session against a stock re-render of its final messages."""
    ids = session_file.full_ids()
    audits = []
    for path in session_file.branches():
        leaf = path[-1]
        prompt, completion = ids[leaf.turn_id]
        recorded = prompt + completion
        messages = []
        for turn in path:
            if turn.appended_messages is None:
                raise RecordError(
                    f"session {turn.session_id} turn {turn.turn_id} was recorded without message text "
                    "(tito_record_message_text=false): the audit re-renders messages, so it cannot run on it"
                )
            messages += [ChatMessage.model_validate(m) for m in turn.appended_messages]
            messages.append(ChatMessage.model_validate({**turn.assistant_message, "role": "assistant"}))
        tools = next((t.tools for t in reversed(path) if t.tools), None)
        text = tokenizer.apply_chat_template(
            [template_message(m) for m in messages],
            tools=tools,
            add_generation_prompt=False,
            tokenize=False,
            **leaf.chat_template_kwargs,
        )
        rerendered = list(tokenizer.encode(text, add_special_tokens=False))
        audit = BranchAudit(leaf.session_id, leaf.turn_id, len(recorded), classify(recorded, rerendered, tokenizer))
        audit.per_turn = _per_turn(path, audit.spans)
        audit.resumed = {turn.turn_id: list(turn.resumed.cuts) for turn in path if turn.resumed}
        if leaf.routed_experts is not None:
            audit.routes = routes_summary(session_file, leaf.turn_id)
        audits.append(audit)
    return audits


def _per_turn(path: list[TurnRecord], spans: list[DriftSpan]) -> dict[int, int]:
    """Differing recorded tokens attributed to the turn that added them (an insertion counts once)."""
    bounds = []
    start = 0
    for turn in path:
        end = turn.prompt_len + len(turn.completion_ids)
        bounds.append((turn.turn_id, start, end))
        start = end
    counts = {turn.turn_id: 0 for turn in path}
    for span in spans:
        lo, hi = span.recorded
        if hi == lo:  # an insertion: the turn at that position, or the last one at the very end
            owner = next((t for t, begin, end in bounds if begin <= lo < end), bounds[-1][0])
            counts[owner] += 1
            continue
        for turn_id, begin, end in bounds:
            counts[turn_id] += max(0, min(hi, end) - max(lo, begin))
    return counts
