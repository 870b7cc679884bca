"""The addon shell in mitmproxy's own test harness: option validation, backend discovery, routing guards."""

from __future__ import annotations

import gc

import pytest
from mitmproxy import exceptions
from mitmproxy.proxy.mode_specs import ProxyMode
from mitmproxy.test import taddons, tflow, tutils
from support.basics import tokenizer_path

from tito_addon.backends.backend_routes import normalize_backend_url
from tito_addon.engine import tokenizer_loading
from tito_addon.proxy.capture_addon import TitoAddon
from tito_addon.proxy.session_addons import SessionListing


def configured(tctx, addon, **options):
    base = {"tito_tokenizer": tokenizer_path("qwen3"), "tito_model_family": "qwen3"}
    tctx.configure(addon, **{**base, **options})
    return addon


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"tito_backend_kind": "tgi"}, "unknown backend kind"),
        ({"tito_model_family": "llama9"}, "unknown model family"),
        ({"tito_append_roles": "tool,assistant"}, "assistant"),
        ({"tito_append_roles": ""}, "at least one role"),
        ({"tito_chat_template_kwargs": "[1]"}, "JSON object"),
        ({"tito_chat_template_kwargs": '{"chat_template": "x"}'}, "chat_template"),
        ({"tito_session_header": "bad header"}, "header"),
        ({"tito_upstream_timeout": 0}, "positive"),
        ({"tito_backend_url": "ftp://x"}, "http"),
        ({"tito_tokenizer": "/nonexistent/tokenizer-dir"}, "cannot load tokenizer"),
        ({"tito_model_family": "default"}, "tito_model_family=qwen3"),
        ({"tito_session_store": "localhost:6379"}, "tito_session_store: must be memory or a Redis URL"),
        ({"tito_session_store": "http://localhost:6379"}, "Redis URL"),
        ({"tito_session_store": "redis://"}, "Redis URL"),
        ({"tito_gc_threshold": -1}, "tito_gc_threshold"),
        ({"tito_message_memo_mb": -1}, "tito_message_memo_mb"),
    ],
)
def test_invalid_options_raise_options_error(options, needle) -> None:
    addon = TitoAddon()
    with taddons.context(addon) as tctx:
        with pytest.raises(exceptions.OptionsError, match=needle):
            configured(tctx, addon, **options)


async def test_without_a_tokenizer_chat_turns_are_refused_not_forwarded(caplog) -> None:
    addon = TitoAddon()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, tito_tokenizer="")
        assert "tito_tokenizer is required" in caplog.text
        flow = tflow.tflow(req=tutils.treq(method=b"POST", path=b"/v1/chat/completions", content=b"{}"))
        await addon.request(flow)
        assert flow.response is not None and flow.response.status_code == 503


def test_the_memos_and_the_collector_follow_their_options(monkeypatch) -> None:
    before = gc.get_threshold()
    monkeypatch.setattr(gc, "set_threshold", lambda *values: seen.append(values))
    monkeypatch.setattr(gc, "freeze", lambda: seen.append(("freeze",)))
    seen: list[tuple] = []
    addon = TitoAddon()
    with taddons.context(addon) as tctx:
        configured(tctx, addon, tito_message_memo_mb=3, tito_gc_threshold=12345)
        memos = [memo for api in addon.wiring.service.apis for memo in api.memos]  # each API's own
        assert {memo.budget_bytes for memo in memos} == {3 * 1024 * 1024}
        assert seen[-2:] == [(12345, *before[1:]), ("freeze",)], "the configured process is frozen out of its walks"
        seen.clear()
        configured(tctx, addon, tito_message_memo_mb=128, tito_gc_threshold=0)
        assert seen == [], "0 leaves the collector as it is"
        memos = [memo for api in addon.wiring.service.apis for memo in api.memos]
        assert {memo.budget_bytes for memo in memos} == {128 * 1024 * 1024}


def test_append_roles_are_normalised() -> None:
    addon = TitoAddon()
    with taddons.context(addon) as tctx:
        configured(tctx, addon, tito_append_roles="Tool, user,tool")
        assert addon.wiring.engine.append_roles == ("tool", "user")


