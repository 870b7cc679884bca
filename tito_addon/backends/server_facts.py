"""What each backend server says of itself (its version, its context length), asked once per backend URL and kept
for the proxy's life.

A fresh proxy's first turns arrive together: they share one question to the server (one probe in flight per
URL) instead of each asking. What a probe returns is kept, an "unknown" answer included (each kind's probe decides
what it answers when the server does not say); a probe that raises keeps nothing, so the turns that waited on it
get its error and the next turn asks again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tito_addon.backends.upstream_client import UpstreamClient
from tito_addon.tito_errors import TitoError

logger = logging.getLogger(__name__)


class ServerFacts[V]:
    def __init__(self, probe: Callable[[str, dict[str, str]], Awaitable[V]]) -> None:
        self._probe = probe
        self._known: dict[str, V] = {}
        self._asking: dict[str, asyncio.Future[V]] = {}

    async def get(self, base_url: str, headers: dict[str, str]) -> V:
        """What the server at `base_url` says; probed (with the first asker's `headers`) until an answer is kept."""
        try:
            return self._known[base_url]
        except KeyError:  # only until the first probe of this backend ends
            pass
        asking = self._asking.get(base_url)
        if asking is None:
            asking = self._asking[base_url] = asyncio.ensure_future(self._ask(base_url, headers))
            asking.add_done_callback(lambda _: self._asking.pop(base_url, None))
        return await asyncio.shield(asking)  # one waiter cancelled (its agent hung up) leaves the others theirs

    async def _ask(self, base_url: str, headers: dict[str, str]) -> V:
        found = await self._probe(base_url, headers)
        self._known[base_url] = found
        return found


@dataclass(frozen=True)
class ServedModels:
    """What a server's `/v1/models` says: the names it serves and its context length (None where it does not say)."""

    names: tuple[str, ...] = ()
    context_length: int | None = None

    def name_for(self, asked: str | None) -> str | None:
        """The served name a request for `asked` runs under: `asked` itself when served (or when the server named
        nothing), else the server's first model, so a side call under another model name (an agent's small-model
        alias) reaches the one model there is."""
        return asked if not self.names or asked in self.names else self.names[0]


async def ask_served_models(client: UpstreamClient, base_url: str, headers: dict[str, str]) -> ServedModels:
    """The server's models and context length (`max_model_len` of its first card: sglang and vLLM both say it at
    `/v1/models`; sglang's `/get_model_info` does not). Kept when the server answers without saying; a server that
    does not answer at all raises (nothing is kept, the next turn asks again)."""
    response = await client.get(base_url + "/v1/models", headers)
    try:
        cards = response.json().get("data") if response.status == 200 else None
    except (ValueError, AttributeError):
        cards = None
    cards = [card for card in cards if isinstance(card, dict)] if isinstance(cards, list) else []
    names = tuple(card["id"] for card in cards if isinstance(card.get("id"), str))
    found = cards[0].get("max_model_len") if cards else None
    if isinstance(found, bool) or not isinstance(found, int) or found <= 0:
        found = await workers_context_length(client, base_url, headers)
    if found is None:
        logger.warning("tito: %s did not say its context length; completion budgets go as asked", base_url)
        return ServedModels(names)
    logger.info("tito: %s serves %s with a context of %d tokens", base_url, ", ".join(names) or "a model", found)
    return ServedModels(names, found)


async def workers_context_length(client: UpstreamClient, base_url: str, headers: dict[str, str]) -> int | None:
    """The context length a router's engines have, where the router writes `/v1/models` itself (smg's lists no
    `max_model_len`) and lists its engines at `/workers` (smg: each engine's `models[].context_length`, or its
    `labels.max_model_len`): the least of them, so a budget fits every engine a turn may run on. None where there is
    no such list (an engine itself answers 404)."""
    try:
        response = await client.get(base_url + "/workers", headers)
        workers = response.json().get("workers") if response.status == 200 else None
    except (TitoError, ValueError, AttributeError):
        return None
    lengths = []
    for worker in workers if isinstance(workers, list) else []:
        if not isinstance(worker, dict):
            continue
        models, labels = worker.get("models"), worker.get("labels")
        said = [model.get("context_length") for model in models or () if isinstance(model, dict)]
        said.append(labels.get("max_model_len") if isinstance(labels, dict) else None)
        for value in said:
            if isinstance(value, str) and value.isdigit():
                value = int(value)
            if type(value) is int and value > 0:
                lengths.append(value)
                break
    return min(lengths) if lengths else None
