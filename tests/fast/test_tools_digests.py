"""A tool list's digest is its canonical JSON's sha256, whether computed or remembered from an earlier turn."""

from __future__ import annotations

import hashlib
import json

from tito_addon.turns.turn_record import ToolsDigests

TOOLS = [
    {"type": "function", "function": {"name": "Bash", "description": "Run a command: ünïcode, \u2028, \"quotes\"",
                                      "parameters": {"type": "object", "properties": {"timeout": {"maximum": 6e5}}}}},
    {"type": "function", "function": {"name": "Read", "parameters": {"minimum": 0.1, "big": 2**63 - 1, "flag": True}}},
]  # fmt: skip


def canonical(tools) -> str:
    text = json.dumps(tools, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def test_a_remembered_digest_is_the_canonical_one() -> None:
    digests = ToolsDigests()
    first = digests(TOOLS)
    again = digests(json.loads(json.dumps(TOOLS)))  # equal values, new objects: found by their bytes
    assert first == again == canonical(TOOLS)
    assert digests(None) is None and digests([]) is None


def test_values_that_read_alike_keep_their_own_digests() -> None:
    digests = ToolsDigests()
    variants = [
        [{"a": 1}], [{"a": 1.0}], [{"a": True}], [{"a": "1"}], [{"a": 1e16}], [{"a": 10**16}],
        [{"b": 1, "a": 2}], [{"a": 2, "b": 1}], [{"a": 0.1 + 0.2}], [{"a": 0.3}],
    ]  # fmt: skip
    for _ in range(2):  # computed, then remembered
        assert [digests(tools) for tools in variants] == [canonical(tools) for tools in variants]


def test_tools_orjson_cannot_write_are_digested_all_the_same() -> None:
    digests = ToolsDigests()
    tools = [{"limit": 2**70}]  # (a lone surrogate never gets here: the request is refused)
    assert digests(tools) == digests(tools) == canonical(tools)
    assert not digests._known


def test_it_remembers_a_bounded_number_of_lists() -> None:
    digests = ToolsDigests(entries=3)
    lists = [[{"name": f"tool {i}"}] for i in range(5)]
    assert [digests(tools) for tools in lists] == [canonical(tools) for tools in lists]
    assert len(digests._known) == 3 and digests(lists[0]) == canonical(lists[0])
