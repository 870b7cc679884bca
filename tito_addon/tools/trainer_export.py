"""Export recordings for trainers: one row per branch (a root-to-leaf path of a session tree).

A row holds the branch's token sequence (`input_ids`: the leaf turn's prompt + completion, exactly as recorded),
`loss_mask` (1 exactly on the tokens the model sampled, in every turn of the branch), `rollout_logprobs` (the
sampled tokens' logprobs at their positions, 0 elsewhere), the conversation, per-turn finish reasons, the model
and the tokenizer/template hashes that produced the ids.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tito_addon.records.record_reader import SessionFile, iter_session_files

FORMATS = ("parquet", "jsonl")


@dataclass(frozen=True)
class BranchRow:
    session_id: str
    leaf_turn_id: int
    turn_ids: list[int]
    input_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    messages: list[dict[str, Any]] | None  # None when the session was recorded without message text
    finish_reasons: list[str | None]
    model: str | None
    tokenizer: str
    tokenizer_sha256: str
    template_sha256: str

    def as_dict(self) -> dict[str, Any]:
        row = dict(self.__dict__)
        row["messages"] = json.dumps(self.messages, ensure_ascii=False)  # one column, any message shape
        return row


def branches(session_file: SessionFile) -> Iterator[BranchRow]:
    """Every root-to-leaf path of the session's tree, in the order the leaves were recorded."""
    ids = session_file.full_ids()
    for path in session_file.branches():
        leaf = path[-1]
        prompt, completion = ids[leaf.turn_id]
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
        yield BranchRow(
            session_id=leaf.session_id,
            leaf_turn_id=leaf.turn_id,
            turn_ids=[t.turn_id for t in path],
            input_ids=sequence,
            loss_mask=mask,
            rollout_logprobs=logprobs,
            messages=messages,
            finish_reasons=[t.finish_reason for t in path],
            model=leaf.model,
            tokenizer=leaf.tokenizer.name,
            tokenizer_sha256=leaf.tokenizer.tokenizer_sha256,
            template_sha256=leaf.tokenizer.template_sha256,
        )


def export(record_dir: Path, out: Path, fmt: str, progress: Any = None) -> int:
    """Write every branch of every session under `record_dir` to `out`; returns the number of rows."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    files = list(iter_session_files(record_dir))
    rows: list[dict[str, Any]] = []
    for session_file in files:
        rows += [row.as_dict() for row in branches(session_file)]
        if progress is not None:
            progress()
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        with out.open("w", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema(
            [
                ("session_id", pa.string()),
                ("leaf_turn_id", pa.int64()),
                ("turn_ids", pa.list_(pa.int64())),
                ("input_ids", pa.list_(pa.int64())),
                ("loss_mask", pa.list_(pa.int8())),
                ("rollout_logprobs", pa.list_(pa.float64())),
                ("messages", pa.string()),
                ("finish_reasons", pa.list_(pa.string())),
                ("model", pa.string()),
                ("tokenizer", pa.string()),
                ("tokenizer_sha256", pa.string()),
                ("template_sha256", pa.string()),
            ]
        )
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), out)
    return len(rows)
