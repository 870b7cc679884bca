"""Reads the images agents send to vision-language models: their format, displayed size and whether they decode.

Why this module is long: the proxy must count each image's tokens from its displayed size and refuse one the engine
could not decode, without a pixel decoder in the addon, so it walks each of four formats (PNG, JPEG, GIF, WebP) as far
as their structure goes, and says in words what it found wrong. The four walks share one question, one error, one
orientation rule, and one caller; split up, each would be a small module that makes sense only beside the others.

The format is sniffed from the magic bytes: agents declare media types loosely, and the engines (PIL under vLLM and
SGLang) sniff too. The size is the one the engine's processor sees after `ImageOps.exif_transpose`, which is what
transformers' `load_image` calls: EXIF orientations 5 to 8 swap width and height. PIL takes the orientation from the
EXIF block (a JPEG's APP1, a PNG's eXIf chunk, a WebP's EXIF chunk) and, where that has no Orientation tag, from an
XMP packet's `tiff:Orientation`; so does this reader.

"Decodes" means structurally whole, checked as far as is cheap without decoding pixels: a PNG's every chunk CRC and
the exact inflated size of its image data with each row's filter byte, a JPEG's marker segments, tables and scans up
to an EOI, a GIF's blocks up to its trailer, a WebP's RIFF chunks and bitstream headers. What only a pixel decoder
sees (a bad Huffman code, a bad LZW code, a broken VP8 partition) passes here and fails in the engine. Where PIL or
libjpeg read past damage (junk between JPEG segments, a GIF without its trailer, a PNG IDAT whose CRC is wrong), this
reader refuses: the image is damaged, whatever a lenient decoder makes of it.
"""

from __future__ import annotations

import re
import struct
import zlib
from dataclasses import dataclass
from enum import StrEnum


class ImageFormat(StrEnum):
    """The formats every engine's image loader opens; named as in their media types."""

    PNG = "png"
    JPEG = "jpeg"
    GIF = "gif"
    WEBP = "webp"

    @property
    def media_type(self) -> str:
        """The media type the bytes really have, to declare in place of what the agent declared."""
        return f"image/{self.value}"


#: Declared media types an agent may send, including the common misspelling `image/jpg`.
MEDIA_TYPES: dict[str, ImageFormat] = {
    "image/png": ImageFormat.PNG,
    "image/jpeg": ImageFormat.JPEG,
    "image/jpg": ImageFormat.JPEG,
    "image/gif": ImageFormat.GIF,
    "image/webp": ImageFormat.WEBP,
}


@dataclass(frozen=True)
class ImageHeader:
    """What token counting needs: the size the engine sees once it has turned the image upright."""

    format: ImageFormat
    width: int  # as displayed, after the orientation
    height: int
    orientation: int  # the EXIF orientation 1..8 the engine applies; 1 when absent or out of range


class ImageUnreadable(ValueError):
    """The bytes are no image the engine could decode; the message says what is wrong, in words for the agent."""


_NAMES = {ImageFormat.PNG: "PNG", ImageFormat.JPEG: "JPEG", ImageFormat.GIF: "GIF", ImageFormat.WEBP: "WebP"}
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: Rejected formats named in the refusal, so an agent learns what it sent.
_OTHER_FORMATS = (
    (b"BM", "a BMP image"),
    (b"II*\x00", "a TIFF image"),
    (b"MM\x00*", "a TIFF image"),
    (b"data:", "a data: URL (its prefix was left on the image bytes)"),
    (b"\x00\x00\x00\x0cjP  ", "a JPEG 2000 image"),
)
#: The largest width × height read by default: a decompression bomb past it is refused before anything is inflated.
MAX_PIXELS = 2**31
_XMP_ORIENTATION = re.compile(rb'tiff:Orientation(="|>)([0-9])')  # PIL's own pattern (Image.getexif)


def sniff_format(data: bytes) -> ImageFormat | None:
    """The format the magic bytes announce, or None; says nothing of whether the rest is whole."""
    if data.startswith(_PNG_SIGNATURE):
        return ImageFormat.PNG
    if data.startswith(b"\xff\xd8\xff"):
        return ImageFormat.JPEG
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return ImageFormat.GIF
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return ImageFormat.WEBP
    return None


