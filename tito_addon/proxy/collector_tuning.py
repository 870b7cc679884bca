"""Python's garbage collector, tuned for a proxy that keeps sessions and memos for hours.

With Python's defaults a proxy collects its youngest generation every 700 allocations, and every full collection
walks everything alive: at startup ~94k objects (mitmproxy, transformers, the tokenizer and its template), ~70 ms
a walk on the CI machine, which lands on whatever turn happens to be running. Under P2's load the collections
took ~12 % of the turn service's CPU. So: a larger youngest generation, and what exists once the addon is
configured is moved out of the collector's sight (`gc.freeze`); it is brought back before a new configuration,
so an engine it replaces can still be freed.
"""

from __future__ import annotations

import gc


def tune_collector(threshold: int) -> None:
    """`threshold` allocations between two young collections, and the objects alive now frozen (0: leave the
    collector as it is)."""
    if not threshold:
        return
    gc.set_threshold(threshold, *gc.get_threshold()[1:])
    gc.unfreeze()
    gc.collect()
    gc.freeze()
