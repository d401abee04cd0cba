"""Decode, normalise and resize one image to the grid of ``vision.geometry``, with bounded work per image.

The pixel count is checked from the header before any pixel is decoded (decompression bombs never allocate), EXIF
orientation is applied, every mode (CMYK, 16-bit, palette with transparency, alpha) becomes 8-bit RGB (alpha composited
on white), and the result is re-encoded as JPEG, or with ``lossless=True`` as PNG when the source was lossless (PNG
costs about 10x the bytes and the encode time of JPEG, so it is opt-in). Each failure has a reason string that becomes
the dead-letter reason.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import warnings
from collections import OrderedDict
from pathlib import Path

from PIL import Image, ImageOps, UnidentifiedImageError

from vision.geometry import GeometryError, VisionPolicy, target_size

__all__ = ["ImageError", "DecodedImage", "decode_image", "resolve_image_ref", "ImageCache"]

JPEG_QUALITY = 90
_LOSSLESS_FORMATS = frozenset({"PNG", "GIF", "BMP", "TIFF", "WEBP_LOSSLESS", "PPM"})
# Pillow's own bomb guard fires at twice MAX_IMAGE_PIXELS; our header check runs first with the policy's bound.
Image.MAX_IMAGE_PIXELS = None


class ImageError(ValueError):
    """An image that cannot enter a sample; ``reason`` is a short dead-letter reason."""

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}")


@dataclasses.dataclass(frozen=True, slots=True)
class DecodedImage:
    data: bytes  # encoded bytes of the resized image
    ext: str  # "jpg" or "png"
    width: int  # resized size: multiples of the policy's merged patch
    height: int
    source_width: int
    source_height: int


def resolve_image_ref(ref: str, root: Path | None) -> bytes:
    """Bytes of a referenced image, which must lie inside ``root`` (no ``..`` or absolute escapes)."""
    if root is None:
        raise ImageError("missing_image", f"reference {ref!r} but no --image-root was given")
    base = root.resolve()
    path = (base / ref).resolve()
    if not path.is_relative_to(base):
        raise ImageError("image_ref_escapes_root", f"reference {ref!r} resolves outside {base}")
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ImageError("missing_image", f"reference {ref!r} not found under {base}") from None
    except OSError as exc:
        raise ImageError("missing_image", f"reference {ref!r}: {exc}") from None


def _to_rgb(im: Image.Image) -> Image.Image:
    if im.mode == "P":
        im = im.convert("RGBA" if "transparency" in im.info else "RGB")
    if im.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        # 16/32-bit grey: scale to 8 bits by the value range of the mode, not by clipping.
        im = im.point(lambda v: v / 256).convert("L") if im.mode.startswith("I;16") else im.convert("L")
    if im.mode in ("RGBA", "LA", "PA") or (im.mode != "RGB" and "A" in im.getbands()):
        rgba = im.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return im.convert("RGB")


def decode_image(data: bytes, policy: VisionPolicy, *, lossless: bool = False) -> DecodedImage:
    """Decode ``data`` and resize it to ``target_size``; raises :class:`ImageError` with a reason."""
    if not data:
        raise ImageError("empty_image", "zero bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))
            width, height = im.size
            if width * height > policy.max_source_pixels:
                raise ImageError("decompression_bomb",
                                 f"{width}×{height} = {width * height} pixels > {policy.max_source_pixels}")
            source_format = im.format or ""
            im = ImageOps.exif_transpose(im)  # loads the pixels
            im.load()
    except ImageError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError,
            Image.DecompressionBombWarning) as exc:
        raise ImageError("corrupt_image", f"{type(exc).__name__}: {exc}") from None
    width, height = im.size
    try:
        th, tw = target_size(height, width, policy)
    except GeometryError as exc:
        raise ImageError("bad_image_shape", str(exc)) from None
    rgb = _to_rgb(im)
    if rgb.size != (tw, th):
        rgb = rgb.resize((tw, th), Image.Resampling.BICUBIC, reducing_gap=3.0)
    out = io.BytesIO()
    if lossless and source_format in _LOSSLESS_FORMATS:
        rgb.save(out, format="PNG", compress_level=6)
        ext = "png"
    else:
        rgb.save(out, format="JPEG", quality=JPEG_QUALITY)
        ext = "jpg"
    return DecodedImage(data=out.getvalue(), ext=ext, width=tw, height=th, source_width=width, source_height=height)


class ImageCache:
    """Per-worker LRU of decoded images keyed by content hash: web corpora repeat logos and icons many times."""

    def __init__(self, policy: VisionPolicy, *, lossless: bool = False, capacity: int = 256) -> None:
        self.policy = policy
        self.lossless = lossless
        self.capacity = capacity
        self._entries: OrderedDict[bytes, DecodedImage | ImageError] = OrderedDict()
        self.hits = 0

    def decode(self, data: bytes) -> DecodedImage:
        digest = hashlib.sha256(data).digest()
        cached = self._entries.get(digest)
        if cached is None:
            try:
                cached = decode_image(data, self.policy, lossless=self.lossless)
            except ImageError as exc:
                cached = exc
            self._entries[digest] = cached
            if len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        else:
            self.hits += 1
            self._entries.move_to_end(digest)
        if isinstance(cached, ImageError):
            raise cached
        return cached
