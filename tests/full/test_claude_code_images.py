"""The real Claude Code CLI reading a screenshot with its Read tool, through a real mitmdump serving a vision-language
family (`qwen2.5-vl`) from the sglang replica: the image reaches the engine, every turn is token exact, and the
screenshot is kept once on disk however often the CLI re-sends it.

    ANTHROPIC_BASE_URL=http://127.0.0.1:PORT ANTHROPIC_API_KEY=KEY CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 ...
        claude -p "Look at shot.png." --allowedTools Read --output-format stream-json --verbose

The replica is steered to call Read on the project's PNG once, then to answer.
"""

# ruff: noqa: F811 - the stack's fixtures are imported by name and taken as arguments
from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest
from PIL import Image
from support.agent_cli_stack import (  # noqa: F401 - fixtures
    NamespacedReplica,
    Network,
    agent_clis,
    base_env,
    network,
    run_cli,
)
from support.basics import API_KEYS, tokenizer_path
from support.proxy_harness import Mitmdump

from tito_addon.records.record_reader import iter_session_files
from tito_addon.replicas.sglang_replica import ReplicaConfig

pytestmark = [pytest.mark.full, pytest.mark.serial]
IMAGE_PAD = 151655


def test_claude_codes_read_tool_sends_the_screenshot_token_exact(
    network: Network, agent_clis: Path, tmp_path: Path
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    shot = project / "shot.png"
    out = io.BytesIO()
    Image.new("RGB", (320, 200), (20, 120, 220)).save(out, format="PNG")
    shot.write_bytes(out.getvalue())
    config = ReplicaConfig(
        tokenizer=tokenizer_path("qwen2.5"), vision="qwen2.5-vl", tool_rounds=1,
        preferred_tools={"Read": {"file_path": str(shot), "$once": True}},
    )  # fmt: skip
    replica = NamespacedReplica(config, network)
    with replica:
        record_dir = tmp_path / "rec"
        with Mitmdump(replica.url, tokenizer=tokenizer_path("qwen2.5"), family="qwen2.5-vl", record_dir=record_dir,
                      cwd=tmp_path, launcher=network.command([])) as proxy:  # fmt: skip
            env = base_env(
                tmp_path / "home", agent_clis, ANTHROPIC_BASE_URL=proxy.url, ANTHROPIC_API_KEY=API_KEYS[0],
                CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_TELEMETRY="1", DISABLE_ERROR_REPORTING="1",
                DISABLE_AUTOUPDATER="1",
            )  # fmt: skip
            tail = ["--allowedTools", "Read", "--output-format", "stream-json", "--verbose"]
            run = run_cli(network, [str(agent_clis / "claude"), "-p", "Look at shot.png.", *tail], env=env, cwd=project)
        generated = replica.generated()
    events = run.events()
    assert events[-1]["type"] == "result" and not events[-1]["is_error"], str(run)
    turns = [t for f in iter_session_files(record_dir) for t in f.turns]
    with_images = [t for t in turns if t.images]
    assert with_images, f"no turn carried an image: {[t.appended_messages for t in turns]}"
    [image] = [i for t in with_images for i in t.images or []]
    # As Claude Code sends it: a tool_result holding the image (kept as a tool message whose part names it), answering
    # the Read call the turn before, which it extends.
    [turn] = with_images
    [result] = [m for m in turn.appended_messages or [] if m["role"] == "tool"]
    assert [part.get("sha256") for part in result["content"] if part["type"] == "image"] == [image.sha256]
    parent = next(t for t in turns if t.turn_id == turn.parent_turn_id)
    assert [c["function"]["name"] for c in parent.assistant_message["tool_calls"]] == ["Read"]
    stored = (record_dir / "images" / f"{image.sha256}.{image.format}").read_bytes()
    assert hashlib.sha256(stored).hexdigest() == image.sha256
    # The engine ran on the recorded ids, the image's run of pads where the record says.
    runs = [g for g in generated if g.get("images")]
    assert runs and all(IMAGE_PAD in g["prompt_ids"] for g in runs)
    assert runs[0]["images"][0]["sha256"] == image.sha256 and runs[0]["images"][0]["length"] == image.length
