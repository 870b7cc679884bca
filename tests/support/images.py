"""Images the image tests send: PNGs drawn with Pillow, as the parts each API carries them, and a short screenshot
session recorded through a real mitmdump serving `qwen2.5-vl` from the sglang replica."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import openai
from PIL import Image

from support.basics import tokenizer_path
from support.proxy_harness import Mitmdump
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread

#: Qwen's image placeholder ids: a run of pads between the start and end markers.
VISION_START, IMAGE_PAD, VISION_END = 151652, 151655, 151653


def png(width: int, height: int, colour: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image_url_part(data: bytes, media_type: str = "image/png") -> dict:
    """The chat-completions part of an image."""
    return {"type": "image_url", "image_url": {"url": data_url(data, media_type)}}


def screenshot_session(
    tmp_path: Path, session: str, shots: list[bytes], text: str = "And now?", **config
) -> tuple[Path, list[list[dict]], list[str | None]]:
    """One user message a screenshot, answered each, through a mitmdump (`qwen2.5-vl`) on the sglang replica (its
    `config` fields added): the record dir, the messages each request sent, and each answer's text."""
    record_dir = tmp_path / "rec"
    settings = {"tokenizer": tokenizer_path("qwen2.5"), "family": "qwen2.5-vl", "record_dir": record_dir}
    replica_config = ReplicaConfig(tokenizer=tokenizer_path("qwen2.5"), vision="qwen2.5-vl", **config)
    asked: list[list[dict]] = []
    answers: list[str | None] = []
    with ReplicaThread(replica_config) as replica, Mitmdump(replica.url, cwd=tmp_path, **settings) as proxy:
        client = openai.OpenAI(
            base_url=proxy.url + "/v1", api_key="k", default_headers={"x-session-id": session}, max_retries=0
        )
        messages: list[dict] = []
        for shot in shots:
            messages.append({"role": "user", "content": [image_url_part(shot), {"type": "text", "text": text}]})
            asked.append(list(messages))
            reply = client.chat.completions.create(model="m", messages=messages, max_tokens=100)
            answers.append(reply.choices[0].message.content)
            messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        assert len(replica.generated()) == len(shots)
    return record_dir, asked, answers