def read_image(data: bytes, *, max_pixels: int = MAX_PIXELS) -> ImageHeader:
    """The image's format and displayed size, once its structure is found whole; ImageUnreadable for any other bytes.

    `max_pixels` bounds width × height before a PNG's data is inflated, so that a caller's own limit also bounds
    the work done here (the stored size is what a bomb lies about, and inflating is what it costs).
    """
    fmt = sniff_format(data)
    if fmt is None:
        raise ImageUnreadable(_not_an_image(data))
    try:
        width, height, orientation = _READERS[fmt](data, max_pixels)
    except ImageUnreadable:
        raise
    except (struct.error, IndexError, ValueError, zlib.error, OverflowError) as exc:
        raise ImageUnreadable(f"the {_NAMES[fmt]} is cut short or malformed ({exc})") from exc
    _check_pixels(fmt, width, height, max_pixels)
    if orientation >= 5:
        width, height = height, width
    return ImageHeader(fmt, width, height, orientation)


def _not_an_image(data: bytes) -> str:
    if not data:
        return "the image data is empty"
    what = next((name for prefix, name in _OTHER_FORMATS if data.startswith(prefix)), None)
    if what is None and data[4:8] == b"ftyp":
        what = "an HEIF or AVIF image"
    elif what is None and data.lstrip()[:1] == b"<":
        what = "markup text (SVG, HTML or XML)"
    elif what is None:
        what = "not a known image format"
    return f"the image data is {what}; only PNG, JPEG, GIF and WebP images are accepted"


def _check_pixels(fmt: ImageFormat, width: int, height: int, max_pixels: int) -> None:
    if width < 1 or height < 1:
        raise ImageUnreadable(f"the {_NAMES[fmt]} gives the empty size {width}×{height}")
    if width * height > max_pixels:
        raise ImageUnreadable(f"the {_NAMES[fmt]} is {width}×{height}, more than the {max_pixels} pixels allowed")


def _orientation(exif: bytes | None, xmp: bytes | None) -> int:
    """PIL's rule: the EXIF tag where the EXIF block has one, else XMP's; `exif_transpose` acts on 2..8 only."""
    value = _exif_orientation(exif) if exif else None
    if value is None and xmp:
        match = _XMP_ORIENTATION.search(xmp)
        value = int(match[2]) if match else None
    return value if value is not None and 1 <= value <= 8 else 1


def _exif_orientation(tiff: bytes) -> int | None:
    """The Orientation tag (0x0112) of IFD0 in a TIFF-structured EXIF block, read as PIL reads it (an integer type;
    the first of several values; values past the block's end skip the tag), None where absent or unreadable: a
    broken EXIF block does not stop the engine's decoder, so it must not refuse the image here either."""
    if tiff.startswith(b"Exif\x00\x00"):
        tiff = tiff[6:]
    order = {b"II*\x00": "<", b"MM\x00*": ">"}.get(tiff[:4])
    if order is None:
        return None
    try:
        ifd = struct.unpack_from(order + "I", tiff, 4)[0]
        for entry in range(ifd + 2, ifd + 2 + 12 * struct.unpack_from(order + "H", tiff, ifd)[0], 12):
            tag, kind, count, where = struct.unpack_from(order + "HHII", tiff, entry)
            if tag == 0x0112:
                code = {3: "H", 4: "I", 8: "h", 9: "i"}.get(kind, "") if count else ""
                inline = count * struct.calcsize(code or "I") <= 4
                return struct.unpack_from(order + code, tiff, entry + 8 if inline else where)[0] if code else None
    except struct.error:
        pass
    return None


# PNG --------------------------------------------------------------------------------------------------------------

_PNG_DEPTHS = {0: (1, 2, 4, 8, 16), 2: (8, 16), 3: (1, 2, 4, 8), 4: (8, 16), 6: (8, 16)}
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
_PNG_KINDS = {0: "greyscale", 2: "RGB", 3: "palette", 4: "greyscale+alpha", 6: "RGBA"}
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
_PNG_XMP_KEY = b"XML:com.adobe.xmp"
_PIECE = 1 << 20  # inflated per step, so a PNG's image data is never held whole


