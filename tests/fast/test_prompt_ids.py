"""The prompt's ids as a list and as ready JSON text: both forms agree, from the tree or from the cache, and
the cache keeps to its byte budget."""

from __future__ import annotations

import json

from tito_addon.engine.prompt_ids import MAX_PIECES, EncodedPrefixes, PromptIds
from tito_addon.sessions.session_tree import MemoryTree
from tito_addon.sessions.turn_entity import Turn


def chain(store: MemoryTree, turns: int, prefixes: EncodedPrefixes | None, empty_every: int = 0):
    session = store.new_session("s")
    parent = None
    nodes = []
    for t in range(turns):
        added = [] if empty_every and t % empty_every == 1 else list(range(1000 * t, 1000 * t + 50))
        completion = [7, 8, 9 + t]
        prompt = PromptIds(parent, added, prefixes)
        assert json.loads(b"[" + prompt.json + b"]") == prompt.ids, f"turn {t}: text and list disagree"
        assert len(prompt) == len(prompt.ids)
        node = store.commit(
            session, parent, Turn(2 * (t + 1), (("user", str(t), None),), None, added, completion, "stop")
        )
        prompt.remember(node, completion)
        nodes.append(node)
        parent = node
    return nodes


def test_cached_text_equals_a_fresh_encoding_of_the_tree() -> None:
    prefixes = EncodedPrefixes()
    nodes = chain(MemoryTree(), 6, prefixes)
    assert prefixes.hits == 5 and prefixes.misses == 0  # every continuation extended the cached text
    for node in nodes:
        assert json.loads(b"[" + b"".join(prefixes.get(node)) + b"]") == node.full_ids()


def test_a_long_session_is_sent_in_few_pieces_that_always_join_to_its_ids() -> None:
    prefixes = EncodedPrefixes()
    nodes = chain(MemoryTree(), 3 * MAX_PIECES + 5, prefixes, empty_every=7)  # some turns add no prompt ids
    counts = []
    for node in nodes:
        pieces = prefixes.get(node)
        counts.append(len(pieces))
        assert all(pieces) and not pieces[0].startswith(b",") and all(p.startswith(b",") for p in pieces[1:])
        assert json.loads(b"[" + b"".join(pieces) + b"]") == node.full_ids()
    assert max(counts) <= MAX_PIECES and counts[-1] < len(nodes), "pieces are joined before they grow past the cap"
    assert max(counts) >= MAX_PIECES - 1, "a turn extends its parent's pieces instead of copying them"


def test_without_a_cache_or_after_eviction_the_text_is_rebuilt_from_the_tree() -> None:
    nodes = chain(MemoryTree(), 4, None)
    tiny = EncodedPrefixes(budget_bytes=600)
    extra = PromptIds(nodes[-1], [1, 2, 3], tiny)  # a miss: encoded from the tree
    assert json.loads(b"[" + extra.json + b"]") == nodes[-1].full_ids() + [1, 2, 3]
    for node in nodes:
        tiny.put(node, (json.dumps(node.full_ids())[1:-1].encode(),))
    assert tiny.used_bytes <= 600 and len(tiny) < len(nodes)
    assert tiny.get(nodes[0]) is None  # least recently used went first
    tiny.resize(0)
    assert tiny.used_bytes == 0 and len(tiny) == 0


def test_a_first_turn_has_no_leading_comma() -> None:
    assert PromptIds(None, [5, 6]).json == b"5,6"
    assert PromptIds(None, []).json == b""
