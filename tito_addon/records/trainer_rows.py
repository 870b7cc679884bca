"""Trainer rows from recordings, what `export` writes and the control API serves: one row per segment of an episode
(a run of turns of one kind of call where each prompt extends the last; see `records/episode_segments`), in one of
three layouts.

- generic: the segment's token sequence (`input_ids`: the leaf turn's prompt + completion, exactly as recorded),
  `loss_mask` (1 exactly on the tokens the model sampled, in every turn of the segment), `rollout_logprobs` (the
  sampled tokens' logprobs at their positions, 0 elsewhere), the conversation, per-turn finish reasons, the model
  and the tokenizer/template hashes that produced the ids.
- verl: the split of verl's agent loop (`verl/experimental/agent_loop/agent_loop.py`): `prompts` is the first turn's
  prompt, `responses` everything after it (every sampled completion and the tool results and user turns between
  them), `response_mask` 1 on sampled tokens, `rollout_log_probs` aligned with `responses`, `rm_scores` the reward on
  the last response token, `uid` the GRPO group (the session).
- slime: the fields of slime's `Sample` (`slime/utils/types.py`): `tokens` (the whole branch), `response_length`,
  `loss_mask` and `rollout_log_probs` over the response part only, `prompt`/`response` text, `status`, `reward`.

Every layout also carries the segment's ids (`session_id`, `leaf_turn_id`, `turn_ids`), its place (`episode`,
`segment`: its order in the episode, `call`), what a driver's annotations say about its episode (`reward`,
`labels`, `metadata` as JSON; see `records/episode_segments`), the backend's weight version of
each turn (`weight_versions`) and the model and tokenizer hashes. The README's export section maps each field to its
source. Parquet output has one fixed schema per layout and no timestamps, so equal rows give equal bytes.
"""

from __future__ import annotations

import functools
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tito_addon.records.episode_segments import Segment, SegmentNotes, episode_segments
from tito_addon.records.record_models import CALLS, TurnRecord
from tito_addon.records.record_reader import RecordError, SessionFile, iter_session_files, read_session

LAYOUTS = ("generic", "verl", "slime")
FILE_TYPES = ("parquet", "jsonl")
# `--format`: a layout, or (as before layouts existed) a file type, which then means the generic layout.
FORMATS = LAYOUTS + FILE_TYPES
# slime's `Sample.Status` values by the leaf turn's finish reason (slime reads sglang's `finish_reason.type`: length
# -> truncated, abort -> aborted, stop -> completed); tool_calls and every other reason end a turn normally.
SLIME_STATUS = {"length": "truncated", "abort": "aborted"}


class ExportError(RecordError):
    """A recording that cannot be exported in the asked layout (a tokenizer the slime text needs is missing)."""


@dataclass(frozen=True)
class Branch:
    """One segment as a row: its full ids, where the model sampled, and what the annotations say of it."""

    path: list[TurnRecord]
    ids: list[int]  # the leaf's prompt + completion
    mask: list[int]  # 1 on every sampled token of every turn of the segment
    logprobs: list[float]  # the sampled tokens' logprobs at their positions, 0 elsewhere
    messages: list[dict[str, Any]] | None  # None when the session was recorded without message text
    notes: SegmentNotes
    episode: str
    segment: int

    @property
    def prompt_len(self) -> int:
        """The first turn's prompt: the part no turn of the segment sampled or appended."""
        return self.path[0].prompt_len


def branch_of(segment: Segment, ids: dict[int, tuple[list[int], list[int]]]) -> Branch:
    path = segment.path
    prompt, completion = ids[path[-1].turn_id]
    sequence = prompt + completion
    mask = [0] * len(sequence)
    logprobs = [0.0] * len(sequence)
    messages: list[dict[str, Any]] | None = []
    for turn in path:
        start = turn.prompt_len  # the turn's completion follows its prompt in every descendant's sequence
        for offset, value in enumerate(turn.completion_logprobs):
            mask[start + offset] = 1
            logprobs[start + offset] = value
        if messages is not None and turn.appended_messages is not None:
            messages += turn.appended_messages + [turn.assistant_message]
        else:
            messages = None
    return Branch(path, sequence, mask, logprobs, messages, segment.notes, segment.episode, segment.index)


def branches(files: list[SessionFile], calls: Any = None) -> list[Branch]:
    """Every segment of every episode of `files` (only those of `calls`, None: all), episode by episode."""
    # Rebuilt first: that proves every parent recorded, before segments walk up to them.
    full = {id(session_file): session_file.full_ids() for session_file in files}
    return [branch_of(segment, full[id(segment.session)]) for segment in episode_segments(files, calls)]


