"""Trainer rows from recordings, what `export` writes and the control API serves: one row per segment of an episode
(a run of turns of one kind of call where each prompt extends the last; see `records/episode_segments`), grouped and
numbered for a trainer (`records/rollout_groups`), in one of four layouts.

- generic: the segment's token sequence (`input_ids`: the leaf turn's prompt + completion, exactly as recorded),
  `loss_mask` (1 exactly on the tokens the model sampled, in every turn of the segment), `rollout_logprobs` (the
  sampled tokens' logprobs at their positions, 0 elsewhere), `rollout_weight_versions` (the weight version that
  sampled each of them; "" elsewhere and where the backend reported none), the conversation, per-turn finish
  reasons, the model and the tokenizer/template hashes that produced the ids.
- verl: the split of verl's agent loop (`verl/experimental/agent_loop/agent_loop.py`): `prompts` is the first turn's
  prompt, `responses` everything after it (every sampled completion and the tool results and user turns between
  them), `response_mask` 1 on sampled tokens, `rollout_log_probs` and `rollout_weight_versions` aligned with
  `responses`, `rm_scores` the reward on
  the last response token, `uid` the GRPO group. `trainers/verl_batch` pads these rows into verl's `DataProto`.
- slime: the fields of slime's `Sample` (`slime/utils/types.py`): `tokens` (the whole branch), `response_length`,
  `loss_mask` and `rollout_log_probs` over the response part only, `prompt`/`response` text, `status`, `reward`,
  `group_index`, `index`, `rollout_id`. `trainers/slime_rollouts` writes them as slime's rollout files.
- verl-dataset: one row per group, the group's first request in verl's dataset columns (`prompt`, `data_source`,
  `reward_model`, `extra_info`), for a trainer that samples the prompts again.

Every row layout also carries the segment's ids (`session_id`, `leaf_turn_id`, `turn_ids`), its place (`episode`,
`segment`: its order in the episode, `call`), its group and numbers (`group`, `group_index`, `rollout_id`: the
episode, `index`: the row), what a driver's annotations say about its episode (`reward`, `labels`, `metadata` as JSON;
see `records/episode_segments`), the backend's weight version of each turn (`weight_versions`), the model and
tokenizer hashes, and `padded` (a copy that pads a group and trains nothing). The README's export section maps each
field to its source. Parquet output has one fixed schema per layout and no timestamps, so equal rows give equal bytes.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tito_addon.records.record_models import CALLS, TurnRecord
from tito_addon.records.record_reader import RecordError, SessionFile, iter_session_files, read_session
from tito_addon.records.rollout_groups import Arrangement, PlacedRow, arrange
from tito_addon.records.row_images import images_column, media_column
from tito_addon.records.segment_branches import Branch, branches

LAYOUTS = ("generic", "verl", "slime", "verl-dataset")
ROW_FILE_TYPES = ("parquet", "jsonl")
FILE_TYPES = ROW_FILE_TYPES + ("pt",)  # pt: slime's `{rollout_id}.pt` rollout files (`trainers/slime_rollouts`)
# `--format`: a layout, or (as before layouts existed) a file type, which then means the generic layout.
FORMATS = LAYOUTS + ROW_FILE_TYPES
# slime's `Sample.Status` values by the leaf turn's finish reason (slime reads sglang's `finish_reason.type`: length
# -> truncated, abort -> aborted, stop -> completed); tool_calls and every other reason end a turn normally.
SLIME_STATUS = {"length": "truncated", "abort": "aborted"}


class ExportError(RecordError):
    """A recording that cannot be exported in the asked layout (a tokenizer the slime text needs is missing)."""


@dataclass(frozen=True)
class ExportOptions:
    """What an export or a rows call asks beyond the layout (see `records/rollout_groups`)."""

    calls: list[str] | None = None
    group_size: int | None = None
    group_policy: str = "refuse"
    dedupe_shared_turns: bool = False
    # slime's --mask-offpolicy-in-partial-rollout (slime/utils/arguments.py, its Sample's loss mask in types.py): the
    # sampled tokens of an older weight version than the row's newest train nothing.
    mask_offpolicy: bool = False


def parse_calls(value: str | None) -> list[str] | None:
    """`--calls main,compaction,subagent` (the `calls` query of the control API); None or empty: every call."""
    if not value:
        return None
    calls = [part.strip() for part in value.split(",") if part.strip()]
    unknown = sorted(set(calls) - set(CALLS))
    if unknown:
        raise ValueError(f"unknown call(s) {', '.join(unknown)}; choose from: {', '.join(CALLS)}")
    return calls


def _head(row: PlacedRow) -> dict[str, Any]:
    branch = row.branch
    leaf = branch.path[-1]
    return {
        "session_id": leaf.session_id,
        "leaf_turn_id": leaf.turn_id,
        "turn_ids": [t.turn_id for t in branch.path],
        "episode": branch.episode,
        "segment": branch.segment,
        "call": leaf.call,
        "group": row.group,
        "group_index": row.group_index,
        "rollout_id": row.rollout_id,
        "index": row.index,
    }


def _tail(row: PlacedRow) -> dict[str, Any]:
    branch = row.branch
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
        "padded": row.padded,
    }


def routes_columns(branch: Branch, name: str) -> dict[str, Any]:
    """The row's MoE routes, where its session recorded them: `name` holds an `.npy` file (`numpy.load` reads it) of
    shape `(len(ids) - 1, layers, topk)`, row p the experts position p of the ids went to (the last token has none,
    as the engines give them, and slime's `rollout_routed_experts` and verl's `routed_experts` take them); null, with
    `routed_experts_missing` saying why, when the record does not hold them all. Both null: routes were not asked."""
    routes = branch.routes()
    if routes is None:
        return {name: None, "routed_experts_missing": None}
    if not routes.complete:
        why = "; ".join(routes.missing) or "the record stops early"
        said = f"routes of {routes.through} of {routes.positions} positions: {why}"
        return {name: None, "routed_experts_missing": said}
    return {name: npy_bytes(routes.array), "routed_experts_missing": None}


def npy_bytes(array: Any) -> bytes:
    import numpy as np

    sink = io.BytesIO()
    np.save(sink, array, allow_pickle=False)
    return sink.getvalue()


def generic_row(row: PlacedRow) -> dict[str, Any]:
    branch = row.branch
    return {
        **_head(row),
        "input_ids": branch.ids,
        "loss_mask": branch.mask,
        "rollout_logprobs": branch.logprobs,
        "rollout_weight_versions": branch.versions,
        "messages": json.dumps(branch.messages, ensure_ascii=False),
        "finish_reasons": [t.finish_reason for t in branch.path],
        **routes_columns(branch, "routed_experts"),
        "images": images_column(branch),
        **_tail(row),
    }


def verl_num_turns(path: list[TurnRecord]) -> int:
    """verl's `num_turns` (user + assistant turns + 1 in its tool agent loop): the first prompt, each assistant
    turn, and each batch of messages (tool results, a user turn) a later turn appended."""
    appended = sum(1 for t in path[1:] if t.appended_messages or t.appended_keys)
    return 1 + len(path) + appended


def verl_row(row: PlacedRow) -> dict[str, Any]:
    branch = row.branch
    cut = branch.prompt_len
    responses = branch.ids[cut:]
    reward = branch.notes.reward
    # The reward on the last response token, as verl's agent loop puts it; a row with no response token has nowhere
    # to put it (`trainers/verl_batch` places it on the first padding position, where only the sum reads it).
    rm_scores = None if reward is None else [0.0] * len(responses)
    if rm_scores:
        rm_scores[-1] = reward
    return {
        **_head(row),
        "uid": row.group,  # verl's GRPO group key
        "prompts": branch.ids[:cut],
        "responses": responses,
        "response_mask": branch.mask[cut:],
        "input_ids": branch.ids,
        "rollout_log_probs": branch.logprobs[cut:],
        "rollout_weight_versions": branch.versions[cut:],
        "rm_scores": rm_scores,
        "reward_score": reward,
        "__num_turns__": verl_num_turns(branch.path),
        "finish_reasons": [t.finish_reason for t in branch.path],
        **routes_columns(branch, "routed_experts"),
        "multi_modal_data": media_column(branch),
        **_tail(row),
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


def slime_row(row: PlacedRow) -> dict[str, Any]:
    branch = row.branch
    cut = branch.prompt_len
    leaf = branch.path[-1]
    decode = _decoder(leaf.tokenizer.name)
    return {
        **_head(row),
        "prompt": decode(branch.ids[:cut]),
        "tokens": branch.ids,
        "response": decode(branch.ids[cut:]),
        "response_length": len(branch.ids) - cut,
        "loss_mask": branch.mask[cut:],
        "rollout_log_probs": branch.logprobs[cut:],
        "status": SLIME_STATUS.get(leaf.finish_reason or "", "completed"),
        **routes_columns(branch, "rollout_routed_experts"),
        "multimodal_inputs": media_column(branch),
        # slime appends one `meta_info.weight_version` per generate call (`sglang_rollout.py`): a turn resumed across a
        # weight update made one call per attempt, each answered with the version current at its end.
        **_tail(row),
        "weight_versions": [version for turn in branch.path for version in attempt_versions(turn)],
    }


def attempt_versions(turn: TurnRecord) -> list[str | None]:
    """The weight version each engine request of the turn ended under (one for a turn never cut)."""
    if turn.resumed is None:
        return [turn.weight_version]
    versions = turn.token_weight_versions()
    ends = [*turn.resumed.cuts, len(versions)]
    return [versions[end - 1] if end else None for end in ends]


ROW_MAKERS: dict[str, Callable[[PlacedRow], dict[str, Any]]] = {
    "generic": generic_row,
    "verl": verl_row,
    "slime": slime_row,
}


def session_rows(session_file: SessionFile, layout: str, calls: list[str] | None = None) -> list[dict[str, Any]]:
    """The rows of one session's segments (of `calls` only, None: all) in `layout` (one of `LAYOUTS`)."""
    return rows_of([session_file], layout, ExportOptions(calls=calls))[0]


