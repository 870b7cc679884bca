"""JSON written by orjson where it writes what the standard library would (`exact_json`): record lines and the
chat API's replies. A non-finite float is the one value orjson writes differently (as `null`): a record line must
refuse it, a reply writes it as the standard library does."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.basics import examples

from tito_addon.exact_json import dumps_exact
from tito_addon.records.record_models import dump_line

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)  # fmt: skip


@settings(max_examples=examples(300), deadline=None)
@given(fields=st.dictionaries(st.text(max_size=12), JSON_VALUES, max_size=6))
def test_a_record_line_reads_back_as_the_standard_library_writes_it(fields: dict) -> None:
    """Lines are written by orjson; whatever they hold (nulls, the text "null", any float) reads back as the
    standard library's line of the same fields."""
    line = dump_line(fields)
    assert json.loads(line) == json.loads(json.dumps(fields, ensure_ascii=False, allow_nan=False)) == fields


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize(
    "where",
    [
        lambda bad: {"completion_logprobs": [-0.5, bad], "finish_reason": None},
        lambda bad: {"assistant_message": {"content": "null", "tool_calls": [{"score": bad}]}},
        lambda bad: {"sampling": {"temperature": bad}},  # no null anywhere else in the line
        lambda bad: {"ts": bad, "model": "null"},
        lambda bad: {"parent_turn_id": None, "ts": bad},  # as many nulls as members that are None, plus one
        lambda bad: {"a": None, "b": None, "c": {"d": [bad]}},
    ],
)
def test_a_record_line_refuses_a_non_finite_number_wherever_it_is(bad: float, where) -> None:
    # orjson alone would write it as null: a trainer would read a logprob or a parameter that was never sent.
    with pytest.raises(ValueError):
        dump_line(where(bad))


def test_a_record_line_keeps_what_orjson_cannot_write() -> None:
    fields = {"big": 2**80, "neg": -(2**70), 3: "an int key", "ids": [1, 2]}
    assert json.loads(dump_line(fields)) == {"big": 2**80, "neg": -(2**70), "3": "an int key", "ids": [1, 2]}


def test_a_reply_writes_a_non_finite_number_as_the_standard_library_does() -> None:
    body = {"choices": [{"logprobs": {"content": [{"logprob": float("nan")}, {"logprob": float("-inf")}]}}], "x": None}
    out = dumps_exact(body, allow_nan=True)
    assert b"NaN" in out and b"-Infinity" in out
    back = json.loads(out)["choices"][0]["logprobs"]["content"]
    assert math.isnan(back[0]["logprob"]) and back[1]["logprob"] == -math.inf
