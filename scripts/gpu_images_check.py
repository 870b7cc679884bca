"""The real-GPU check of images (issue 47), for a task that is lent a CUDA machine with vLLM or sglang installed: the
CPU tier runs vLLM's image path (tests/e2e/test_real_vllm_images.py), but sglang has no CPU build here, and the
JPEG-on-CUDA fallback sglang had before 0.5.20 (nvJPEG) exists only on a GPU.

It builds the tiny random Qwen2.5-VL of the e2e tier (scripts/make_tiny_qwen2_5_vl.py), serves it with the engine on
CUDA, and runs a screenshot loop through the proxy (`tito_model_family=qwen2.5-vl`): a PNG, a JPEG with an EXIF
orientation and a WebP, one a turn, with a tool result between; then checks:
- every turn is recorded, extends the one before, and holds its image's run of pads where the engine ran it;
- vLLM: each generate ran on the recorded ids (its `prompt_token_ids` echo) with every image placed there;
- sglang: each /generate's expanded `prompt_token_ids` equal the recorded prompt (the proxy refuses otherwise: a
  refused turn is reported with the engine's log, the JPEG fallback's warning among it).

usage: python scripts/gpu_images_check.py [--engine vllm|sglang] [--python PYTHON] [--keep DIR]
(prints one JSON object; exit 0 = ok). Needs the project's .venv and a Python with the engine on CUDA (`--python`,
default python3). About 3 minutes, most of it the engine's start.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]
TEMPLATE = REPO / "tito_addon" / "engine" / "chat_templates" / "qwen2_5_vl_tools.jinja"


def wait(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{url} did not answer in {timeout:.0f} s")


def shots() -> list[tuple[str, bytes]]:
    from PIL import Image

    out = []
    for kind, size, colour in (("png", (320, 200), (200, 30, 30)), ("jpeg", (200, 320), (30, 200, 30)),
                               ("webp", (256, 144), (30, 30, 200))):  # fmt: skip
        sink = io.BytesIO()
        image = Image.new("RGB", size, colour)
        if kind == "jpeg":
            exif = Image.Exif()
            exif[0x0112] = 6  # stored 200×320, shown 320×200
            image.save(sink, format="JPEG", exif=exif)
        else:
            image.save(sink, format=kind.upper())
        out.append((f"image/{kind}", sink.getvalue()))
    return out


def serve(engine: str, python: str, model: Path, port: int) -> list[str]:
    if engine == "vllm":
        return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
                "--served-model-name", "tiny-vl", "--enable-scale-out", "--max-model-len", "4096",
                "--gpu-memory-utilization", "0.3", "--chat-template", str(TEMPLATE), "--mm-processor-cache-gb", "0",
                "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]  # fmt: skip
    return [python, "-m", "sglang.launch_server", "--model-path", str(model), "--port", str(port),
            "--served-model-name", "tiny-vl", "--mem-fraction-static", "0.3", "--chat-template", str(TEMPLATE),
            "--tool-call-parser", "qwen25"]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    parser.add_argument("--python", default="python3", help="a Python with the engine (CUDA) and torch")
    parser.add_argument("--keep", type=Path, help="keep the model, the engine's log and the records here")
    args = parser.parse_args()
    import openai

    from tito_addon.records.record_reader import read_session
    from tito_addon.replicas.fleet import free_port
    from tito_addon.replicas.proxy_process import Mitmdump

    work = args.keep or Path(tempfile.mkdtemp(prefix="tito-images-"))
    tokenizer = REPO.parent / "shared" / "tokenizers" / "qwen2.5"
    model = work / "tiny-qwen2.5-vl"
    subprocess.run([args.python, str(REPO / "scripts" / "make_tiny_qwen2_5_vl.py"), str(model), str(tokenizer)],
                   check=True)  # fmt: skip
    port = free_port()
    log = (work / f"{args.engine}.log").open("w")
    server = subprocess.Popen(serve(args.engine, args.python, model, port), stdout=log, stderr=subprocess.STDOUT,
                              env=dict(os.environ), start_new_session=True)  # fmt: skip
    report: dict = {"device": "cuda", "engine": args.engine, "model": "tiny Qwen2.5-VL"}
    try:
        wait(f"http://127.0.0.1:{port}/health", 900)
        record_dir = work / "rec"
        options = {"tito_backend_kind": args.engine, "tito_append_roles": "tool,user"}
        with Mitmdump(f"http://127.0.0.1:{port}", tokenizer=str(tokenizer), family="qwen2.5-vl",
                      record_dir=record_dir, cwd=work, options=options) as proxy:  # fmt: skip
            client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", default_headers={"x-session-id": "vl"})
            messages: list[dict] = [{"role": "system", "content": "You drive a browser."}]
            for turn, (media_type, data) in enumerate(shots()):
                url = f"data:{media_type};base64," + base64.b64encode(data).decode()
                content = [
                    {"type": "text", "text": f"Screen {turn}:"},
                    {"type": "image_url", "image_url": {"url": url}},
                ]
                messages.append({"role": "user", "content": content})
                reply = client.chat.completions.create(model="tiny-vl", messages=messages, max_tokens=16, seed=turn)
                messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        recorded = read_session(record_dir, "vl")
        assert recorded is not None and len(recorded.turns) == 3, "three turns recorded"
        ids = recorded.full_ids()
        previous: list[int] = []
        for turn in recorded.turns:
            prompt, completion = ids[turn.turn_id]
            assert prompt[: len(previous)] == previous, f"turn {turn.turn_id} does not extend the one before"
            previous = prompt + completion
            for image in recorded.sequence_images()[turn.turn_id]:
                assert prompt[image.offset : image.offset + image.length] == [151655] * image.length
        report.update(
            turns=[
                {"prompt": t.prompt_len, "images": [(i.format, i.width, i.height, i.length) for i in t.images or []]}
                for t in recorded.turns
            ],  # fmt: skip
            render_skew=[t.render_skew for t in recorded.turns],
            ok=True,
        )
    except Exception as exc:  # reported, with the engine's log tail
        log.flush()
        report.update(ok=False, error=f"{type(exc).__name__}: {exc}",
                      engine_log=(work / f"{args.engine}.log").read_text()[-4000:])  # fmt: skip
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