def parse_calls(value: str | None) -> list[str] | None:
    """`--calls main,compaction,subagent` (the `calls` query of the control API); None or empty: every call."""
    if not value:
        return None
    calls = [part.strip() for part in value.split(",") if part.strip()]
    unknown = sorted(set(calls) - set(CALLS))
    if unknown:
        raise ValueError(f"unknown call(s) {', '.join(unknown)}; choose from: {', '.join(CALLS)}")
    return calls


def _head(branch: Branch) -> dict[str, Any]:
    leaf = branch.path[-1]
    return {
        "session_id": leaf.session_id,
        "leaf_turn_id": leaf.turn_id,
        "turn_ids": [t.turn_id for t in branch.path],
        "episode": branch.episode,
        "segment": branch.segment,
        "call": leaf.call,
    }


def _tail(branch: Branch) -> dict[str, Any]:
    leaf, notes = branch.path[-1], branch.notes
    metadata = None if notes.metadata is None else json.dumps(notes.metadata, ensure_ascii=False, allow_nan=False)
    return {
        "reward": notes.reward,
        "labels": list(notes.labels),
        "metadata": metadata,  # one column, any JSON shape
        "weight_versions": [t.weight_version for t in branch.path],
        "model": leaf.model,
        "tokenizer": leaf.tokenizer.name,
        "tokenizer_sha256": leaf.tokenizer.tokenizer_sha256,
        "template_sha256": leaf.tokenizer.template_sha256,
    }


def generic_row(branch: Branch) -> dict[str, Any]:
    return {
        **_head(branch),
        "input_ids": branch.ids,
        "loss_mask": branch.mask,
        "rollout_logprobs": branch.logprobs,
        "messages": json.dumps(branch.messages, ensure_ascii=False),
        "finish_reasons": [t.finish_reason for t in branch.path],
        **_tail(branch),
    }


def verl_num_turns(path: list[TurnRecord]) -> int:
    """verl's `num_turns` (user + assistant turns + 1 in its tool agent loop): the first prompt, each assistant
    turn, and each batch of messages (tool results, a user turn) a later turn appended."""
    appended = sum(1 for t in path[1:] if t.appended_messages or t.appended_keys)
    return 1 + len(path) + appended


def verl_row(branch: Branch) -> dict[str, Any]:
    cut = branch.prompt_len
    responses = branch.ids[cut:]
    reward = branch.notes.reward
    rm_scores = None if reward is None else [0.0] * (len(responses) - 1) + [reward]
    return {
        **_head(branch),
        "uid": branch.path[-1].session_id,  # the GRPO group: a group's samples are branches of one session
        "prompts": branch.ids[:cut],
        "responses": responses,
        "response_mask": branch.mask[cut:],
        "input_ids": branch.ids,
        "rollout_log_probs": branch.logprobs[cut:],
        "rm_scores": rm_scores,
        "reward_score": reward,
        "__num_turns__": verl_num_turns(branch.path),
        "finish_reasons": [t.finish_reason for t in branch.path],
        **_tail(branch),
    }


