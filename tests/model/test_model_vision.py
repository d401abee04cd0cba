"""Vision preprocessing matches the planned geometry; the packed encoder keeps every image to itself."""
from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
import torch
from PIL import Image

from longweave.corpus.photos import shipped_photos
from vision.config import VisionEncoderConfig
from vision.encoder import VisionEncoder, patch_positions
from vision.geometry import VisionPolicy, image_tokens, target_size
from vision.preprocess import IMAGE_MEAN, IMAGE_STD, batch_images, image_to_patches, load_image, patch_dim

POLICY = VisionPolicy(min_tokens=4, max_tokens=64, max_aspect_ratio=8.0)
CONFIG = VisionEncoderConfig(d_model=32, n_layers=2, n_heads=2)


def _random_image(rng: np.random.Generator, height: int, width: int, mode: str = "RGB") -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4}[mode]
    return Image.fromarray(rng.integers(0, 256, (height, width, channels), dtype=np.uint8), mode)


def _unpatch(patches: torch.Tensor, grid: tuple[int, int], policy: VisionPolicy) -> torch.Tensor:
    """Inverse of the documented patch order: ``[N, 3·p·p]`` -> pixels ``[H, W, 3]``."""
    rows, cols = grid
    p, m = policy.patch_size, policy.merge
    x = patches.view(rows, cols, m, m, 3, p, p).permute(0, 2, 5, 1, 3, 6, 4)
    return x.reshape(rows * m * p, cols * m * p, 3)


def test_real_photos_cut_into_the_planned_grid_in_merger_order() -> None:
    """Shipped photos (grey, RGB, RGBA, odd sizes) give image_tokens() tokens, and the patches put back in the
    documented order reproduce the resized, normalised picture."""
    photos = shipped_photos()
    modes = {}
    for photo in photos:
        with Image.open(photo.path) as im:
            modes.setdefault(im.mode, photo)
    for photo in {*modes.values(), *photos[::6]}:
        image = load_image(photo.path)
        out = image_to_patches(image, POLICY)
        width, height = image.size
        assert out.n_tokens == image_tokens(height, width, POLICY)
        assert out.patches.shape == (out.n_tokens * POLICY.merge ** 2, patch_dim(POLICY))
        th, tw = target_size(height, width, POLICY)
        resized = np.asarray(image.resize((tw, th), Image.Resampling.BICUBIC), dtype=np.float32) / 255.0
        expected = (torch.from_numpy(resized) - torch.tensor(IMAGE_MEAN)) / torch.tensor(IMAGE_STD)
        torch.testing.assert_close(_unpatch(out.patches, out.grid, POLICY), expected)


def test_exif_orientation_and_transparency() -> None:
    rng = np.random.default_rng()
    image = _random_image(rng, 40, 90)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90° clockwise to display"
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", exif=exif.tobytes())
    upright = load_image(buffer.getvalue())
    assert upright.size == (40, 90) and upright.mode == "RGB"
    rgba = _random_image(rng, 56, 56, "RGBA")
    pixels = np.asarray(rgba).copy()
    pixels[..., 3] = 0  # fully transparent: must come out white, not the hidden colour
    flattened = image_to_patches(Image.fromarray(pixels, "RGBA"), POLICY)
    white = (1.0 - torch.tensor(IMAGE_MEAN)) / torch.tensor(IMAGE_STD)
    torch.testing.assert_close(_unpatch(flattened.patches, flattened.grid, POLICY), white.expand(56, 56, 3))


def test_patch_positions_follow_the_merger_order() -> None:
    grid = torch.tensor([[2, 3], [1, 1]])
    pos = patch_positions(grid, merge=2)
    assert pos.shape == (4 * 6 + 4, 2)
    # First merged token of image 0 covers patches (0,0) (0,1) (1,0) (1,1); the second starts at column 2.
    assert pos[:8].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3], [1, 2], [1, 3]]
    assert pos[24:].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]  # image 1 restarts at its own origin
    assert int(pos[:24, 0].max()) == 3 and int(pos[:24, 1].max()) == 5


