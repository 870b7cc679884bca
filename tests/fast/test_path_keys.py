"""Path digests decide what the tree walk decides: on generated session trees (branches, identical retries,
reasoning kept, dropped or changed), `deepest_by_path` with one round of index lookups finds the same turn as
`MemoryTree.locate`'s walk, with the same ambiguity."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from tito_addon.sessions.path_keys import ROOT, deepest_by_path, extend, node_digest, running
from tito_addon.sessions.session_tree import MemoryTree, TurnNode
from tito_addon.sessions.turn_entity import Turn


def key() -> bytes:
    return os.urandom(16)


def test_running_digests_are_prefix_digests() -> None:
    keys = [key() for _ in range(5)]
    steps = running(keys)
    assert steps[0] == ROOT and len(steps) == 6
    assert steps[3] == extend(ROOT, keys[:3]) == extend(extend(ROOT, keys[:1]), keys[1:3])
    assert len(set(steps)) == 6


@st.composite
def trees_and_queries(draw):
    store = MemoryTree()
    session = store.new_session("s")
    nodes: list[TurnNode] = []
    paths: dict[int, tuple[list[bytes], list[str], list[str | None]]] = {}  # id(node) -> its path
    for _ in range(draw(st.integers(1, 14))):
        parent = draw(st.sampled_from([None, *nodes])) if nodes else None
        if nodes and draw(st.booleans()) and draw(st.booleans()):
            # an identical retry: the same segment again under the same parent
            twin = draw(st.sampled_from(nodes))
            parent, segment, reasoning = twin.parent, list(twin.turn.segment_keys), twin.turn.reasoning
        else:
            segment = [key() for _ in range(draw(st.integers(1, 3)))]
            reasoning = draw(st.sampled_from([None, "think", "other"]))
        base = paths[id(parent)] if parent is not None else ([], [], [])
        end = len(base[0]) + len(segment)
        node = store.commit(session, parent, Turn(end, tuple(segment), reasoning, [1], [2], "stop"))
        nodes.append(node)
        roles = base[1] + ["user"] * (len(segment) - 1) + ["assistant"]
        paths[id(node)] = (base[0] + segment, roles, base[2] + [None] * (len(segment) - 1) + [reasoning])
    queries = []
    for _ in range(draw(st.integers(1, 6))):
        keys, roles, reasonings = (list(part) for part in paths[id(draw(st.sampled_from(nodes)))])
        cut = draw(st.integers(0, len(keys)))
        keys, roles, reasonings = keys[:cut], roles[:cut], reasonings[:cut]
        for position in range(len(keys)):  # what clients do to reasoning when they echo it
            if roles[position] == "assistant":
                reasonings[position] = draw(st.sampled_from([reasonings[position], None, "changed"]))
        if keys and draw(st.booleans()):
            keys[draw(st.integers(0, len(keys) - 1))] = key()  # an edit
        for _ in range(draw(st.integers(0, 2))):
            keys.append(key())
            roles.append(draw(st.sampled_from(["user", "tool", "assistant"])))
            reasonings.append(None)
        queries.append((keys, roles, reasonings))
    return store, session, nodes, queries


@settings(max_examples=300, deadline=None, database=None)
@given(case=trees_and_queries())
def test_path_lookup_finds_what_the_walk_finds(case) -> None:
    store, session, nodes, queries = case
    index: dict[bytes, list[TurnNode]] = {}
    for node in nodes:
        index.setdefault(node_digest(node), []).append(node)
    asked: list[int] = []

    def lookup(digests: list[bytes]) -> list[list[TurnNode]]:
        asked.append(len(digests))
        return [index.get(digest, []) for digest in digests]

    for keys, roles, reasonings in queries:
        walked = store.locate("s", keys, reasonings)
        found, ambiguous = deepest_by_path(keys, reasonings, roles, lookup)
        assert found is walked.parent
        assert ambiguous == walked.ambiguous
    assert len(asked) == len(queries), "one round of lookups per request"