def _read_png(data: bytes, max_pixels: int) -> tuple[int, int, int]:
    pos, size, previous = 8, len(data), b""
    ihdr: tuple[int, int, int, int, int] | None = None
    idat: list[bytes] = []
    exif = xmp = None
    palette = False
    while True:
        if pos + 12 > size:
            raise ImageUnreadable("the PNG is cut short: it ends before its IEND chunk")
        length, kind = struct.unpack_from(">I4s", data, pos)
        body, pos = data[pos + 8 : pos + 8 + length], pos + 12 + length
        if pos > size:
            raise ImageUnreadable(f"the PNG's {kind!r} chunk runs past the end of the data (it is cut short)")
        if not kind.isalpha():
            raise ImageUnreadable(f"the PNG has a chunk with the malformed type {kind!r}")
        if zlib.crc32(body, zlib.crc32(kind)) != struct.unpack_from(">I", data, pos - 4)[0]:
            raise ImageUnreadable(f"the PNG's {kind.decode()} chunk fails its CRC check (its bytes are damaged)")
        if ihdr is None:
            if kind != b"IHDR":
                raise ImageUnreadable(f"the PNG's first chunk is {kind.decode()} where IHDR must be")
            ihdr = _png_ihdr(body)
            _check_pixels(ImageFormat.PNG, ihdr[0], ihdr[1], max_pixels)
        elif kind == b"IHDR":
            raise ImageUnreadable("the PNG has a second IHDR chunk")
        elif kind == b"IDAT":
            if idat and previous != b"IDAT":
                raise ImageUnreadable("the PNG's IDAT chunks are not consecutive")
            if ihdr[3] == 3 and not palette:
                raise ImageUnreadable("the palette PNG has no PLTE chunk before its image data")
            idat.append(body)
        elif kind == b"PLTE" and ihdr[3] == 3:
            if not length or length % 3 or length > 768:
                raise ImageUnreadable(f"the PNG's PLTE chunk is {length} bytes, not 3 for each of 1 to 256 colours")
            palette = True
        elif kind == b"eXIf":
            exif = body
        elif kind in (b"tEXt", b"zTXt", b"iTXt") and body.partition(b"\x00")[0] == _PNG_XMP_KEY:
            xmp = _png_text(kind, body)
        elif kind == b"IEND":
            break
        previous = kind
    if pos != size:
        raise ImageUnreadable(f"the PNG goes on for {size - pos} byte(s) after its IEND chunk")
    if not idat:
        raise ImageUnreadable("the PNG has no IDAT chunk: it holds no image data")
    assert ihdr is not None  # IEND came after it
    _inflate_png(b"".join(idat), ihdr)
    return ihdr[0], ihdr[1], _orientation(exif, xmp)


def _png_ihdr(body: bytes) -> tuple[int, int, int, int, int]:
    if len(body) != 13:
        raise ImageUnreadable(f"the PNG's IHDR chunk is {len(body)} bytes long where it must be 13")
    width, height, depth, colour, compression, filtering, interlace = struct.unpack(">IIBBBBB", body)
    if not (0 < width < 2**31 and 0 < height < 2**31):
        raise ImageUnreadable(f"the PNG's IHDR gives the impossible size {width}×{height}")
    if depth not in _PNG_DEPTHS.get(colour, ()):
        raise ImageUnreadable(f"the PNG's IHDR gives bit depth {depth} with colour type {colour}, which PNG forbids")
    if compression or filtering or interlace > 1:
        methods = f"{compression}, {filtering}, {interlace}"
        raise ImageUnreadable(f"the PNG's IHDR names an unknown compression, filter or interlace method ({methods})")
    return width, height, depth, colour, interlace


