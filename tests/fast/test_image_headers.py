"""The image reader (`image_headers`) against Pillow, the decoder the engines open images with: the format sniffed
from the bytes, the size as displayed after `ImageOps.exif_transpose`, and a refusal, in words, of bytes that are not
a whole PNG, JPEG, GIF or WebP. Pillow makes the images and says what they decode to; interlaced PNGs (which Pillow
cannot write) are built here and decoded by Pillow."""

from __future__ import annotations

import io
import random
import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps
from support.basics import examples

from tito_addon.image_headers import (
    MEDIA_TYPES,
    ImageFormat,
    ImageHeader,
    ImageUnreadable,
    read_image,
    sniff_format,
)

PNG, JPEG, GIF, WEBP = ImageFormat.PNG, ImageFormat.JPEG, ImageFormat.GIF, ImageFormat.WEBP
SIZES = [(1, 1), (37, 23), (640, 480)]
ORIENTATION = 0x0112


def picture(mode: str, size: tuple[int, int], seed: int = 0) -> Image.Image:
    """Noise (so every row filter and scan has work), the same for the same seed, in `mode`."""
    rng = random.Random(seed)
    image = Image.frombytes("L", size, rng.randbytes(size[0] * size[1])).convert(mode)
    if mode in ("LA", "RGBA"):  # an alpha that is not all opaque, which encoders would drop
        image.putalpha(Image.frombytes("L", size, rng.randbytes(size[0] * size[1])))
    return image


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def displayed(data: bytes) -> tuple[int, int]:
    """Pillow's answer: the size after decoding every pixel and turning the image upright."""
    with Image.open(io.BytesIO(data)) as image:
        image.load()
        return ImageOps.exif_transpose(image).size


def exif(orientation: int) -> Image.Exif:
    tags = Image.Exif()
    tags[ORIENTATION] = orientation
    return tags


def refusal(data: bytes) -> str:
    with pytest.raises(ImageUnreadable) as caught:
        read_image(data)
    return str(caught.value)


def chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def built_png(ihdr: tuple[int, int, int, int, int], stream: bytes, *extra: bytes) -> bytes:
    """A PNG of the given IHDR fields (width, height, depth, colour, interlace) whose IDAT holds `stream`."""
    width, height, depth, colour, interlace = ihdr
    header = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, interlace))
    return b"\x89PNG\r\n\x1a\n" + header + b"".join(extra) + chunk(b"IDAT", stream) + chunk(b"IEND", b"")


