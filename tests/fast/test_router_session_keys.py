"""The session key an engine router reads (`tito_router`): every backend call of a turn carries the proxy's own session
id under the router's header, whatever the agent sent there, so a sticky policy keeps a session on one engine. What
really crossed the wire is read from a tap between the proxy and the backend. The real vllm-router in front of three
engines is tests/full/test_engine_routers.py."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from support.basics import tokenizer_path
from support.proxy_harness import Mitmdump, post
from support.upstream_tap import UpstreamTap

from tito_addon.backends.upstream_headers import router_digest
from tito_addon.records.record_reader import iter_session_files
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread
from tito_addon.replicas.vllm_replica import VllmReplicaConfig, VllmReplicaThread

QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


def replica_of(kind: str):
    if kind == "vllm":
        return VllmReplicaThread(VllmReplicaConfig(tokenizer=tokenizer_path("qwen3")))
    return ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3")))


@pytest.fixture(scope="module", params=["vllm", "sglang"])
def stack(request, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(f"router-{kind}")
    options = {"tito_backend_kind": kind, "tito_router": "vllm-router"}
    with replica_of(kind) as replica, UpstreamTap(replica.url) as tap:
        with Mitmdump(
            tap.url, tokenizer=tokenizer_path("qwen3"), record_dir=root / "rec", cwd=root, options=options
        ) as proxy:
            yield kind, tap, proxy


def keys_sent(tap: UpstreamTap, since: int) -> list[str | None]:
    """The router key of every POST the backend got after call `since` (the turns' calls; GETs are the facts)."""
    return [call["headers"].get("x-session-id") for call in tap.calls[since:] if call["method"] == "POST"]


def recorded_sessions(record_dir: Path) -> set[str]:
    return {f.turns[0].session_id for f in iter_session_files(record_dir) if f.turns}


def two_turns(client: openai.OpenAI, *, stream: bool) -> None:
    messages = list(QUESTION)
    for _ in range(2):
        if stream:
            with client.chat.completions.stream(model="m", messages=messages) as events:
                for _ in events:
                    pass
                message = events.get_final_completion().choices[0].message
        else:
            message = client.chat.completions.create(model="m", messages=messages).choices[0].message
        messages += [message.model_dump(exclude_none=True), {"role": "user", "content": "And tomorrow?"}]


@pytest.mark.parametrize("stream", [False, True])
def test_every_backend_call_carries_the_session_id_as_the_routers_key(stack, stream: bool) -> None:
    kind, tap, proxy = stack
    since = len(tap.calls)
    session = f"alpha-{kind}-{stream}"
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-x", default_headers={"x-session-id": session})
    two_turns(client, stream=stream)
    sent = keys_sent(tap, since)
    # vLLM: render, generate and derender per turn (a streamed one derenders per chunk batch); sglang: one chat call
    assert len(sent) >= (6 if kind == "vllm" else 2) and set(sent) == {session}, sent


def test_the_proxys_session_id_overrides_what_the_agent_sends_under_the_key(stack) -> None:
    """A driver names the session in the base URL; the agent's own X-Session-ID (opencode sends its own) must not
    reach the router, or the router would key the driver's episode by the agent's id."""
    kind, tap, proxy = stack
    since = len(tap.calls)
    client = openai.OpenAI(
        base_url=proxy.url + f"/sessions/driver-{kind}/v1",
        api_key="sk-x",
        default_headers={"X-Session-ID": "agent-own"},
    )
    two_turns(client, stream=False)
    assert set(keys_sent(tap, since)) == {f"driver-{kind}"}


def test_a_name_of_other_than_printable_ascii_goes_as_its_digest(stack) -> None:
    """Header values are ASCII to a router (vllm-router reads them as visible ASCII): a session named `équipe/7 …`
    is keyed by a digest of its name, the same on every call, and its turns are served."""
    kind, tap, proxy = stack
    since = len(tap.calls)
    client = openai.OpenAI(base_url=proxy.url + f"/sessions/%C3%A9quipe%2F7%20{kind}/v1", api_key="sk-x")
    two_turns(client, stream=False)
    (key,) = set(keys_sent(tap, since))
    assert key == router_digest(f"équipe/7 {kind}") and key.isascii() and key.startswith("sid-")


def test_a_session_without_a_name_is_keyed_by_the_id_the_proxy_gave_it(stack) -> None:
    kind, tap, proxy = stack
    since = len(tap.calls)
    before = recorded_sessions(proxy.record_dir)
    reply = post(proxy.url + "/v1/chat/completions", json={"model": "m", "messages": QUESTION, "max_tokens": 8})
    assert reply.status_code == 200, reply.text
    (automatic,) = recorded_sessions(proxy.record_dir) - before
    assert set(keys_sent(tap, since)) == {automatic}


def test_without_a_router_no_session_key_reaches_the_backend(tmp_path: Path) -> None:
    with (
        VllmReplicaThread(VllmReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as replica,
        UpstreamTap(replica.url) as tap,
    ):
        options = {"tito_backend_kind": "vllm"}
        with Mitmdump(
            tap.url, tokenizer=tokenizer_path("qwen3"), record_dir=tmp_path / "rec", cwd=tmp_path, options=options
        ) as proxy:
            client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-x", default_headers={"x-session-id": "s"})
            two_turns(client, stream=False)
    assert keys_sent(tap, 0) == [None] * 6


def test_an_unknown_router_refuses_to_start(tmp_path: Path) -> None:
    proxy = Mitmdump("http://127.0.0.1:9", tokenizer=tokenizer_path("qwen3"), record_dir=tmp_path / "rec",
                     cwd=tmp_path, options={"tito_router": "nginx"})  # fmt: skip
    returncode, output = proxy.run_to_exit()
    assert returncode != 0 and "unknown router 'nginx'" in output and "vllm-router" in output, output[-3000:]


def test_smg_keys_sessions_by_its_own_header(tmp_path: Path) -> None:
    """`tito_router=smg`: the sglang model gateway's sticky policies read `X-SMG-Routing-Key`; every call carries the
    proxy's session id there, and nothing under vllm-router's header."""
    with replica_of("sglang") as replica, UpstreamTap(replica.url) as tap:
        options = {"tito_backend_kind": "sglang", "tito_router": "smg"}
        with Mitmdump(
            tap.url, tokenizer=tokenizer_path("qwen3"), record_dir=tmp_path / "rec", cwd=tmp_path, options=options
        ) as proxy:
            client = openai.OpenAI(base_url=proxy.url + "/sessions/gw/v1", api_key="sk-x")
            two_turns(client, stream=True)
    posts = [call["headers"] for call in tap.calls if call["method"] == "POST"]
    assert len(posts) >= 2 and {h.get("x-smg-routing-key") for h in posts} == {"gw"}
    assert all("x-session-id" not in h for h in posts)
