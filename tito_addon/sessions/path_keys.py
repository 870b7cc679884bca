"""Path digests: the deepest stored turn a request extends, found by lookups instead of a walk down the tree.

A turn's path digest is a chained digest of the message keys from the root of its session to the end of its own
segment. A request computes the running digest of its own keys; a stored turn it extends has the digest the
request reaches at that turn's end. So the deepest turn a request extends is found by asking an index (digest ->
turns) for the request's digests at its assistant positions, deepest first, and checking the reasoning of the
hit's chain: one round of lookups whatever the history's depth, which is what a session store shared by several
proxies (issue 13: Redis) needs, where a walk would cost a round trip per level. `deepest_by_path` decides
exactly what `MemoryTree.locate` decides (tested against it on generated trees).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence

from tito_addon.sessions.message_keys import MessageKey
from tito_addon.sessions.session_tree import TurnNode

PathDigest = bytes
ROOT = b"\0" * 16  # the digest of an empty path


def extend(digest: PathDigest, keys: Iterable[MessageKey]) -> PathDigest:
    """The digest of a path, extended by `keys` (chained, so a prefix's digest is a step on the way)."""
    for key in keys:
        digest = hashlib.blake2b(digest + key, digest_size=16).digest()
    return digest


def running(keys: Sequence[MessageKey]) -> list[PathDigest]:
    """`out[i]`: the digest of `keys[:i]` (so `out[0]` is the root's)."""
    out = [ROOT]
    for key in keys:
        out.append(extend(out[-1], (key,)))
    return out


def node_digest(node: TurnNode) -> PathDigest:
    chain = []
    current: TurnNode | None = node
    while current is not None:
        chain.append(current)
        current = current.parent
    digest = ROOT
    for step in reversed(chain):
        digest = extend(digest, step.turn.segment_keys)
    return digest


def chain_compatible(node: TurnNode, reasonings: Sequence[str | None]) -> bool:
    """Whether every turn on the node's chain accepts the request's reasoning at its messages."""
    current: TurnNode | None = node
    while current is not None:
        if not current.reasoning_compatible(reasonings, current.message_end - len(current.turn.segment_keys)):
            return False
        current = current.parent
    return True


def assistant_ends(roles: Sequence[str]) -> list[int]:
    """The positions where a stored turn can end: after each assistant message."""
    return [i + 1 for i, role in enumerate(roles) if role == "assistant"]


def deepest_by_path(
    keys: Sequence[MessageKey],
    reasonings: Sequence[str | None],
    roles: Sequence[str],
    lookup: Callable[[list[PathDigest]], list[list[TurnNode]]],
) -> tuple[TurnNode | None, bool]:
    """The deepest stored turn the request's messages extend (the oldest among equals, and whether there were
    several), asking `lookup` once for the turns at every position where a stored turn can end (after an
    assistant message)."""
    digests = running(keys)
    ends = assistant_ends(roles)
    return deepest_of(ends, lookup([digests[end] for end in ends]), reasonings)


def deepest_of(
    ends: Sequence[int], found: Sequence[Sequence[TurnNode]], reasonings: Sequence[str | None]
) -> tuple[TurnNode | None, bool]:
    """`deepest_by_path`'s choice among the turns `found` at each of `ends` (for callers that looked them up)."""
    for end, candidates in sorted(zip(ends, found, strict=True), key=lambda pair: -pair[0]):
        matches = [node for node in candidates if node.message_end == end and chain_compatible(node, reasonings)]
        if matches:
            best = min(matches, key=lambda node: (node.session.created, node.turn_id))
            return best, len(matches) > 1
    return None, False