def _png_rows(width: int, height: int, bits: int, interlace: int) -> list[tuple[int, int]]:
    """Each pass's (rows, bytes per row with its filter byte); a pass with no pixels has no rows, no filter bytes."""
    rows = []
    for x0, y0, dx, dy in _ADAM7 if interlace else ((0, 0, 1, 1),):
        pass_width, pass_height = (width - x0 + dx - 1) // dx, (height - y0 + dy - 1) // dy
        if pass_width > 0 and pass_height > 0:
            rows.append((pass_height, 1 + (pass_width * bits + 7) // 8))
    return rows


def _inflate_png(stream: bytes, ihdr: tuple[int, int, int, int, int]) -> None:
    """Inflates the image data a piece at a time, capped one byte past the size the image needs (so a bomb stops
    there), checking every row's filter byte on the way. The input goes in in slices too: zlib copies what it has
    not consumed at every step, which over the whole stream would cost its square."""
    width, height, depth, colour, interlace = ihdr
    rows = _png_rows(width, height, depth * _PNG_CHANNELS[colour], interlace)
    need = sum(count * stride for count, stride in rows)
    depth_name = "" if depth == 8 else f"{depth}-bit "
    image = f"{width}×{height} {depth_name}{_PNG_KINDS[colour]}{' interlaced' if interlace else ''} image"
    schedule, rows_left, stride, next_row = iter(rows), 0, 0, 0
    inflater, got, view = zlib.decompressobj(), 0, memoryview(stream)
    try:
        for start in range(0, len(stream), _PIECE):
            pending: bytes | memoryview = view[start : start + _PIECE]
            while pending and not inflater.eof:
                piece = inflater.decompress(pending, min(_PIECE, need + 1 - got))
                stalled, pending = not piece and len(inflater.unconsumed_tail) == len(pending), inflater.unconsumed_tail
                while next_row < min(got + len(piece), need):
                    if not rows_left:
                        rows_left, stride = next(schedule)
                    if piece[next_row - got] > 4:
                        raise ImageUnreadable(
                            f"the PNG's image data has the unknown row filter {piece[next_row - got]}"
                        )
                    next_row, rows_left = next_row + stride, rows_left - 1
                got += len(piece)
                if got > need:
                    raise ImageUnreadable(f"the PNG's IDAT data inflates to more than the {need} bytes a {image} needs")
                if stalled:
                    break
    except zlib.error as exc:
        raise ImageUnreadable(f"the PNG's IDAT data is not a valid zlib stream ({exc})") from exc
    if got < need:
        ends = "inflates to" if inflater.eof else "is cut short after inflating to"
        raise ImageUnreadable(f"the PNG's IDAT data {ends} {got} bytes where a {image} needs {need}")


def _png_text(kind: bytes, body: bytes) -> bytes | None:
    """A text chunk's text as PIL reads it, inflated (to at most 1 MiB) where compressed; None where unreadable."""
    rest = body.partition(b"\x00")[2]
    if kind == b"tEXt":
        return rest
    if kind == b"zTXt":
        flag, method, text = 1, rest[:1], rest[1:]
    else:
        parts = rest[2:].split(b"\x00", 2)
        if len(rest) < 2 or len(parts) < 3:
            return None
        flag, method, text = rest[0], rest[1:2], parts[2]
    if not flag:
        return text
    try:
        return zlib.decompressobj().decompress(text, 1 << 20) if method == b"\x00" else None
    except zlib.error:
        return None


# JPEG -------------------------------------------------------------------------------------------------------------

_JPEG_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC9, 0xCA, 0xCB})  # what libjpeg decodes: not the hierarchical ones
#: Markers libjpeg stops at: the hierarchical frames and their DHP and EXP, the reserved JPG and JPGn, RESn, a
#: second SOI; and TEM, on which PIL's header parser stops.
_JPEG_REFUSED = frozenset({*range(0x01, 0xC0), 0xC5, 0xC6, 0xC7, 0xC8, 0xCD, 0xCE, 0xCF, 0xD8, 0xDE, 0xDF})
_JPEG_REFUSED |= frozenset(range(0xF0, 0xFE))
_JPEG_XMP = b"http://ns.adobe.com/xap/1.0/\x00"


