"""Images in prompts: counted as the models' own processors count them, placed where the templates put them, and the
stored prefix of a screenshot loop extended without re-rendering it.

The reference is transformers' own PIL image processor for Qwen2-VL-style models (`Qwen2VLImageProcessorPil`, the class
both Qwen2.5-VL and Qwen3-VL map to), run on real decoded images at each model's `preprocessor_config.json` bounds:
the pad count of an image is its `image_grid_thw` product over merge², as the processors' `replace_image_token` says.
"""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image
from support.basics import cached_engine

from tito_addon.canonical_chat import ChatMessage, ChatRequest
from tito_addon.chat_images import ImagePart, image_from_bytes
from tito_addon.engine.vision_tokens import QWEN2_5_VL, QWEN3_VL, VisionScheme, collapse_runs
from tito_addon.sessions.message_keys import message_key
from tito_addon.tito_errors import BadRequest

VISION_START, IMAGE_PAD, VISION_END = 151652, 151655, 151653
PREPROCESSOR = {  # each model's preprocessor_config.json: size bounds, patch and merge
    "qwen2.5-vl": (QWEN2_5_VL, {"shortest_edge": 3136, "longest_edge": 12845056}, 14),
    "qwen3-vl": (QWEN3_VL, {"shortest_edge": 65536, "longest_edge": 16777216}, 16),
}
TOKENIZER = {"qwen2.5-vl": "qwen2.5", "qwen3-vl": "qwen3"}