@pytest.mark.gpu
def test_patch_positions_built_on_the_gpu_match_the_host() -> None:
    grid = torch.tensor([[2, 3], [1, 1], [4, 2]])
    on_gpu = patch_positions(grid, merge=2, device="cuda")
    assert on_gpu.is_cuda
    assert torch.equal(on_gpu.cpu(), patch_positions(grid, merge=2))


def test_images_in_one_pack_do_not_see_each_other() -> None:
    """Image 2's tokens are the same whatever image 1 holds, and the same as when encoded alone."""
    rng = np.random.default_rng()
    encoder = VisionEncoder(CONFIG, out_dim=24).eval()
    first = image_to_patches(_random_image(rng, 60, 100), POLICY)
    other_first = image_to_patches(_random_image(rng, 84, 84), POLICY)
    second = image_to_patches(_random_image(rng, 90, 50), POLICY)
    with torch.no_grad():
        packed = encoder(*batch_images([first, second]))
        changed = encoder(*batch_images([other_first, second]))
        alone = encoder(*batch_images([second]))
    assert packed.shape == (first.n_tokens + second.n_tokens, 24)
    torch.testing.assert_close(packed[first.n_tokens:], changed[other_first.n_tokens:], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(packed[first.n_tokens:], alone, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(packed[:first.n_tokens][:4], changed[:4])


def test_only_the_first_n_blocks_recompute() -> None:
    """checkpoint_layers = N runs blocks 0..N-1 twice per step (forward, then the backward's recompute) and the
    others once; the output and every gradient are the same whichever blocks recompute."""
    rng = np.random.default_rng()
    torch.manual_seed(0)
    encoder = VisionEncoder(dataclasses.replace(CONFIG, n_layers=3), out_dim=24)
    calls = [0] * 3
    for i, block in enumerate(encoder.blocks):
        block.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    pixels, grid = batch_images([image_to_patches(_random_image(rng, 60, 100), POLICY)])
    weights = torch.randn(grid.prod(1).sum().item(), 24)

    def step(setting: bool | int) -> tuple[list[int], dict[str, torch.Tensor]]:
        calls[:] = [0] * 3
        encoder.config.checkpoint_layers = setting
        encoder.zero_grad(set_to_none=True)
        (encoder(pixels, grid) * weights).sum().backward()
        return list(calls), {n: p.grad.clone() for n, p in encoder.named_parameters()}

    runs = [step(setting) for setting in (False, 1, True)]  # a list: 1 == True would merge two dict keys
    assert [calls for calls, _ in runs] == [[1, 1, 1], [2, 1, 1], [2, 2, 2]]
    for _, grads in runs[1:]:
        for name, grad in grads.items():
            torch.testing.assert_close(grad, runs[0][1][name], rtol=1e-5, atol=1e-7, msg=name)


def test_encoder_rejects_patches_that_do_not_match_the_grid() -> None:
    encoder = VisionEncoder(CONFIG, out_dim=8)
    pixel_values, grid = batch_images([image_to_patches(_random_image(np.random.default_rng(), 56, 56), POLICY)])
    with pytest.raises(ValueError, match=r"pixel_values: image_grid \[\[2, 2\]\] needs 16 patches, got 12"):
        encoder(pixel_values[:12], grid)
    with pytest.raises(ValueError, match=r"pixel_values: expected \[N_patches, 588\]"):
        encoder(pixel_values[:, :100], grid)


@pytest.mark.parametrize("field, kwargs, match", [
    ("n_heads", dict(d_model=30, n_heads=4), r"VisionEncoderConfig.n_heads: must divide d_model=30"),
    ("n_heads", dict(d_model=24, n_heads=4), r"head_dim d_model/n_heads must be a multiple of 4, got 6"),
    ("n_layers", dict(n_layers=0), r"VisionEncoderConfig.n_layers: must be a positive int, got 0"),
    ("checkpoint_layers", dict(n_layers=2, checkpoint_layers=3),
     r"VisionEncoderConfig.checkpoint_layers: must be true, false or a layer count in \[0, 2\], got 3"),
])
def test_config_errors_name_the_field(field: str, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        VisionEncoderConfig(**kwargs)