def rows_of(
    files: list[SessionFile], layout: str, options: ExportOptions = ExportOptions()
) -> tuple[list[dict[str, Any]], Arrangement]:
    """The rows of every segment of every episode of `files` in `layout`, grouped and numbered across them all, and
    the arrangement that placed them (its groups, sizes, shared turns)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of: {', '.join(LAYOUTS)}")
    arrangement = arrange(
        branches(files),
        calls=options.calls,
        group_size=options.group_size,
        policy=options.group_policy,
        dedupe_shared_turns=options.dedupe_shared_turns,
    )
    if layout == "verl-dataset":
        return verl_dataset_rows(arrangement), arrangement
    if options.mask_offpolicy:
        for position, row in enumerate(arrangement.rows):
            arrangement.rows[position] = dataclasses.replace(row, branch=row.branch.masked_offpolicy())
    make = ROW_MAKERS[layout]
    return [make(row) for row in arrangement.rows], arrangement


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def verl_dataset_rows(arrangement: Arrangement) -> list[dict[str, Any]]:
    """verl's dataset rows (`RLHFDataset`: `prompt`, `data_source`, `reward_model`, `extra_info`), one per group: the
    first request of the group's first episode, for a trainer that samples the prompt again. `prompt` holds each
    message's role and text; the exact messages and tools are in `extra_info` as JSON. `data_source` and the
    rule's `ground_truth` come from the episode's metadata when the driver gave them."""
    out: list[dict[str, Any]] = []
    by_group: dict[int, list[PlacedRow]] = {}
    for placed in arrangement.rows:
        if not placed.padded:
            by_group.setdefault(placed.group_index, []).append(placed)
    for report in arrangement.groups:
        if report.group_index is None:
            continue
        rows = by_group[report.group_index]
        first = min(rows, key=lambda row: (row.rollout_id, row.branch.segment)).branch
        turn = first.path[0]
        if turn.appended_messages is None or turn.parent_turn_id is not None:
            raise ExportError(
                f"group {report.group!r}: its first request is not in the record as messages (recorded without "
                "message text, or a continued segment); the verl-dataset layout needs it whole"
            )
        messages = turn.appended_messages
        metadata = first.notes.metadata or {}
        rewards = [row.branch.notes.reward for row in rows if row.branch.notes.reward is not None]
        out.append(
            {
                "prompt": [{"role": str(m.get("role", "")), "content": _text_of(m.get("content"))} for m in messages],
                "data_source": str(metadata.get("data_source", "tito")),
                "reward_model": {"style": "rule", "ground_truth": _text_of(metadata.get("ground_truth", ""))},
                "extra_info": {
                    "index": report.group_index,
                    "group": report.group,
                    "episodes": report.episodes,
                    "rows": report.rows,
                    "reward_mean": sum(rewards) / len(rewards) if rewards else None,
                    "split": str(metadata.get("split", "train")),
                    "messages_json": json.dumps(messages, ensure_ascii=False),
                    "tools_json": json.dumps(turn.tools, ensure_ascii=False),  # a first turn's line has its tools
                },
            }
        )
    return out


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
    # A row's images (`row_images`): the generic layout's with their place; verl's and slime's raw media.
    numbers = [(name, pa.int64()) for name in ("width", "height", "offset", "length")]
    image = pa.struct([("sha256", pa.string()), ("format", pa.string()), *numbers, ("bytes", pa.binary())])
    media = pa.struct([("images", pa.list_(pa.binary()))])
    head = [
        ("session_id", pa.string()),
        ("leaf_turn_id", pa.int64()),
        ("turn_ids", ids),
        ("episode", pa.string()),
        ("segment", pa.int64()),
        ("call", pa.string()),
        ("group", pa.string()),
        ("group_index", pa.int64()),
        ("rollout_id", pa.int64()),
        ("index", pa.int64()),
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
        ("padded", pa.bool_()),
    ]
    if layout == "verl-dataset":
        return pa.schema(
            [
                ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
                ("data_source", pa.string()),
                ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
                (
                    "extra_info",
                    pa.struct(
                        [
                            ("index", pa.int64()),
                            ("group", pa.string()),
                            ("episodes", pa.int64()),
                            ("rows", pa.int64()),
                            ("reward_mean", pa.float64()),
                            ("split", pa.string()),
                            ("messages_json", pa.string()),
                            ("tools_json", pa.string()),
                        ]
                    ),
                ),
            ]
        )
    body = {
        "generic": [
            ("input_ids", ids),
            ("loss_mask", mask),
            ("rollout_logprobs", floats),
            ("rollout_weight_versions", strings),
            ("messages", pa.string()),
            ("finish_reasons", strings),
            ("routed_experts", pa.binary()),
            ("routed_experts_missing", pa.string()),
            ("images", pa.list_(image)),
        ],
        "verl": [
            ("uid", pa.string()),
            ("prompts", ids),
            ("responses", ids),
            ("response_mask", mask),
            ("input_ids", ids),
            ("rollout_log_probs", floats),
            ("rollout_weight_versions", strings),
            ("rm_scores", floats),
            ("reward_score", pa.float64()),
            ("__num_turns__", pa.int32()),
            ("finish_reasons", strings),
            ("routed_experts", pa.binary()),
            ("routed_experts_missing", pa.string()),
            ("multi_modal_data", media),
        ],
        "slime": [
            ("prompt", pa.string()),
            ("tokens", ids),
            ("response", pa.string()),
            ("response_length", pa.int64()),
            ("loss_mask", mask),
            ("rollout_log_probs", floats),
            ("status", pa.string()),
            ("rollout_routed_experts", pa.binary()),
            ("routed_experts_missing", pa.string()),
            ("multimodal_inputs", media),
        ],
    }[layout]
    return pa.schema(head + body + tail)


def encode_rows(rows: list[dict[str, Any]], layout: str, file_type: str) -> bytes:
    """The exact bytes `export` writes for `rows` of `layout`: Parquet (one fixed schema per layout, no timestamps:
    equal rows give equal bytes) or JSON Lines (one strict-JSON object per row, columns in schema order)."""
    if file_type not in ROW_FILE_TYPES:
        raise ValueError(f"unknown file type {file_type!r}; choose one of: {', '.join(ROW_FILE_TYPES)}")
    columns = schema(layout).names  # also refuses an unknown layout
    for row in rows:
        if list(row) != columns:
            raise ValueError(f"a row does not have the {layout} columns: {sorted(set(row) ^ set(columns))}")
    if file_type == "jsonl":  # bytes (an .npy of routes) as base64 text, as vLLM sends routes
        lines = (json.dumps(row, ensure_ascii=False, allow_nan=False, default=_base64) + "\n" for row in rows)
        return "".join(lines).encode("utf-8")
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema(layout)), sink)
    return sink.getvalue()


def _base64(value: Any) -> str:
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    raise TypeError(f"{type(value).__name__} is not JSON")


def resolve_format(fmt: str, file_type: str | None = None) -> tuple[str, str]:
    """(layout, file type) from `--format` and `--to`: `parquet`/`jsonl` as a format is the generic layout; `pt`
    (slime's rollout files) only for the slime layout."""
    if fmt in ROW_FILE_TYPES:
        if file_type not in (None, fmt):
            raise ValueError(f"--format {fmt} is the generic layout as {fmt}; it cannot be written as {file_type}")
        return "generic", fmt
    if fmt not in LAYOUTS:
        raise ValueError(f"unknown format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    if file_type == "pt" and fmt != "slime":
        raise ValueError("--to pt writes slime's rollout files: only with --format slime")
    return fmt, file_type or "parquet"


def read_files(record_dir: Path, sessions: list[str] | None = None, progress: Any = None) -> list[SessionFile]:
    """The session files of `record_dir` (or of the named `sessions` only, each once, in the order named)."""
    if not record_dir.is_dir():
        raise RecordError(f"{record_dir} is not a directory")
    files: list[SessionFile] = []
    if sessions is not None:
        if not sessions:
            raise RecordError("the selection names no session")  # never read as "every session"
        for session_id in dict.fromkeys(sessions):
            found = read_session(record_dir, session_id)
            if found is None:
                raise RecordError(f"no session {session_id!r} in {record_dir}")
            files.append(found)
            if progress is not None:
                progress()
        return files
    for session_file in iter_session_files(record_dir):
        files.append(session_file)
        if progress is not None:
            progress()
    return files