def _read_jpeg(data: bytes, max_pixels: int) -> tuple[int, int, int]:
    pos, size, scans = 2, len(data), 0
    frame: tuple[int, int] | None = None
    exif = xmp = None
    while True:
        if pos < size and data[pos] != 0xFF:
            raise ImageUnreadable(f"the JPEG has the byte 0x{data[pos]:02X} at offset {pos} where a marker must be")
        while pos < size and data[pos] == 0xFF:  # a marker and its fill bytes
            pos += 1
        if pos + 1 > size:
            raise ImageUnreadable("the JPEG is cut short: it ends before its EOI marker")
        marker, pos = data[pos], pos + 1
        if marker == 0xD9:
            if not scans:
                raise ImageUnreadable("the JPEG ends (EOI) before any scan of image data")
            break  # bytes after it (a camera's trailer) are ignored by decoders
        if 0xD0 <= marker <= 0xD7:
            continue
        if marker in _JPEG_REFUSED or not marker:
            raise ImageUnreadable(
                f"the JPEG has the marker 0xFF{marker:02X} at offset {pos - 2}, which decoders refuse"
            )
        if pos + 2 > size or pos + int.from_bytes(data[pos : pos + 2]) > size:
            raise ImageUnreadable(f"the JPEG's 0xFF{marker:02X} segment runs past the end of the data (cut short)")
        length = int.from_bytes(data[pos : pos + 2])
        if length < 2:
            raise ImageUnreadable(f"the JPEG's 0xFF{marker:02X} segment has the impossible length {length}")
        body, pos = data[pos + 2 : pos + length], pos + length
        if marker in _JPEG_SOF:
            if frame:
                raise ImageUnreadable("the JPEG has a second frame header (SOF)")
            frame = _jpeg_frame(body)
        elif marker == 0xDA:
            if frame is None:
                raise ImageUnreadable("the JPEG has a scan (SOS) before its frame header (SOF)")
            if not body or not 1 <= body[0] <= 4 or len(body) != 4 + 2 * body[0]:
                raise ImageUnreadable("the JPEG has a malformed scan header (SOS)")
            pos, scans = _jpeg_scan_end(data, pos), scans + 1
        elif marker in (0xC4, 0xDB):
            _jpeg_tables(marker, body)
        elif marker == 0xE1 and not scans and body.startswith(b"Exif\x00\x00"):  # PIL reads up to the first scan
            exif = body if exif is None else exif + body[6:]  # and joins them so
        elif marker == 0xE1 and not scans and body.startswith(_JPEG_XMP):
            xmp = body[len(_JPEG_XMP) :]
    assert frame is not None  # a scan needs one
    return frame[0], frame[1], _orientation(exif, xmp)


def _jpeg_frame(body: bytes) -> tuple[int, int]:
    """Width and height, once the frame is one PIL decodes: 8-bit samples, 1 (L), 3 (RGB) or 4 (CMYK) components."""
    if len(body) < 6 or len(body) != 6 + 3 * body[5]:
        raise ImageUnreadable("the JPEG has a malformed frame header (SOF)")
    precision, height, width, components = struct.unpack_from(">BHHB", body)
    if precision != 8:
        raise ImageUnreadable(f"the JPEG has {precision}-bit samples; only 8-bit JPEGs decode")
    if not width or not height:
        raise ImageUnreadable(f"the JPEG's frame header gives the size {width}×{height}")
    if components not in (1, 3, 4):
        raise ImageUnreadable(f"the JPEG has {components} colour components where 1, 3 or 4 decode")
    return width, height


def _jpeg_tables(marker: int, body: bytes) -> None:
    """PIL's check of quantization tables (DQT) and libjpeg's of Huffman tables (DHT): each whole in its segment."""
    pos, name = 0, "quantization" if marker == 0xDB else "Huffman"
    while pos < len(body):
        if marker == 0xDB:
            pos += 1 + 64 * (1 if body[pos] < 16 else 2)
        else:
            count = sum(body[pos + 1 : pos + 17])
            pos += 17 + (count if count <= 256 else len(body))
        if pos > len(body):
            raise ImageUnreadable(f"the JPEG has a malformed {name} table")


