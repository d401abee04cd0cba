"""Native-resolution vision tower: every image of a batch in one packed sequence, none attending to another.

NaViT-style: images keep their own aspect ratio and size (the grid ``vision.geometry`` chose), their 14×14 patches are
concatenated into one sequence, and attention is masked per image (``vision.attention``), so a batch of mixed sizes
needs no padding. Positions are 2D rotary (row, column of the patch inside its own image), so an image's encoding does
not depend on where in the pack it sits. The 2×2 merger turns four neighbouring patches into one decoder token; the
patch order written by ``vision.preprocess`` puts those four in consecutive rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from vision.attention import DocumentMask, document_attention, document_mask
from vision.config import VisionEncoderConfig
from vision.fusion import cuda_compiled

__all__ = ["VisionEncoder", "patch_positions", "rope_2d"]


def patch_positions(image_grid: torch.Tensor, merge: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``(row, col)`` int64 ``[N_patches, 2]`` on ``device`` (default: the grid's) of each patch inside its image, for
    merged grids ``image_grid`` ``[n_images, 2]`` on the host, in the merger order of ``vision.preprocess`` (merged
    row, merged col, sub row, sub col).

    Built on ``device`` from the host grid's sizes, so nothing is read back: a dozen small kernels on the GPU. Built on
    the host, the same ops over ~100K patches of an 8k micro-batch took 135 ms there on the H200 machine (each op
    8 ms in the profile, the GPU idle meanwhile)."""
    device = torch.device(image_grid.device if device is None else device)
    grid = image_grid.cpu()
    per_image = grid[:, 0] * grid[:, 1] * merge * merge
    n = int(per_image.sum())
    sizes = torch.stack([per_image, grid[:, 1]], dim=1).to(device, non_blocking=True)
    image_of = torch.repeat_interleave(torch.arange(len(grid), device=device), sizes[:, 0], output_size=n)
    starts = torch.cumsum(sizes[:, 0], 0) - sizes[:, 0]
    local = torch.arange(n, device=device) - starts[image_of]
    merged, sub = local // (merge * merge), local % (merge * merge)
    cols = sizes[image_of, 1]
    row = (merged // cols) * merge + sub // merge
    col = (merged % cols) * merge + sub % merge
    return torch.stack([row, col], dim=1)


def rope_2d(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin float32 ``[N, head_dim]`` for rotate-half RoPE: the first quarter-pairs turn with the row, the rest
    with the column, so each axis gets half the rotary channels."""
    quarter = head_dim // 4
    inv_freq = theta ** (-torch.arange(quarter, device=positions.device, dtype=torch.float32) / quarter)
    angles = torch.cat([positions[:, :1].float() * inv_freq, positions[:, 1:].float() * inv_freq], dim=1)
    angles = torch.cat([angles, angles], dim=1)
    return angles.cos(), angles.sin()


@cuda_compiled
def _apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k ``[N, H, D]`` (any strides) by cos/sin ``[N, D]``; computed in float32, returned in their
    dtype (one fused kernel on CUDA)."""
    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        half = xf.shape[-1] // 2
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)

    return rotate(q), rotate(k)


@cuda_compiled
def _attention_inputs(x: torch.Tensor, norm_weight: torch.Tensor, norm_bias: torch.Tensor, eps: float,
                      qkv_weight: torch.Tensor, qkv_bias: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      n_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v ``[N, H, D]`` of ``LayerNorm(x)`` ``[N, d]``, q and k rotated: one compiled region on CUDA (the norm,
    the projection's bias, the RoPE and the split; in backward the norm's gradients and q, k, v's stacked into one
    buffer, which eager autograd did by a LayerNorm kernel, a GammaBeta reduction and an ``unbind`` copy)."""
    n = x.shape[0]
    qkv = F.linear(F.layer_norm(x, (x.shape[-1],), norm_weight, norm_bias, eps), qkv_weight, qkv_bias)
    q, k, v = qkv.view(n, 3, n_heads, -1).unbind(1)
    return (*_apply_rope(q, k, cos, sin), v)


@cuda_compiled
def _block_output(x: torch.Tensor, attention: torch.Tensor, proj_weight: torch.Tensor, proj_bias: torch.Tensor,
                  norm_weight: torch.Tensor, norm_bias: torch.Tensor, eps: float, fc1_weight: torch.Tensor,
                  fc1_bias: torch.Tensor, fc2_weight: torch.Tensor, fc2_bias: torch.Tensor) -> torch.Tensor:
    """The rest of a block after its attention ``[1, H, N, D]``: the output projection and residual, then the GELU
    MLP and residual, as one compiled region on CUDA (the biases, GELU and residual adds fused into the GEMMs'
    neighbours; in backward the GELU's gradient with fc1's bias gradient, the norm's with its parameters')."""
    n = x.shape[0]
    x = x + F.linear(attention.squeeze(0).transpose(0, 1).reshape(n, -1), proj_weight, proj_bias)
    hidden = F.linear(F.layer_norm(x, (x.shape[-1],), norm_weight, norm_bias, eps), fc1_weight, fc1_bias)
    return x + F.linear(F.gelu(hidden, approximate="tanh"), fc2_weight, fc2_bias)


class VisionAttention(nn.Module):
    """Multi-head self-attention with 2D RoPE on q, k; the mask keeps each image to itself. Holds the projections;
    ``VisionBlock`` runs them around the attention call in two compiled regions with its norms."""

    def __init__(self, config: VisionEncoderConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)


class VisionBlock(nn.Module):
    """Pre-norm transformer block: attention then GELU MLP, each with a residual."""

    def __init__(self, config: VisionEncoderConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.attn = VisionAttention(config)
        self.norm2 = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.fc1 = nn.Linear(config.d_model, config.d_mlp)
        self.fc2 = nn.Linear(config.d_mlp, config.d_model)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: DocumentMask) -> torch.Tensor:
        """``x + attn(norm1(x))``, then ``+ fc2(gelu(fc1(norm2(·))))``; x ``[N, d]``."""
        attn, norm1, norm2 = self.attn, self.norm1, self.norm2
        q, k, v = _attention_inputs(x, norm1.weight, norm1.bias, norm1.eps, attn.qkv.weight, attn.qkv.bias, *rope,
                                    attn.n_heads)
        out = document_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), mask)
        return _block_output(x, out, attn.proj.weight, attn.proj.bias, norm2.weight, norm2.bias, norm2.eps,
                             self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias)


class PatchMerger(nn.Module):
    """``merge²`` neighbouring patches -> one decoder token: LayerNorm, concatenate, two-layer GELU MLP projector."""

    def __init__(self, config: VisionEncoderConfig, out_dim: int) -> None:
        super().__init__()
        self.group = config.merge * config.merge
        width = config.d_model * self.group
        self.norm = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[N_patches, d]`` (groups of ``merge²`` consecutive rows) -> ``[N_patches / merge², out_dim]``."""
        x = self.norm(x).reshape(-1, self.group * x.shape[-1])
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class VisionEncoder(nn.Module):
    """``forward(pixel_values [N_patches, 3·p·p], image_grid [n_images, 2] merged (rows, cols))`` ->
    ``[Σ rows·cols, out_dim]`` image-token embeddings, in image order, ready for the ``<|image_pad|>`` positions."""

    def __init__(self, config: VisionEncoderConfig, out_dim: int) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = nn.Linear(config.patch_dim, config.d_model)  # = a p×p stride-p conv on flattened patches
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.n_layers))
        self.merger = PatchMerger(config, out_dim)

    def forward(self, pixel_values: torch.Tensor, image_grid: torch.Tensor) -> torch.Tensor:
        """``image_grid`` is read on the host: pass it on the CPU and the tower waits for nothing on the GPU."""
        cfg = self.config
        group = cfg.merge * cfg.merge
        if pixel_values.ndim != 2 or pixel_values.shape[1] != cfg.patch_dim:
            raise ValueError(f"pixel_values: expected [N_patches, {cfg.patch_dim}], got {tuple(pixel_values.shape)}")
        grid = image_grid.cpu()
        if grid.ndim != 2 or grid.shape[1] != 2 or bool((grid < 1).any()):
            raise ValueError(f"image_grid: expected positive [n_images, 2], got {grid.tolist()}")
        per_image = grid[:, 0] * grid[:, 1] * group
        n_patches = int(per_image.sum())
        if n_patches != pixel_values.shape[0]:
            raise ValueError(f"pixel_values: image_grid {grid.tolist()} needs {n_patches} patches, "
                             f"got {pixel_values.shape[0]}")
        device = pixel_values.device
        cu_seqlens = F.pad(torch.cumsum(per_image, 0), (1, 0)).to(torch.int32)
        mask = document_mask(cu_seqlens, n_patches, causal=False, device=device)
        positions = patch_positions(grid, cfg.merge, device)
        rope = rope_2d(positions, cfg.head_dim, cfg.rope_theta)
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        recomputed = cfg.recomputed_layers() if torch.is_grad_enabled() else 0
        for i, block in enumerate(self.blocks):
            if i < recomputed:
                x = checkpoint(block, x, rope, mask, use_reentrant=False)
            else:
                x = block(x, rope, mask)
        return self.merger(x)
