"""Token exactness, read from the records: every recorded turn's ids are what the replica received and generated, for
any agent API (the Anthropic, Responses and Gemini tests, the episode tests and the real CLIs' stack)."""

from __future__ import annotations

from pathlib import Path

from tito_addon.records.record_reader import iter_session_files
from tito_addon.replicas.sglang_replica import ReplicaThread


def recorded(record_dir: Path) -> list:
    return [turn for f in iter_session_files(record_dir) for turn in f.turns]


def assert_token_exact(record_dir: Path, replica: ReplicaThread, hung_up: int = 0) -> list:
    """Every recorded turn's ids are what the replica received and generated, and each later turn of a branch
    starts with its parent's prompt + completion. `hung_up`: how many requests the agent hung up on mid-answer (the
    proxy logged each; it records none): at most that many of the replica's answers, and only its last ones, are
    unrecorded."""
    answered = replica.generated()
    generated: dict[tuple[int, ...], list[list[int]]] = {}  # a prompt sent twice may be answered twice
    for g in answered:
        generated.setdefault(tuple(g["prompt_ids"]), []).append(g["completion_ids"])
    turns, recorded = [], set()
    for session_file in iter_session_files(record_dir):
        ids = session_file.full_ids()
        ends: dict[int, list[int]] = {}
        for turn in session_file.turns:
            prompt, completion = ids[turn.turn_id]
            assert completion in generated[tuple(prompt)]
            if turn.parent_turn_id is not None:
                assert prompt[: len(ends[turn.parent_turn_id])] == ends[turn.parent_turn_id]
            ends[turn.turn_id] = prompt + completion
            turns.append(turn)
            recorded.add((tuple(prompt), tuple(completion)))
    unrecorded = [
        i for i, g in enumerate(answered) if (tuple(g["prompt_ids"]), tuple(g["completion_ids"])) not in recorded
    ]
    assert len(turns) + len(unrecorded) == len(answered)
    assert len(unrecorded) <= hung_up and unrecorded == list(range(len(answered) - len(unrecorded), len(answered)))
    return turns