def filtered_rows(width: int, height: int, bits: int, interlace: int, rng: random.Random) -> bytes:
    """Raw image data, each row a random filter byte (0..4) and random bytes, counted pixel by pixel per pass."""
    passes = [(0, 0, 1, 1)] if not interlace else [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4)]
    passes += [(0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2)] if interlace else []
    out = bytearray()
    for x0, y0, dx, dy in passes:
        columns = len(range(x0, width, dx))
        for _ in range(y0, height, dy) if columns else ():
            out += bytes([rng.randrange(5)]) + rng.randbytes(-(-columns * bits // 8))
    return bytes(out)


# What each format reads as ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("mode", ["1", "L", "LA", "P", "RGB", "RGBA", "I;16"])
def test_a_pillow_png_reads_as_its_size(mode: str, size: tuple[int, int]) -> None:
    data = encoded(picture(mode, size), "PNG")
    assert displayed(data) == size
    assert read_image(data) == ImageHeader(PNG, size[0], size[1], 1)


DEPTHS_AND_COLOURS = [(1, 0), (2, 0), (4, 0), (16, 0), (8, 2), (16, 2), (1, 3), (2, 3), (4, 3), (8, 3), (8, 4)]
DEPTHS_AND_COLOURS += [(16, 4), (8, 6), (16, 6)]


@pytest.mark.parametrize("size", [(1, 1), (2, 3), (5, 5), (9, 1), (1, 9), (37, 23)])
@pytest.mark.parametrize(("depth", "colour"), DEPTHS_AND_COLOURS)
@pytest.mark.parametrize("interlace", [0, 1])
def test_a_built_png_reads_as_pillow_decodes_it(interlace: int, depth: int, colour: int, size) -> None:
    """Adam7 passes with no pixels (a 1×1 image has only the first) have no rows, not even a filter byte."""
    bits = depth * {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[colour]
    raw = filtered_rows(*size, bits, interlace, random.Random(depth * 7 + colour))
    palette = [chunk(b"PLTE", bytes(i % 256 for i in range(3 << depth)))] if colour == 3 else []
    data = built_png((*size, depth, colour, interlace), zlib.compress(raw), *palette)
    assert displayed(data) == size
    assert read_image(data) == ImageHeader(PNG, size[0], size[1], 1)
    short = built_png((*size, depth, colour, interlace), zlib.compress(raw[:-1]), *palette)
    with pytest.raises(OSError):
        displayed(short)
    assert f"inflates to {len(raw) - 1} bytes where a {size[0]}×{size[1]}" in refusal(short)


def test_an_animated_png_reads_as_its_default_image() -> None:
    frames = [picture("RGBA", (37, 23), seed) for seed in range(3)]
    data = encoded(frames[0], "PNG", save_all=True, append_images=frames[1:], duration=40)
    assert b"acTL" in data and b"fdAT" in data and Image.open(io.BytesIO(data)).n_frames == 3
    assert displayed(data) == (37, 23)
    assert read_image(data) == ImageHeader(PNG, 37, 23, 1)


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("progressive", [False, True])
@pytest.mark.parametrize("mode", ["L", "RGB", "CMYK"])
def test_a_jpeg_reads_as_its_exif_orientation_displays_it(mode: str, progressive: bool, orientation: int) -> None:
    data = encoded(picture(mode, (37, 23)), "JPEG", progressive=progressive, exif=exif(orientation))
    expected = (23, 37) if orientation >= 5 else (37, 23)
    assert displayed(data) == expected
    assert read_image(data) == ImageHeader(JPEG, expected[0], expected[1], orientation)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("options", [{}, {"progressive": True}, {"restart_marker_blocks": 1}, {"quality": 100}])
def test_a_jpeg_without_exif_reads_upright(options: dict, size: tuple[int, int]) -> None:
    data = encoded(picture("RGB", size), "JPEG", **options)
    assert displayed(data) == size
    assert read_image(data) == ImageHeader(JPEG, size[0], size[1], 1)


def built_exif(order: str, orientation: int, kind: int = 3) -> bytes:
    """An EXIF block in either byte order ("<": II, ">": MM) holding only Orientation, as SHORT (3) or LONG (4)."""
    value = struct.pack(order + {3: "H", 4: "I"}[kind], orientation).ljust(4, b"\x00")
    entry = struct.pack(order + "HHI", ORIENTATION, kind, 1) + value
    head = b"II*\x00" if order == "<" else b"MM\x00*"
    return b"Exif\x00\x00" + head + struct.pack(order + "IH", 8, 1) + entry + struct.pack(order + "I", 0)


def app1(body: bytes) -> bytes:
    return b"\xff\xe1" + struct.pack(">H", len(body) + 2) + body


@pytest.mark.parametrize("kind", [3, 4])
@pytest.mark.parametrize("order", ["<", ">"])
@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_exif_in_either_byte_order_turns_a_jpeg_as_pillow_does(orientation: int, order: str, kind: int) -> None:
    plain = encoded(picture("RGB", (37, 23)), "JPEG")
    data = plain[:2] + app1(built_exif(order, orientation, kind)) + plain[2:]
    expected = displayed(data)
    assert read_image(data) == ImageHeader(JPEG, *expected, orientation)
    assert expected == ((23, 37) if orientation >= 5 else (37, 23))
    after_the_scan = plain[:-2] + app1(built_exif(order, orientation, kind)) + b"\xff\xd9"
    assert displayed(after_the_scan) == (37, 23)  # Pillow reads the header only up to the first scan
    assert read_image(after_the_scan) == ImageHeader(JPEG, 37, 23, 1)


XMP = b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:Description tiff:Orientation="6"/></x:xmpmeta>'


def test_xmp_orientation_counts_only_where_the_exif_has_none() -> None:
    """Pillow's `getexif` falls back on XMP's tiff:Orientation; an EXIF Orientation tag, any value, wins."""
    plain = picture("RGB", (37, 23))
    png = encoded(plain, "PNG")
    itxt = chunk(b"iTXt", b"XML:com.adobe.xmp\x00\x00\x00\x00\x00" + XMP)
    zipped = chunk(b"iTXt", b"XML:com.adobe.xmp\x00\x01\x00\x00\x00" + zlib.compress(XMP))
    cases = [
        (encoded(plain, "JPEG", xmp=XMP), 6),
        (encoded(plain, "JPEG", xmp=XMP, exif=exif(1)), 1),
        (encoded(plain, "JPEG", xmp=XMP, exif=exif(9)), 1),
        (encoded(plain, "WEBP", xmp=XMP), 6),
        (png[:33] + itxt + png[33:], 6),
        (png[:-12] + zipped + png[-12:], 6),
        (png[:33] + chunk(b"tEXt", b"XML:com.adobe.xmp\x00" + XMP) + png[33:], 6),
    ]
    for data, orientation in cases:
        expected = displayed(data)
        assert read_image(data) == ImageHeader(sniff_format(data), *expected, orientation)
        assert expected == ((23, 37) if orientation >= 5 else (37, 23))


def test_fill_bytes_and_a_trailer_after_eoi_are_read_as_pillow_reads_them() -> None:
    data = encoded(picture("RGB", (37, 23)), "JPEG", progressive=True)
    sos = data.index(b"\xff\xda")
    filled = data[:sos] + b"\xff\xff\xff" + data[sos:-2] + b"\xff\xff\xff\xd9" + b"\x00" * 16 + b"camera trailer"
    assert displayed(filled) == (37, 23)
    assert read_image(filled) == ImageHeader(JPEG, 37, 23, 1)


@pytest.mark.parametrize("size", SIZES)
def test_a_gif_reads_as_its_screen(size: tuple[int, int]) -> None:
    data = encoded(picture("P", size), "GIF")
    assert displayed(data) == size
    assert read_image(data) == ImageHeader(GIF, size[0], size[1], 1)


def test_an_animated_gif_reads_as_its_screen_grown_to_its_first_frame() -> None:
    frames = [picture("P", (37, 23), seed) for seed in range(3)]
    frames[1].paste(0, (0, 0, 10, 10))
    data = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    assert Image.open(io.BytesIO(data)).n_frames == 3 and displayed(data) == (37, 23)
    assert read_image(data) == ImageHeader(GIF, 37, 23, 1)
    small_screen = data[:6] + struct.pack("<HH", 10, 8) + data[10:]
    assert displayed(small_screen) == (37, 23)
    assert read_image(small_screen) == ImageHeader(GIF, 37, 23, 1)


WEBP_KINDS = {
    "lossy": ("RGB", {}),
    "lossless": ("RGB", {"lossless": True}),
    "lossy alpha": ("RGBA", {}),
    "lossless alpha": ("RGBA", {"lossless": True}),
}


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("kind", WEBP_KINDS)
def test_a_webp_reads_as_its_canvas(kind: str, size: tuple[int, int]) -> None:
    mode, options = WEBP_KINDS[kind]
    data = encoded(picture(mode, size), "WEBP", **options)
    assert data[12:16] == (b"VP8X" if kind == "lossy alpha" else b"VP8L" if "lossless" in kind else b"VP8 ")
    assert displayed(data) == size
    assert read_image(data) == ImageHeader(WEBP, size[0], size[1], 1)


@pytest.mark.parametrize("lossless", [False, True])
def test_an_animated_webp_reads_as_its_canvas(lossless: bool) -> None:
    frames = [picture("RGBA", (37, 23), seed) for seed in range(3)]
    frames[2] = frames[1].copy()
    frames[2].paste((0, 0, 0, 0), (0, 0, 5, 5))  # so a later frame covers only part of the canvas
    options = {"save_all": True, "append_images": frames[1:], "duration": 40, "lossless": lossless}
    data = encoded(frames[0], "WEBP", **options)
    assert b"ANMF" in data and Image.open(io.BytesIO(data)).n_frames == 3 and displayed(data) == (37, 23)
    assert read_image(data) == ImageHeader(WEBP, 37, 23, 1)


@pytest.mark.parametrize("fmt", [PNG, WEBP])
@pytest.mark.parametrize("orientation", [1, 5, 6, 7, 8])
def test_exif_in_a_png_or_webp_turns_it_as_pillow_does(fmt: ImageFormat, orientation: int) -> None:
    data = encoded(picture("RGB", (37, 23)), fmt.name, exif=exif(orientation))
    expected = displayed(data)
    assert expected == ((23, 37) if orientation >= 5 else (37, 23))
    assert read_image(data) == ImageHeader(fmt, *expected, orientation)


def test_the_format_is_sniffed_and_named_by_its_media_type() -> None:
    samples = {PNG: "PNG", JPEG: "JPEG", GIF: "GIF", WEBP: "WEBP"}
    for fmt, name in samples.items():
        assert sniff_format(encoded(picture("RGB", (3, 2)), name)) is fmt
    assert [fmt.media_type for fmt in ImageFormat] == ["image/png", "image/jpeg", "image/gif", "image/webp"]
    assert MEDIA_TYPES == {
        "image/png": PNG,
        "image/jpeg": JPEG,
        "image/jpg": JPEG,
        "image/gif": GIF,
        "image/webp": WEBP,
    }
    assert sniff_format(b"") is None and sniff_format(b"RIFF\x00\x00\x00\x00WAVE") is None


# Refusals -----------------------------------------------------------------------------------------------------------


def samples() -> dict[str, bytes]:
    frames = [picture("RGBA", (37, 23), seed) for seed in range(2)]
    animated = {"save_all": True, "append_images": frames[1:], "duration": 40}
    return {
        "png": encoded(picture("RGBA", (37, 23)), "PNG"),
        "png interlaced": built_png((37, 23, 8, 2, 1), zlib.compress(filtered_rows(37, 23, 24, 1, random.Random(1)))),
        "jpeg": encoded(picture("RGB", (37, 23)), "JPEG", exif=exif(6)),
        "jpeg progressive": encoded(picture("L", (37, 23)), "JPEG", progressive=True, restart_marker_blocks=2),
        "gif": encoded(picture("P", (37, 23)), "GIF", save_all=True, append_images=[picture("P", (37, 23), 1)]),
        "webp": encoded(picture("RGB", (37, 23)), "WEBP", exif=exif(8)),
        "webp lossless": encoded(picture("RGB", (37, 23)), "WEBP", lossless=True),
        "webp animated": encoded(frames[0], "WEBP", **animated),
    }


SAMPLES = samples()


@pytest.mark.parametrize("name", SAMPLES)
def test_every_truncation_is_refused(name: str) -> None:
    data = SAMPLES[name]
    assert read_image(data).width in (23, 37)
    for length in range(len(data)):
        with pytest.raises(ImageUnreadable):
            read_image(data[:length])


@pytest.mark.filterwarnings("ignore::UserWarning:PIL.TiffImagePlugin")  # Pillow on a damaged EXIF block
@pytest.mark.parametrize("name", SAMPLES)
def test_a_flipped_byte_is_refused_or_read_as_pillow_reads_it(name: str) -> None:
    """A PNG's every byte is under its signature or a CRC, so any flip is refused; elsewhere a flip the reader lets
    through must give the size Pillow gives, where Pillow decodes it."""
    data, rng = SAMPLES[name], random.Random(name)
    for offset in range(len(data)) if name.startswith("png") else rng.sample(range(len(data)), 150):
        flipped = bytearray(data)
        flipped[offset] ^= 1 << rng.randrange(8)
        try:
            header = read_image(bytes(flipped))
        except ImageUnreadable:
            continue
        assert not name.startswith("png"), offset
        try:
            expected = displayed(bytes(flipped))
        except (OSError, SyntaxError, ValueError, EOFError):
            continue
        assert (header.width, header.height) == expected, offset


def test_a_damaged_png_says_what_is_wrong() -> None:
    data = SAMPLES["png"]
    idat = data.index(b"IDAT") + 10
    assert refusal(data[:idat] + bytes([data[idat] ^ 0x10]) + data[idat + 1 :]) == (
        "the PNG's IDAT chunk fails its CRC check (its bytes are damaged)"
    )
    short = built_png((20, 20, 8, 6, 0), zlib.compress(bytes(1200)))
    assert refusal(short) == "the PNG's IDAT data inflates to 1200 bytes where a 20×20 RGBA image needs 1620"
    with pytest.raises(OSError):
        displayed(short)
    cut = built_png((20, 20, 8, 6, 0), zlib.compress(bytes(1620))[:-8])
    assert refusal(cut).startswith("the PNG's IDAT data is cut short after inflating to ")
    long = built_png((20, 20, 16, 0, 1), zlib.compress(bytes(2000)))
    assert refusal(long) == (
        "the PNG's IDAT data inflates to more than the 838 bytes a 20×20 16-bit greyscale interlaced image needs"
    )
    bad_filter = built_png((20, 20, 8, 0, 0), zlib.compress(bytes(399) + b"\x05" + bytes(20)))
    assert refusal(bad_filter) == "the PNG's image data has the unknown row filter 5"
    with pytest.raises(OSError):
        displayed(bad_filter)
    assert refusal(built_png((20, 20, 8, 0, 0), b"not zlib")).startswith("the PNG's IDAT data is not a valid zlib")
    assert refusal(data + b"\x00") == "the PNG goes on for 1 byte(s) after its IEND chunk"
    assert refusal(built_png((4, 4, 3, 2, 0), b"")) == (
        "the PNG's IHDR gives bit depth 3 with colour type 2, which PNG forbids"
    )
    assert refusal(built_png((0, 4, 8, 2, 0), b"")) == "the PNG's IHDR gives the impossible size 0×4"
    assert refusal(built_png((4, 4, 8, 2, 2), b"")) == (
        "the PNG's IHDR names an unknown compression, filter or interlace method (0, 0, 2)"
    )
    assert refusal(built_png((4, 4, 8, 3, 0), zlib.compress(bytes(20)))) == (
        "the palette PNG has no PLTE chunk before its image data"
    )
    text = chunk(b"tEXt", b"Comment\x00hi")
    split = data[:33] + chunk(b"IDAT", b"x") + text + data[33:]
    assert refusal(split) == "the PNG's IDAT chunks are not consecutive"
    no_idat = data[:33] + chunk(b"IEND", b"")
    assert refusal(no_idat) == "the PNG has no IDAT chunk: it holds no image data"
    assert refusal(data[:8] + data[33:]) == "the PNG's first chunk is IDAT where IHDR must be"


def test_a_png_bomb_stops_at_the_size_it_claims() -> None:
    """Twenty megabytes of zeros compress to twenty kilobytes: inflating stops one byte past what the image needs."""
    bomb = built_png((1000, 1000, 8, 0, 0), zlib.compress(bytes(20_000_000), 9))
    assert len(bomb) < 30_000
    assert refusal(bomb) == (
        "the PNG's IDAT data inflates to more than the 1001000 bytes a 1000×1000 greyscale image needs"
    )
    huge = built_png((100_000, 100_000, 8, 0, 0), zlib.compress(bytes(1000)))
    assert refusal(huge) == "the PNG is 100000×100000, more than the 2147483648 pixels allowed"
    with pytest.raises(ImageUnreadable, match="the JPEG is 37×23, more than the 100 pixels allowed"):
        read_image(SAMPLES["jpeg"], max_pixels=100)


def test_a_damaged_jpeg_says_what_is_wrong() -> None:
    data = encoded(picture("RGB", (37, 23)), "JPEG")
    sof = data.index(b"\xff\xc0")
    twelve_bit = data[: sof + 4] + b"\x0c" + data[sof + 5 :]
    assert refusal(twelve_bit) == "the JPEG has 12-bit samples; only 8-bit JPEGs decode"
    with pytest.raises(OSError):
        displayed(twelve_bit)
    no_height = data[: sof + 5] + b"\x00\x00" + data[sof + 7 :]
    assert refusal(no_height) == "the JPEG's frame header gives the size 37×0"
    assert refusal(data[:-2]) == "the JPEG is cut short inside its image data: it has no EOI marker"
    assert refusal(data[:sof] + b"\xff\xd9") == "the JPEG ends (EOI) before any scan of image data"
    assert refusal(data[:sof] + b"\x00" + data[sof:]) == (
        f"the JPEG has the byte 0x00 at offset {sof} where a marker must be"
    )
    sos = data.index(b"\xff\xda")
    assert refusal(data[:sof] + data[sos:]) == "the JPEG has a scan (SOS) before its frame header (SOF)"
    assert refusal(data[:sof] + b"\xff\xdb\xff\xff" + data[sof:]) == (
        "the JPEG's 0xFFDB segment runs past the end of the data (cut short)"
    )
    hierarchical = data[: sof + 1] + b"\xc5" + data[sof + 2 :]
    assert refusal(hierarchical) == f"the JPEG has the marker 0xFFC5 at offset {sof}, which decoders refuse"
    with pytest.raises(OSError):
        displayed(hierarchical)
    dht = data.index(b"\xff\xc4")
    assert refusal(data[: dht + 5] + b"\xff" + data[dht + 6 :]) == "the JPEG has a malformed Huffman table"
    dqt = data.index(b"\xff\xdb")
    assert refusal(data[: dqt + 4] + b"\x10" + data[dqt + 5 :]) == "the JPEG has a malformed quantization table"
    two = data[: sof + 9] + b"\x02" + data[sof + 10 :]
    two = two[: sof + 2] + struct.pack(">H", 8 + 3 * 2) + two[sof + 4 : sof + 10 + 6] + two[sof + 10 + 9 :]
    assert refusal(two) == "the JPEG has 2 colour components where 1, 3 or 4 decode"


def test_a_damaged_gif_or_webp_says_what_is_wrong() -> None:
    gif = encoded(picture("P", (37, 23)), "GIF")
    assert refusal(gif[:-1]) == "the GIF is cut short: it ends before its trailer"
    assert refusal(gif[: 13 + 768] + b";") == "the GIF holds no image"
    assert refusal(gif[: 13 + 768] + b"!") == "the GIF is cut short inside a block"
    assert refusal(gif[: 13 + 768] + b"\x99;") == "the GIF has the unknown block type 0x99 at offset 781"
    lzw = gif.index(b",\x00\x00\x00\x00%\x00\x17\x00") + 10  # the image descriptor: at (0, 0), 37×23
    assert (
        refusal(gif[:lzw] + b"\x0c" + gif[lzw + 1 :])
        == "the GIF has an image with the LZW code size 12 (2 to 8 are valid)"
    )
    webp = encoded(picture("RGB", (37, 23)), "WEBP")
    assert (
        refusal(webp[:-1])
        == f"the WebP is cut short: its RIFF header promises {len(webp)} bytes and there are {len(webp) - 1}"
    )
    assert refusal(webp.replace(b"\x9d\x01\x2a", b"\x9d\x01\x2b")) == (
        "the WebP's lossy (VP8) bitstream has no valid key frame header"
    )
    assert (
        refusal(webp.replace(b"VP8 ", b"VP9 "))
        == "the WebP starts with b'VP9 ' where a VP8, VP8L or VP8X chunk must be"
    )
    assert read_image(webp + b"trailing") == ImageHeader(WEBP, 37, 23, 1)
    alpha = encoded(picture("RGBA", (37, 23)), "WEBP")
    vp8x = alpha.index(b"VP8X") + 12
    wider = alpha[:vp8x] + b"\x27" + alpha[vp8x + 1 :]
    assert refusal(wider) == "the WebP's 37×23 image does not fill its 40×23 canvas"
    animated = SAMPLES["webp animated"]
    anmf = animated.index(b"ANMF") + 8
    shifted = animated[:anmf] + b"\x01" + animated[anmf + 1 :]
    assert refusal(shifted) == "the WebP has an animation frame (37×23 at (2, 0)) outside its 37×23 canvas"
    with pytest.raises(OSError):
        displayed(shifted)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "the image data is empty"),
        (b"hello, world", "the image data is not a known image format"),
        (
            b"data:image/png;base64,iVBORw0KGgo=",
            "the image data is a data: URL (its prefix was left on the image bytes)",
        ),
        (b'<svg xmlns="http://www.w3.org/2000/svg"/>', "the image data is markup text (SVG, HTML or XML)"),
        (b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00", "the image data is an HEIF or AVIF image"),
        (encoded(picture("RGB", (5, 5)), "BMP"), "the image data is a BMP image"),
        (encoded(picture("RGB", (5, 5)), "TIFF"), "the image data is a TIFF image"),
    ],
)
def test_other_bytes_are_refused_by_name(data: bytes, message: str) -> None:
    assert refusal(data) == (message + "; only PNG, JPEG, GIF and WebP images are accepted" if data else message)


MAGIC = [b"", b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF89a", b"RIFF\x40\x00\x00\x00WEBP", *(
    sample[:cut] for sample in SAMPLES.values() for cut in (16, 40)
)]  # fmt: skip


@settings(max_examples=examples(400), deadline=None)
@given(head=st.sampled_from(MAGIC), tail=st.binary(max_size=300))
def test_any_bytes_give_a_header_or_a_refusal(head: bytes, tail: bytes) -> None:
    """Whatever follows a magic number or the start of a real image, the reader answers and raises nothing else."""
    try:
        header = read_image(head + tail)
    except ImageUnreadable as exc:
        assert str(exc).startswith("the ")
    else:
        assert header.width >= 1 and header.height >= 1 and 1 <= header.orientation <= 8