@pytest.mark.parametrize(("family", "roles"), [("qwen3", ("tool", "user", "system")), ("mistral", ("tool", "user"))])
def test_auto_append_roles_are_what_the_family_can_append(family, roles) -> None:
    addon = TitoAddon()
    with taddons.context(addon) as tctx:
        configured(tctx, addon, tito_tokenizer=tokenizer_path(family), tito_model_family=family)
        assert addon.wiring.engine.append_roles == roles


def test_asking_a_family_for_a_role_it_refuses_fails_at_startup() -> None:
    addon = TitoAddon()
    with taddons.context(addon) as tctx:
        with pytest.raises(exceptions.OptionsError, match="cannot append system"):
            configured(tctx, addon, tito_tokenizer=tokenizer_path("mistral"), tito_model_family="mistral",
                       tito_append_roles="tool,user,system")  # fmt: skip


def test_trust_remote_code_stays_off_unless_enabled(monkeypatch) -> None:
    seen = []
    real = tokenizer_loading.load_tokenizer

    def spy(name, *, trust_remote_code):
        seen.append(trust_remote_code)
        return real(name, trust_remote_code=trust_remote_code)

    monkeypatch.setattr("tito_addon.proxy.turn_wiring.load_tokenizer", spy)
    addon = TitoAddon()
    with taddons.context(addon) as tctx:
        configured(tctx, addon)
        configured(tctx, addon, tito_trust_remote_code=True)
    assert seen == [False, True]


def chat_flow(mode: str, host: str = "10.1.2.3", port: int = 30000):
    flow = tflow.tflow(req=tutils.treq(method=b"POST", path=b"/v1/chat/completions", host=host, port=port))
    flow.client_conn.proxy_mode = ProxyMode.parse(mode)
    return flow


