"""Each backend's server version is asked once: concurrent first turns share one probe, its answer is kept (an
"unknown" one too), and a probe that raises keeps nothing, so the next turn asks again. Both kinds, on the
replicas behind a tap that sees every call, and on a client that fails on purpose."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from support.basics import cached_engine, tokenizer_path
from support.upstream_tap import UpstreamTap

from tito_addon.backends.backend_protocol import BackendTurn
from tito_addon.backends.server_facts import ServerFacts
from tito_addon.backends.sglang_backend import SglangBackend
from tito_addon.backends.upstream_client import UpstreamClient, UpstreamResponse
from tito_addon.backends.vllm_backend import VllmBackend
from tito_addon.canonical_chat import ChatRequest
from tito_addon.engine.prompt_ids import PromptIds
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread
from tito_addon.replicas.vllm_replica import VllmReplicaConfig, VllmReplicaThread
from tito_addon.tito_errors import UpstreamUnavailable

MODEL = "tiny-qwen3"
VERSION_PATHS = {"vllm": ("/version",), "sglang": ("/server_info", "/get_server_info")}


def turn_to(url: str, question: str) -> BackendTurn:
    body = {"model": MODEL, "messages": [{"role": "user", "content": question}]}
    request = ChatRequest.model_validate(body)
    prompt = cached_engine("qwen3").first_turn(request.messages, request.tools, {}).ids
    return BackendTurn(url, "/v1/chat/completions", body, PromptIds(None, list(prompt)), {})


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
async def test_concurrent_first_turns_to_a_fresh_backend_ask_its_version_once(kind: str) -> None:
    if kind == "vllm":
        replica: Any = VllmReplicaThread(VllmReplicaConfig(tokenizer=tokenizer_path("qwen3"), latency_s=0.05))
    else:
        replica = ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"), latency_s=0.05))
    with replica, UpstreamTap(replica.url) as tap:
        client = UpstreamClient()
        backend = VllmBackend(client) if kind == "vllm" else SglangBackend(client)
        try:
            first, second = await asyncio.gather(
                backend.run_turn(turn_to(tap.url, "Weather in Paris?")),
                backend.run_turn(turn_to(tap.url, "Weather in Rome?")),
            )
            asked = [c["path"] for c in tap.calls if c["path"] in VERSION_PATHS[kind]]
            assert asked == [VERSION_PATHS[kind][0]], "two concurrent turns shared one question"
            assert first.completion_ids and second.completion_ids
            await backend.run_turn(turn_to(tap.url, "And in Oslo?"))
            assert await backend.can_stream(tap.url, {})
        finally:
            await client.close()
        assert [c["path"] for c in tap.calls if c["path"] in VERSION_PATHS[kind]] == asked, "the answer was kept"


class FailingClient:
    """A backend client whose GET raises `error` (or answers 404), counting the calls."""

    def __init__(self, error: Exception | None) -> None:
        self.error = error
        self.gets: list[str] = []

    async def get(self, url: str, headers: dict[str, str]) -> UpstreamResponse:
        self.gets.append(url)
        await asyncio.sleep(0.01)
        if self.error is not None:
            raise self.error
        return UpstreamResponse(404, "application/json", b'{"detail": "Not Found"}')


@pytest.mark.parametrize("error", [None, ValueError("not JSON")])
async def test_a_server_that_does_not_say_its_version_is_asked_once(error: Exception | None) -> None:
    """Kept as unknown: vLLM then uses only the 0.24 wire features, sglang verifies the echo every turn."""
    vllm_client, sglang_client = FailingClient(error), FailingClient(error)
    vllm, sglang = VllmBackend(vllm_client), SglangBackend(sglang_client)
    for _ in range(2):
        found = await asyncio.gather(*(vllm.versions.get("http://v", {}) for _ in range(3)))
        assert all(v.major_minor is None and v.text is None for v in found)
        said = await asyncio.gather(*(sglang.servers.get("http://s", {}) for _ in range(3)))
        assert [server.version for server in said] == [None] * 3
    assert vllm_client.gets == ["http://v/version"]
    assert sglang_client.gets == ["http://s/server_info", "http://s/get_server_info"]


async def test_a_server_out_of_reach_is_not_taken_for_one_that_does_not_say() -> None:
    """A refused or reset probe (an engine down when the proxy first asks, one of a list or behind a router) keeps
    nothing: kept as unknown, vLLM would run on the 0.24 wire features for the proxy's life."""
    for make in (VllmBackend, SglangBackend):
        client = FailingClient(UpstreamUnavailable("refused"))
        backend = make(client)
        facts = backend.versions if isinstance(backend, VllmBackend) else backend.servers
        for asked in (1, 2):
            with pytest.raises(UpstreamUnavailable):
                await facts.get("http://b", {})
            assert len(client.gets) == asked, f"{make.__name__}: an unreachable server is asked again"
        client.error = None  # it is up: what it says (nothing, here) is kept from now on
        await facts.get("http://b", {})
        await facts.get("http://b", {})
        assert len(client.gets) == 2 + (1 if make is VllmBackend else 2)


async def test_a_probe_that_raises_keeps_nothing_and_the_next_turn_asks_again() -> None:
    """An error neither kind expects from a probe reaches every turn that waited on it and is not kept."""
    for make in (VllmBackend, SglangBackend):
        client = FailingClient(RuntimeError("boom"))
        backend = make(client)
        facts = backend.versions if isinstance(backend, VllmBackend) else backend.servers
        results = await asyncio.gather(*(facts.get("http://b", {}) for _ in range(3)), return_exceptions=True)
        assert all(isinstance(r, RuntimeError) for r in results) and len(client.gets) == 1
        with pytest.raises(RuntimeError):
            await facts.get("http://b", {})
        assert len(client.gets) == 2, f"{make.__name__}: a failed probe is asked again"


async def test_one_probe_per_url_shared_kept_and_not_cancelled_with_one_waiter() -> None:
    probes: list[str] = []
    release = asyncio.Event()

    async def probe(url: str, headers: dict[str, str]) -> str | None:
        probes.append(url)
        await release.wait()
        return None if url.endswith("unknown") else "1.0"

    versions: ServerFacts[str | None] = ServerFacts(probe)
    waiters = [asyncio.ensure_future(versions.get(url, {})) for url in ("http://a", "http://a", "http://unknown")]
    await asyncio.sleep(0)
    waiters[0].cancel()  # its agent hung up: the probe goes on for the other waiter
    release.set()
    assert await asyncio.gather(*waiters[1:]) == ["1.0", None]
    assert probes == ["http://a", "http://unknown"]
    assert (await versions.get("http://a", {}), await versions.get("http://unknown", {})) == ("1.0", None)
    assert probes == ["http://a", "http://unknown"]