def png(width: int, height: int, colour: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image_url_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


def hf_tokens(family: str, data: bytes) -> int:
    """The pad count transformers' own processor gives this image."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    _, size, patch = PREPROCESSOR[family]
    processor = Qwen2VLImageProcessorPil(size=size, patch_size=patch, merge_size=2)
    grid = processor(images=[Image.open(io.BytesIO(data))])["image_grid_thw"][0]
    return int(grid[0] * grid[1] * grid[2]) // 4


def engine(family: str):
    roles = ("tool", "user") if family == "qwen3-vl" else ("tool", "user", "system")
    return cached_engine(TOKENIZER[family], family, roles)


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
@pytest.mark.parametrize(
    "size", [(1, 1), (37, 23), (640, 480), (1288, 728), (1920, 1080), (3000, 15), (15, 2900), (4000, 3000), (42, 70)]
)
def test_an_images_pad_count_is_the_processors(family: str, size: tuple[int, int]) -> None:
    scheme: VisionScheme = PREPROCESSOR[family][0]
    data = png(*size)
    assert scheme.image_tokens(*size) == hf_tokens(family, data)


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_a_first_turn_expands_each_images_pad_in_place(family: str) -> None:
    tokens = engine(family)
    shots = [png(640, 480), png(37, 23, (0, 90, 0))]
    request = ChatRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "You watch a screen."},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Before:"},
                        image_url_part(shots[0]),
                        {"type": "text", "text": "after:"},
                        image_url_part(shots[1]),
                        {"type": "text", "text": "What changed?"},
                    ],
                },
            ]
        }
    )
    piece = tokens.first_turn(request.messages, None, {})
    text = tokens.render(
        [
            {"role": "system", "content": "You watch a screen."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Before:"},
                    {"type": "image"},
                    {"type": "text", "text": "after:"},
                    {"type": "image"},
                    {"type": "text", "text": "What changed?"},
                ],
            },
        ],
        None,
        add_generation_prompt=True,
        kwargs={},
    )
    assert "Before:<|vision_start|><|image_pad|><|vision_end|>after:" in text
    collapsed = tokens.tokenizer.encode(text, add_special_tokens=False)
    counts = [hf_tokens(family, shot) for shot in shots]
    runs = iter(counts)
    expected: list[int] = []
    for token in collapsed:
        expected.extend([IMAGE_PAD] * next(runs) if token == IMAGE_PAD else [token])
    assert piece.ids == expected
    assert [(p.length, p.part.width, p.part.height) for p in piece.images] == [
        (counts[0], 640, 480),
        (counts[1], 37, 23),
    ]
    for placed in piece.images:
        assert piece.ids[placed.offset - 1] == VISION_START
        assert piece.ids[placed.offset : placed.end] == [IMAGE_PAD] * placed.length
        assert piece.ids[placed.end] == VISION_END
    assert collapse_runs(piece.ids, [(p.offset, p.end) for p in piece.images]) == collapsed
    assert piece.segments[-1].end == len(piece.ids)


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_a_screenshot_loop_extends_its_stored_ids_exactly(family: str) -> None:
    """A tool that returns a new screenshot every turn: each turn's prompt is the stored prompt + completion, the
    boundary and the new tool result's ids, which equal the whole history's render, expanded, id for id."""
    tokens = engine(family)
    tools = [{"type": "function", "function": {"name": "screenshot", "parameters": {"type": "object"}}}]
    history = [
        ChatMessage.model_validate({"role": "system", "content": "Drive the browser."}),
        ChatMessage.model_validate(
            {"role": "user", "content": [{"type": "text", "text": "Open the page."}, image_url_part(png(320, 200))]}
        ),
    ]
    stored = tokens.first_turn(history, tools, {}).ids
    for step in range(3):
        call = {"id": f"call_{step}", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}}
        answer = ChatMessage.model_validate({"role": "assistant", "content": "", "tool_calls": [call]})
        completion = tokens.encode('<tool_call>\n{"name": "screenshot", "arguments": {}}\n</tool_call><|im_end|>')
        shot = png(300 + 40 * step, 180 + 30 * step, (step * 60, 0, 0))
        result = ChatMessage.model_validate(
            {
                "role": "tool",
                "tool_call_id": f"call_{step}",
                "content": [{"type": "text", "text": f"step {step}"}, image_url_part(shot)],
            }
        )
        piece = tokens.continuation(completion, [result], tools, {})
        history += [answer, result]
        whole = tokens.first_turn(history, tools, {})
        assert stored + completion + piece.ids == whole.ids
        [placed] = piece.images
        assert placed.length == hf_tokens(family, shot)
        assert piece.ids[placed.offset : placed.end] == [IMAGE_PAD] * placed.length
        assert whole.images[-1].offset == len(stored + completion) + placed.offset
        stored = whole.ids


def test_a_role_whose_template_renders_no_image_is_refused() -> None:
    """Qwen3-VL's template drops images in an assistant message: the pads would not pair with the images."""
    message = ChatMessage.model_validate(
        {"role": "assistant", "content": [{"type": "text", "text": "Here:"}, image_url_part(png(64, 64))]}
    )
    user = ChatMessage.model_validate({"role": "user", "content": "Go on."})
    with pytest.raises(BadRequest, match="1 image\\(s\\) but their rendered prompt holds 0"):
        engine("qwen3-vl").first_turn([user, message, user], None, {})


def test_a_pad_token_in_an_agents_text_is_refused() -> None:
    message = ChatMessage.model_validate(
        {"role": "user", "content": [{"type": "text", "text": "a <|image_pad|> here"}, image_url_part(png(64, 64))]}
    )
    with pytest.raises(BadRequest, match="1 image\\(s\\) but their rendered prompt holds 2"):
        engine("qwen2.5-vl").first_turn([message], None, {})


def test_a_text_family_refuses_images() -> None:
    message = ChatMessage.model_validate({"role": "user", "content": [image_url_part(png(8, 8))]})
    with pytest.raises(BadRequest, match="reads text only"):
        cached_engine("qwen3").first_turn([message], None, {})


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_the_vision_families_are_append_only(family: str) -> None:
    assert engine(family).append_only_problems() == []


def test_an_image_is_part_of_its_messages_key() -> None:
    def message(data: bytes, text: str = "look") -> ChatMessage:
        return ChatMessage.model_validate(
            {"role": "user", "content": [{"type": "text", "text": text}, image_url_part(data)]}
        )

    red, green = png(16, 16, (255, 0, 0)), png(16, 16, (0, 255, 0))
    assert message_key(message(red)) == message_key(message(red))
    assert message_key(message(red)) != message_key(message(green))
    assert message_key(message(red)) != message_key(ChatMessage(role="user", content="look"))
    # A recorded part (digest, no bytes) keys as the agent's did: a session resumes from its records.
    recorded = ChatMessage.model_validate(message(red).model_dump(mode="json"), context={"recorded": True})
    assert message_key(recorded) == message_key(message(red))
    assert "data" not in str(message(red).model_dump(mode="json"))


@pytest.mark.parametrize(
    ("part", "why"),
    [
        ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "fetches nothing"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "not valid base64"),
        ({"type": "image_url", "image_url": {"url": data_url(b"not an image at all")}}, "does not decode"),
        ({"type": "image_url", "image_url": {"url": data_url(png(4, 4), "image/bmp")}}, "not an image the proxy"),
        ({"type": "image_url", "image_url": {"url": "data:image/png," + "x"}}, "must be base64"),
        ({"type": "image_url", "image_url": {"url": data_url(png(2, 500))}}, "aspect ratio"),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "not supported"),
        ({"type": "image", "sha256": "0" * 64, "media_type": "image/png", "width": 1, "height": 1}, "not supported"),
    ],
)
def test_an_image_the_proxy_cannot_pass_on_is_a_clear_refusal(part: dict, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        ChatMessage.model_validate({"role": "user", "content": [part]})


def test_an_image_is_its_bytes() -> None:
    data = png(33, 17)
    image = image_from_bytes(data, "image/jpeg")  # mislabelled: the bytes say PNG
    assert (image.media_type, image.width, image.height, image.data) == ("image/png", 33, 17, data)
    part = ImagePart.of(image)
    assert part.image is image and part.format == "png" and image.file_name == f"{image.sha256}.png"
    assert base64.b64decode(image.data_url().split(",", 1)[1]) == data


def test_an_agents_image_is_read_once_however_many_places_read_it(monkeypatch) -> None:
    """An Anthropic image block is checked in the agent's terms, read again as the canonical form's data URL, and
    named by digest in the record: one decode and check of its bytes for all three."""
    from tito_addon import chat_images
    from tito_addon.protocols.image_parts import inline_image_part

    reads = []
    real = chat_images.read_image
    monkeypatch.setattr(chat_images, "read_image", lambda data, **kw: reads.append(len(data)) or real(data, **kw))
    data = base64.b64encode(png(61, 47, (1, 61, 47))).decode()
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    part = inline_image_part(data, "image/png", "messages.0.content.0")
    message = ChatMessage.model_validate({"role": "user", "content": [part]})
    recorded = chat_images.without_image_data([block])
    assert len(reads) == 1
    assert recorded[0]["source"]["data"] == "sha256:" + message.images()[0].sha256