def test_backend_url_discovery(monkeypatch) -> None:
    for name in ("TITO_BACKEND_URL", "SGLANG_BASE_URL", "VLLM_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    addon = TitoAddon()
    with taddons.context(addon) as tctx:
        configured(tctx, addon)
        # Reverse mode: the reverse target (already the flow's target in the request hook).
        assert addon.backend_base_url(chat_flow("reverse:http://10.1.2.3:30000")) == "http://10.1.2.3:30000"
        # Regular mode: the environment, in order, else the request's own target.
        assert addon.backend_base_url(chat_flow("regular")) == "http://10.1.2.3:30000"
        monkeypatch.setenv("VLLM_BASE_URL", "http://vllm.local:8000/v1")
        assert addon.backend_base_url(chat_flow("regular")) == "http://vllm.local:8000"
        monkeypatch.setenv("SGLANG_BASE_URL", "sglang.local:30000")
        assert addon.backend_base_url(chat_flow("regular")) == "http://sglang.local:30000"
        monkeypatch.setenv("TITO_BACKEND_URL", "https://tito.local/")
        assert addon.backend_base_url(chat_flow("regular")) == "https://tito.local"
        # An explicit option beats everything.
        configured(tctx, addon, tito_backend_url="http://explicit:1234/v1/")
        assert addon.backend_base_url(chat_flow("reverse:http://10.1.2.3:30000")) == "http://explicit:1234"


def test_url_normalisation() -> None:
    assert normalize_backend_url(" 127.0.0.1:30000 ") == "http://127.0.0.1:30000"
    assert normalize_backend_url("http://h:1/prefix/v1/") == "http://h:1/prefix"
    with pytest.raises(ValueError):
        normalize_backend_url("ftp://h")


async def test_non_chat_flows_are_left_alone_and_session_prefixes_stripped() -> None:
    addon = TitoAddon()
    with taddons.context(addon) as tctx:
        configured(tctx, addon)
        models = tflow.tflow(req=tutils.treq(method=b"GET", path=b"/sessions/abc/v1/models"))
        await addon.request(models)
        assert models.response is None and models.request.path == "/v1/models"
        get_chat = tflow.tflow(req=tutils.treq(method=b"GET", path=b"/v1/chat/completions"))
        await addon.request(get_chat)
        assert get_chat.response is None
        done = tflow.tflow(req=tutils.treq(method=b"POST", path=b"/v1/chat/completions"), resp=True)
        before = done.response
        await addon.request(done)
        assert done.response is before


async def test_flows_that_mitmproxys_server_replay_answers_are_left_to_it(tmp_path) -> None:
    from mitmproxy import io
    from mitmproxy.addons.serverplayback import ServerPlayback

    addon, playback = TitoAddon(), ServerPlayback()
    recorded = tmp_path / "flows"
    with recorded.open("wb") as file:
        io.FlowWriter(file).add(tflow.tflow(resp=True))
    with taddons.context(addon, playback) as tctx:
        configured(tctx, addon)
        tctx.configure(playback, server_replay=[str(recorded)])
        left = tflow.tflow(req=tutils.treq(method=b"POST", path=b"/v1/chat/completions", content=b"{}"), live=True)
        await addon.request(left)
        assert left.response is None, "server replay answers it, not the addon"
        tctx.configure(playback, server_replay=[])
        served = tflow.tflow(req=tutils.treq(method=b"POST", path=b"/v1/chat/completions", content=b"{}"), live=True)
        await addon.request(served)
        assert served.response is not None and served.response.status_code == 400


async def test_an_unexpected_exception_is_answered_never_forwarded(monkeypatch) -> None:
    addon = TitoAddon()
    with taddons.context(addon) as tctx:
        configured(tctx, addon)

        async def boom(*args, **kwargs):
            raise RuntimeError("boom")

        monkeypatch.setattr(addon, "_serve", boom)
        flow = tflow.tflow(req=tutils.treq(method=b"POST", path=b"/v1/chat/completions", content=b"{}"))
        await addon.request(flow)
        assert flow.response is not None and flow.response.status_code == 500
        assert b"nothing was recorded" in flow.response.content


def test_sessions_command_lists_live_sessions() -> None:
    from tito_addon.canonical_chat import ChatMessage
    from tito_addon.sessions.message_keys import message_key
    from tito_addon.sessions.turn_entity import Turn

    addon = TitoAddon()
    listing = SessionListing(addon.wiring)
    with taddons.context(addon, listing) as tctx:
        configured(tctx, addon)
        user = ChatMessage(role="user", content="hi")
        reply = ChatMessage(role="assistant", content="hello")
        session = addon.wiring.memory.tree.new_session("listed-session")
        keys = (message_key(user), message_key(reply))
        addon.wiring.memory.tree.commit(session, None, Turn(2, keys, None, [1, 2, 3], [4, 5], "stop"))
        table = tctx.command(listing.sessions)
    assert "listed-session" in table
    row = next(line for line in table.splitlines() if line.startswith("listed-session"))
    assert row.split()[1:3] == ["1", "5"]  # turns, tokens


def test_a_reconfiguration_keeps_the_apis_and_their_memos_while_the_signer_stays(tmp_path) -> None:
    """The APIs (and the requests their memos hold) outlive a reconfiguration that keeps the signing key and the record
    dir; a new record dir (a new key kept there) gives the signing APIs new memos, chat's stays."""
    addon = TitoAddon()
    with taddons.context(addon) as tctx:
        configured(tctx, addon, tito_record_dir=str(tmp_path / "a"))
        before = addon.wiring.service.apis
        configured(tctx, addon, tito_record_dir=str(tmp_path / "a"), tito_gc_threshold=0, tito_message_memo_mb=7)
        after = addon.wiring.service.apis
        assert [a is b for a, b in zip(before, after, strict=True)] == [True] * 4
        assert {memo.budget_bytes for api in after for memo in api.memos} == {7 * 1024 * 1024}
        configured(tctx, addon, tito_record_dir=str(tmp_path / "b"))
        moved = addon.wiring.service.apis
        assert [a is b for a, b in zip(after, moved, strict=True)] == [True, False, False, False]