@functools.cache
def _decoder(name: str) -> Callable[[list[int]], str]:
    """The recorded tokenizer's decode (transformers directly, so the rows need nothing of the engine layer)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=False)
    except Exception as exc:  # transformers raises OSError, ValueError, HF hub errors...
        message = f"the slime layout decodes prompt and response text: cannot load tokenizer {name!r}: {exc}"
        raise ExportError(message) from exc

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    return decode


def slime_row(branch: Branch, index: int = 0, group_index: int = 0) -> dict[str, Any]:
    cut = branch.prompt_len
    leaf = branch.path[-1]
    decode = _decoder(leaf.tokenizer.name)
    return {
        **_head(branch),
        "group_index": group_index,
        "index": index,
        "prompt": decode(branch.ids[:cut]),
        "tokens": branch.ids,
        "response": decode(branch.ids[cut:]),
        "response_length": len(branch.ids) - cut,
        "loss_mask": branch.mask[cut:],
        "rollout_log_probs": branch.logprobs[cut:],
        "status": SLIME_STATUS.get(leaf.finish_reason or "", "completed"),
        **_tail(branch),
    }


def session_rows(session_file: SessionFile, layout: str, calls: list[str] | None = None) -> list[dict[str, Any]]:
    """The rows of one session's segments (of `calls` only, None: all) in `layout` (one of `LAYOUTS`).

    slime rows number their segments from 0 (`index`) in group 0 (`group_index`); `export` renumbers them across
    the sessions it writes together (one session alone keeps these numbers)."""
    return rows_of([session_file], layout, calls)


def rows_of(files: list[SessionFile], layout: str, calls: list[str] | None = None) -> list[dict[str, Any]]:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of: {', '.join(LAYOUTS)}")
    found = branches(files, calls)
    if layout == "verl":
        return [verl_row(branch) for branch in found]
    if layout == "slime":
        return [slime_row(branch, index) for index, branch in enumerate(found)]
    return [generic_row(branch) for branch in found]


@functools.cache
def schema(layout: str) -> Any:
    """The Parquet schema of a layout: fixed, so every export of a layout has the same columns and types."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of: {', '.join(LAYOUTS)}")
    import pyarrow as pa

    ids, mask, floats, strings = (
        pa.list_(pa.int64()),
        pa.list_(pa.int8()),
        pa.list_(pa.float64()),
        pa.list_(pa.string()),
    )
    head = [
        ("session_id", pa.string()),
        ("leaf_turn_id", pa.int64()),
        ("turn_ids", ids),
        ("episode", pa.string()),
        ("segment", pa.int64()),
        ("call", pa.string()),
    ]
    tail = [
        ("reward", pa.float64()),
        ("labels", strings),
        ("metadata", pa.string()),
        ("weight_versions", strings),
        ("model", pa.string()),
        ("tokenizer", pa.string()),
        ("tokenizer_sha256", pa.string()),
        ("template_sha256", pa.string()),
    ]
    body = {
        "generic": [
            ("input_ids", ids),
            ("loss_mask", mask),
            ("rollout_logprobs", floats),
            ("messages", pa.string()),
            ("finish_reasons", strings),
        ],
        "verl": [
            ("uid", pa.string()),
            ("prompts", ids),
            ("responses", ids),
            ("response_mask", mask),
            ("input_ids", ids),
            ("rollout_log_probs", floats),
            ("rm_scores", floats),
            ("reward_score", pa.float64()),
            ("__num_turns__", pa.int32()),
            ("finish_reasons", strings),
        ],
        "slime": [
            ("group_index", pa.int64()),
            ("index", pa.int64()),
            ("prompt", pa.string()),
            ("tokens", ids),
            ("response", pa.string()),
            ("response_length", pa.int64()),
            ("loss_mask", mask),
            ("rollout_log_probs", floats),
            ("status", pa.string()),
        ],
    }[layout]
    return pa.schema(head + body + tail)


def encode_rows(rows: list[dict[str, Any]], layout: str, file_type: str) -> bytes:
    """The exact bytes `export` writes for `rows` of `layout`: Parquet (one fixed schema per layout, no timestamps:
    equal rows give equal bytes) or JSON Lines (one strict-JSON object per row, columns in schema order)."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"unknown file type {file_type!r}; choose one of: {', '.join(FILE_TYPES)}")
    columns = schema(layout).names  # also refuses an unknown layout
    for row in rows:
        if list(row) != columns:
            raise ValueError(f"a row does not have the {layout} columns: {sorted(set(row) ^ set(columns))}")
    if file_type == "jsonl":
        lines = (json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n" for row in rows)
        return "".join(lines).encode("utf-8")
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema(layout)), sink)
    return sink.getvalue()


def resolve_format(fmt: str, file_type: str | None = None) -> tuple[str, str]:
    """(layout, file type) from `--format` and `--to`: `parquet`/`jsonl` as a format is the generic layout."""
    if fmt in FILE_TYPES:
        if file_type not in (None, fmt):
            raise ValueError(f"--format {fmt} is the generic layout as {fmt}; it cannot be written as {file_type}")
        return "generic", fmt
    if fmt not in LAYOUTS:
        raise ValueError(f"unknown format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    return fmt, file_type or "parquet"


def export(
    record_dir: Path,
    out: Path,
    fmt: str = "generic",
    progress: Any = None,
    *,
    file_type: str | None = None,
    sessions: list[str] | None = None,
    calls: list[str] | None = None,
) -> int:
    """Write every segment of every episode under `record_dir` (or of the named `sessions` only; of `calls` only) to
    `out`; returns the number of rows."""
    layout, file_type = resolve_format(fmt, file_type)
    if not record_dir.is_dir():
        raise RecordError(f"{record_dir} is not a directory")
    if sessions:
        files: list[SessionFile] = []
        for session_id in dict.fromkeys(sessions):
            found = read_session(record_dir, session_id)
            if found is None:
                raise RecordError(f"no session {session_id!r} in {record_dir}")
            files.append(found)
            if progress is not None:
                progress()
    else:
        files = []
        for session_file in iter_session_files(record_dir):
            files.append(session_file)
            if progress is not None:
                progress()
    # An episode's segments may lie in several sessions: the rows are made from all of them together.
    rows = rows_of(files, layout, calls)
    if layout == "slime":
        groups = {
            session_file.turns[0].session_id: group for group, session_file in enumerate(files) if session_file.turns
        }
        for index, row in enumerate(rows):
            row["group_index"], row["index"] = groups[row["session_id"]], index
    data = encode_rows(rows, layout, file_type)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    return len(rows)
