"""What images cost (issue 47): the proxy's own work per image (decode the base64, read the header, check the
structure, digest), and a screenshot loop's time and disk against the same loop with text in place of each image,
through mitmdump + the addon and the vLLM 0.32 replica (which loads every image with PIL and counts it with
transformers' processor each turn, as vLLM's render does).

    .venv/bin/python bench/images_bench.py [--turns 30] [--width 1288 --height 728]

Both loops run side by side, turn by turn, alternating which goes first, so drift in the machine's load falls on
both. Each turn appends a user message: a new screenshot (PNG, drawn like a page: bands, boxes and noise) or a line
of text. The agent re-sends every earlier message, screenshots included, as agents do. Reported: the proxy's work per
image, the median turn time of each loop and their ratio, the bytes the agent sent, and what the record dir keeps.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import openai  # noqa: E402
from PIL import Image, ImageDraw  # noqa: E402
from support.basics import tokenizer_path  # noqa: E402
from support.proxy_harness import Mitmdump  # noqa: E402

from tito_addon.chat_images import image_from_base64  # noqa: E402
from tito_addon.replicas.vllm_replica import VllmReplicaConfig, VllmReplicaThread  # noqa: E402

TEMPLATE = REPO / "tito_addon" / "engine" / "chat_templates" / "qwen2_5_vl_tools.jinja"


def screenshot(width: int, height: int, seed: int, fmt: str = "PNG") -> bytes:
    """A page-like image: a header band, boxes of text-like noise, flat areas (compresses as screenshots do)."""
    rng = random.Random(seed)
    image = Image.new("RGB", (width, height), (245, 245, 245))
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 0, width, height // 12), fill=(rng.randrange(256), 60, 120))
    for _ in range(40):
        x, y = rng.randrange(width), rng.randrange(height)
        draw.rectangle((x, y, x + rng.randrange(20, 300), y + rng.randrange(8, 18)), fill=(30, 30, 30))
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def proxy_work(sizes: list[tuple[int, int]], repeats: int = 20) -> list[dict]:
    """In process: an image from its base64 (decode, header, structure, digest), as the proxy reads each new one."""
    rows = []
    for width, height in sizes:
        for fmt in ("PNG", "JPEG"):
            data = base64.b64encode(screenshot(width, height, 1, fmt)).decode()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                image_from_base64(data, f"image/{fmt.lower()}")
                times.append(time.perf_counter() - start)
            rows.append({"size": f"{width}x{height}", "format": fmt, "bytes": len(data) * 3 // 4,
                         "ms": round(statistics.median(times) * 1000, 2)})  # fmt: skip
    return rows


def loop(turns: int, width: int, height: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="tito-images-bench-"))
    config = VllmReplicaConfig(tokenizer=tokenizer_path("qwen2.5"), vision="qwen2.5-vl", chat_template=str(TEMPLATE),
                               served_model_name="vl", reasoning_parser=False, max_model_len=262144)  # fmt: skip
    options = {"tito_backend_kind": "vllm", "tito_images_max": str(turns + 1)}
    settings = {"tokenizer": tokenizer_path("qwen2.5"), "family": "qwen2.5-vl", "options": options}
    with (
        VllmReplicaThread(config) as replica,
        Mitmdump(replica.url, record_dir=work / "rec", cwd=work, **settings) as proxy,
    ):
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
        histories: dict[str, list[dict]] = {"images": [], "text": []}
        times: dict[str, list[float]] = {"images": [], "text": []}
        sent = 0
        for turn in range(turns):
            order = ["images", "text"] if turn % 2 == 0 else ["text", "images"]
            for kind in order:
                messages = histories[kind]
                if kind == "images":
                    url = "data:image/png;base64," + base64.b64encode(screenshot(width, height, turn)).decode()
                    content: object = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}]
                else:
                    content = f"Screen {turn}: the page shows a header and forty boxes of text. What next?"
                messages.append({"role": "user", "content": content})
                body = json.dumps({"model": "vl", "messages": messages, "max_tokens": 40})
                if kind == "images":
                    sent += len(body)
                start = time.perf_counter()
                reply = client.chat.completions.create(
                    model="vl", messages=messages, max_tokens=40, extra_headers={"x-session-id": kind}
                )
                times[kind].append(time.perf_counter() - start)
                messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    store = work / "rec" / "images"
    lines = sum(p.stat().st_size for p in (work / "rec").glob("images*.jsonl"))
    return {
        "turns": turns,
        "image": f"{width}x{height} PNG",
        "median_turn_ms": {kind: round(statistics.median(t) * 1000, 1) for kind, t in times.items()},
        "ratio_images_to_text": round(statistics.median(times["images"]) / statistics.median(times["text"]), 2),
        "last_turn_ms": {kind: round(t[-1] * 1000, 1) for kind, t in times.items()},
        "request_bytes_sent_with_images": sent,
        "image_store_bytes": sum(p.stat().st_size for p in store.iterdir()),
        "image_store_files": len(list(store.iterdir())),
        "record_line_bytes": lines,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--width", type=int, default=1288)
    parser.add_argument("--height", type=int, default=728)
    args = parser.parse_args()
    report = {
        "proxy_work_per_image": proxy_work([(640, 400), (args.width, args.height), (1920, 1080)]),
        "loop": loop(args.turns, args.width, args.height),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
