"""From a PIL image to the patch rows the vision encoder reads, on exactly the grid ``vision.geometry`` planned.

The token layout already holds ``grid_h × grid_w`` ``<|image_pad|>`` tokens for an image (one per 28×28 pixels), so the
preprocessing must resize to :func:`vision.geometry.target_size` and nothing else: any other size would change the
number of merged patches and break the count check in the model.

Patch order: the encoder merges each 2×2 block of neighbouring patches into one token by reshaping consecutive rows,
so patches are emitted merged-patch by merged-patch — order ``(merged_row, merged_col, sub_row, sub_col)`` — and each
patch row is flattened channel-first, ``(C, 14, 14)``, which is what a 14×14 stride-14 convolution's weight sees.
"""
from __future__ import annotations

import dataclasses
import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

from vision.geometry import DEFAULT_POLICY, VisionPolicy, merged_grid

__all__ = [
    "IMAGE_MEAN",
    "IMAGE_STD",
    "PreprocessedImage",
    "load_image",
    "to_rgb",
    "image_to_patches",
    "batch_images",
    "patch_dim",
]

# CLIP/SigLIP-style normalisation constants (per RGB channel, on [0, 1] pixels): the usual choice for ViTs trained
# from scratch or initialised from CLIP-family towers.
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)


def patch_dim(policy: VisionPolicy = DEFAULT_POLICY) -> int:
    """Values per patch row: ``3 · patch · patch`` (588 for 14×14)."""
    return 3 * policy.patch_size * policy.patch_size


@dataclasses.dataclass(frozen=True, slots=True)
class PreprocessedImage:
    """``patches`` float32 ``[grid_h·grid_w·merge², 3·p·p]`` in merger order; ``grid`` = merged ``(grid_h, grid_w)``."""

    patches: torch.Tensor
    grid: tuple[int, int]

    @property
    def n_tokens(self) -> int:
        return self.grid[0] * self.grid[1]


def to_rgb(image: Image.Image) -> Image.Image:
    """Upright RGB: apply the EXIF orientation (phones store it there), flatten transparency onto white."""
    image = ImageOps.exif_transpose(image)
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def load_image(source: str | Path | bytes) -> Image.Image:
    """Decode a file path or encoded bytes into an upright RGB image (fully loaded, file closed)."""
    handle = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else open(source, "rb")
    with handle, Image.open(handle) as image:
        image.load()
        return to_rgb(image)


def image_to_patches(image: Image.Image, policy: VisionPolicy = DEFAULT_POLICY) -> PreprocessedImage:
    """Resize ``image`` to the policy's target grid and cut it into normalised patch rows in merger order."""
    image = to_rgb(image)
    width, height = image.size
    rows, cols = merged_grid(height, width, policy)
    unit, p, m = policy.unit, policy.patch_size, policy.merge
    if image.size != (cols * unit, rows * unit):
        image = image.resize((cols * unit, rows * unit), Image.Resampling.BICUBIC)
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0)  # [H, W, 3]
    pixels = (pixels - torch.tensor(IMAGE_MEAN)) / torch.tensor(IMAGE_STD)
    # [rows, m, p, cols, m, p, C] -> [rows, cols, m(sub_row), m(sub_col), C, p, p]
    patches = pixels.view(rows, m, p, cols, m, p, 3).permute(0, 3, 1, 4, 6, 2, 5)
    return PreprocessedImage(patches=patches.reshape(rows * cols * m * m, 3 * p * p).contiguous(), grid=(rows, cols))


def batch_images(images: Sequence[PreprocessedImage]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack images for one forward: ``pixel_values`` float32 ``[Σ patches, 3·p·p]`` and ``image_grid`` int64
    ``[n_images, 2]`` (merged rows, cols), both in the order the images appear in the token sequence."""
    if not images:
        raise ValueError("images: need at least one image to batch")
    pixel_values = torch.cat([im.patches for im in images])
    image_grid = torch.tensor([im.grid for im in images], dtype=torch.int64)
    return pixel_values, image_grid