def _jpeg_scan_end(data: bytes, start: int) -> int:
    """Where the marker after a scan's entropy-coded data starts: inside the data 0xFF is followed by 0x00 (a
    stuffed byte) or a restart marker, and 0xFF runs are fill before a marker."""
    pos = start
    while True:
        pos = data.find(b"\xff", pos)
        if pos < 0 or pos + 1 >= len(data):
            raise ImageUnreadable("the JPEG is cut short inside its image data: it has no EOI marker")
        following = data[pos + 1]
        if following == 0 or 0xD0 <= following <= 0xD7:
            pos += 2
        elif following == 0xFF:
            pos += 1
        elif pos == start:
            raise ImageUnreadable("the JPEG has a scan with no entropy-coded data")
        else:
            return pos


# GIF --------------------------------------------------------------------------------------------------------------


def _read_gif(data: bytes, max_pixels: int) -> tuple[int, int, int]:
    """PIL's size: the logical screen, grown to hold the first frame where that frame reaches past it."""
    width, height, flags = struct.unpack_from("<HHB", data, 6)
    pos, images = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0), 0
    while True:
        if pos >= len(data):
            raise ImageUnreadable("the GIF is cut short: it ends before its trailer")
        block = data[pos]
        if block == 0x3B:
            break
        if block == 0x21:
            pos = _gif_sub_blocks(data, pos + 2)
        elif block == 0x2C:
            left, top, frame_width, frame_height, flags = struct.unpack_from("<HHHHB", data, pos + 1)
            if not images:
                width, height = max(width, left + frame_width), max(height, top + frame_height)
            pos += 10 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
            if pos >= len(data):
                raise ImageUnreadable("the GIF is cut short inside an image")
            if not 2 <= data[pos] <= 8:
                raise ImageUnreadable(f"the GIF has an image with the LZW code size {data[pos]} (2 to 8 are valid)")
            pos, images = _gif_sub_blocks(data, pos + 1), images + 1
        else:
            raise ImageUnreadable(f"the GIF has the unknown block type 0x{block:02X} at offset {pos}")
    if not images:
        raise ImageUnreadable("the GIF holds no image")
    return width, height, 1


def _gif_sub_blocks(data: bytes, pos: int) -> int:
    """Where the data sub-blocks starting at `pos` end, after their empty terminator."""
    while True:
        if pos >= len(data):
            raise ImageUnreadable("the GIF is cut short inside a block")
        length = data[pos]
        pos += 1 + length
        if not length:
            return pos


# WebP -------------------------------------------------------------------------------------------------------------


def _read_webp(data: bytes, max_pixels: int) -> tuple[int, int, int]:
    """The canvas's size; libwebp's demuxer (what PIL opens WebP with) ignores bytes after the RIFF data."""
    end = 8 + struct.unpack_from("<I", data, 4)[0]
    if end > len(data):
        raise ImageUnreadable(f"the WebP is cut short: its RIFF header promises {end} bytes and there are {len(data)}")
    chunks = _webp_chunks(data, 12, end)
    kind, body = chunks[0] if chunks else (b"", b"")
    if kind in (b"VP8 ", b"VP8L"):
        width, height = _webp_bitstream(kind, body)
        return width, height, 1
    if kind != b"VP8X" or len(body) < 10:
        raise ImageUnreadable(f"the WebP starts with {kind!r} where a VP8, VP8L or VP8X chunk must be")
    flags = body[0]
    width, height = int.from_bytes(body[4:7], "little") + 1, int.from_bytes(body[7:10], "little") + 1
    found = dict(reversed(chunks))  # the first chunk of each kind
    frames = [body for kind, body in chunks if kind == b"ANMF"]
    if flags & 0x02 and frames:  # animated; libwebp reads frames only where VP8X flags an animation
        if b"ANIM" not in found:
            raise ImageUnreadable("the animated WebP has no ANIM chunk")
        for frame in frames:
            _webp_frame(frame, width, height)
    else:
        first = next((i for i, (kind, _) in enumerate(chunks) if kind in (b"ALPH", b"VP8 ", b"VP8L")), len(chunks))
        image = _webp_image(chunks[first:])
        if image != (width, height):
            raise ImageUnreadable(
                f"the WebP's {'×'.join(map(str, image))} image does not fill its {width}×{height} canvas"
            )
    exif = found.get(b"EXIF") if flags & 0x08 else None  # libwebp keeps these only where VP8X flags them
    xmp = found.get(b"XMP ") if flags & 0x04 else None
    return width, height, _orientation(exif, xmp)


def _webp_chunks(data: bytes, pos: int, end: int) -> list[tuple[bytes, bytes]]:
    """Each RIFF chunk's (fourcc, payload) from `pos` to `end`; the last one's pad byte may be missing."""
    chunks = []
    while pos < end:
        if pos + 8 > end:
            raise ImageUnreadable(f"the WebP has a chunk header cut short at offset {pos}")
        kind, length = struct.unpack_from("<4sI", data, pos)
        if pos + 8 + length > end:
            raise ImageUnreadable(f"the WebP's {kind!r} chunk runs past the end of its data (it is cut short)")
        chunks.append((kind, data[pos + 8 : pos + 8 + length]))
        pos += 8 + length + (length & 1)
    return chunks


def _webp_bitstream(kind: bytes, body: bytes) -> tuple[int, int]:
    """The size in a VP8 key frame's or a VP8L image's header, with libwebp's own checks of that header."""
    if kind == b"VP8L":
        if len(body) < 5 or body[0] != 0x2F or body[4] >> 5:
            raise ImageUnreadable("the WebP's lossless (VP8L) bitstream has no valid header")
        bits = int.from_bytes(body[1:5], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if len(body) < 10 or body[3:6] != b"\x9d\x01\x2a":
        raise ImageUnreadable("the WebP's lossy (VP8) bitstream has no valid key frame header")
    tag = int.from_bytes(body[0:3], "little")
    if tag & 1 or (tag >> 1) & 7 > 3 or not (tag >> 4) & 1 or tag >> 5 >= len(body):
        raise ImageUnreadable("the WebP's lossy (VP8) frame tag is not a displayable key frame that fits its chunk")
    width, height = int.from_bytes(body[6:8], "little") & 0x3FFF, int.from_bytes(body[8:10], "little") & 0x3FFF
    if not width or not height:
        raise ImageUnreadable(f"the WebP's lossy (VP8) bitstream gives the empty size {width}×{height}")
    return width, height


def _webp_image(chunks: list[tuple[bytes, bytes]]) -> tuple[int, int]:
    """The size of the image at the head of `chunks`, read as libwebp reads a frame: an optional ALPH chunk, then
    straight after it the VP8 or VP8L bitstream (any other chunk ends the frame, imageless)."""
    if chunks and chunks[0][0] == b"ALPH":
        chunks = chunks[1:]
    if not chunks or chunks[0][0] not in (b"VP8 ", b"VP8L"):
        raise ImageUnreadable("the WebP has a frame with no VP8 or VP8L image in it")
    return _webp_bitstream(*chunks[0])


def _webp_frame(frame: bytes, width: int, height: int) -> None:
    """An animation frame whose image lies on the canvas (libwebp sizes a frame by its bitstream)."""
    if len(frame) < 16:
        raise ImageUnreadable("the WebP has an animation frame (ANMF) whose header is cut short")
    x, y = 2 * int.from_bytes(frame[0:3], "little"), 2 * int.from_bytes(frame[3:6], "little")
    frame_width, frame_height = _webp_image(_webp_chunks(frame, 16, len(frame)))
    if x + frame_width > width or y + frame_height > height:
        where = f"{frame_width}×{frame_height} at ({x}, {y})"
        raise ImageUnreadable(f"the WebP has an animation frame ({where}) outside its {width}×{height} canvas")


_READERS = {
    ImageFormat.PNG: _read_png,
    ImageFormat.JPEG: _read_jpeg,
    ImageFormat.GIF: _read_gif,
    ImageFormat.WEBP: _read_webp,
}
