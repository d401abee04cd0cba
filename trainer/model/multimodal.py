"""The multimodal model: token embeddings, vision-tower embeddings in the ``<|image_pad|>`` positions, the hybrid
decoder, and a chunked linear + cross-entropy loss on text tokens.

The batch is packed: ``input_ids [B, L]`` rows are flattened into one sequence of ``T = B·L`` tokens split by
``cu_seqlens`` (documents and padding as segments, flattened over the batch), so the decoder never sees a row
boundary it would have to treat differently from a document boundary.

Loss: a 1M-token sequence with a 32K vocabulary would need 128 GiB for fp32 logits. Only labelled positions go through
the LM head, ``ce_chunk_tokens`` rows at a time; each chunk's gradient is taken inside the forward (softmax minus
one-hot), so no chunk's logits outlive it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from trainer.model.config import ModelConfig
from trainer.model.decoder import Decoder
from trainer.model.sequence import packed_sequence
from vision.encoder import VisionEncoder
from vision.fusion import cuda_compiled

__all__ = ["IGNORE_INDEX", "ModelOutput", "LongweaveModel", "chunked_cross_entropy", "cross_entropy_chunk",
           "true_positions"]

IGNORE_INDEX = -100


@cuda_compiled
def cross_entropy_chunk(logits: torch.Tensor, targets: torch.Tensor,
                        want_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Summed cross-entropy (float32) of one chunk's logits ``[n, V]`` against targets int64 ``[n]`` and, if wanted,
    its gradient ``softmax − one-hot`` in the logits' dtype. Float32 math. Eagerly that is about eight passes over
    ``n × V`` float32 (the upcast, the max and the exponentials of logsumexp, the subtraction, the exponential, the
    one-hot, the downcast): 1 GiB each for 8,192 × 32,768. On CUDA it compiles to a few kernels that read the bf16
    logits and write the bf16 gradient."""
    wide = logits.float()
    lse = torch.logsumexp(wide, dim=-1)
    loss = (lse - wide.gather(1, targets[:, None]).squeeze(1)).sum()
    if not want_grad:
        return loss, None
    probs = torch.exp(wide - lse[:, None])
    target = torch.arange(logits.shape[1], device=logits.device)[None, :] == targets[:, None]
    return loss, torch.where(target, probs - 1.0, probs).to(logits.dtype)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Σ_i CE(h_i Wᵀ, t_i) with gradients computed chunk by chunk during the forward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,  # noqa: ANN001 - ctx
                chunk: int) -> torch.Tensor:
        want_grad = any(ctx.needs_input_grad[:2])
        grad_hidden = torch.empty_like(hidden) if want_grad else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_grad else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            h, t = hidden[start:start + chunk], targets[start:start + chunk]
            loss, probs = cross_entropy_chunk(h @ weight.t(), t, want_grad)
            total += loss
            if probs is not None:
                grad_hidden[start:start + chunk] = probs @ weight
                grad_weight += (probs.t() @ h).float()  # GEMM in the input dtype, chunks summed in fp32
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001 - ctx
        grad_hidden, grad_weight = ctx.saved_tensors
        return ((grad_hidden * grad_out.to(grad_hidden.dtype)), (grad_weight * grad_out).to(ctx.weight_dtype),
                None, None)


def true_positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Indices int64 ``[count]`` of the True entries of a 1-D ``mask`` that holds exactly ``count`` of them, in
    order: ``mask.nonzero()`` without its host sync (each True entry is scattered to its rank; the others to a spare
    slot that is dropped)."""
    slot = torch.where(mask, mask.long().cumsum(0) - 1, count)
    out = torch.empty(count + 1, dtype=torch.int64, device=mask.device)
    return out.scatter_(0, slot, torch.arange(mask.numel(), device=mask.device))[:count]


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          chunk: int) -> torch.Tensor:
    """Summed cross-entropy of ``hidden [M, d] @ weight [V, d]ᵀ`` against ``targets`` int64 ``[M]`` (no ignored
    entries), never holding more than ``chunk × V`` logits. Returns a float32 scalar."""
    if hidden.shape[0] == 0:
        return (hidden.sum() + weight.sum()).float() * 0.0  # keeps the graph (and DDP's hooks) connected
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunk)


@dataclasses.dataclass(frozen=True, slots=True)
class ModelOutput:
    """``loss``: mean cross-entropy over predicted tokens (float32 scalar, the one to backpropagate);
    ``loss_sum`` and ``n_loss_tokens`` let the trainer average exactly over accumulation steps and ranks."""

    loss: torch.Tensor
    loss_sum: torch.Tensor
    n_loss_tokens: int
    n_tokens: int
    n_image_tokens: int


class LongweaveModel(nn.Module):
    """Vision tower + hybrid KDA/MLA MoE decoder + LM head. See :meth:`forward` for the batch it takes."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.vision = VisionEncoder(config.vision, config.d_model)
        self.decoder = Decoder(config)
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def _image_positions(self, flat_ids: torch.Tensor, image_grid: torch.Tensor | None, row_len: int,
                         sample_keys: Sequence[str] | None) -> torch.Tensor:
        """Flat positions int64 ``[Σ tokens]`` of the image-pad tokens, after checking that the runs of
        ``<|image_pad|>`` match the images one for one (count and size), with an error naming the sample.

        ``image_grid`` is on the host. The check runs on the device and costs one host sync, its verdict; the
        positions come from their known count without ``nonzero``."""
        pad = flat_ids == self.config.image_pad_id
        sizes = [] if image_grid is None else (image_grid[:, 0] * image_grid[:, 1]).tolist()
        n = len(sizes)
        starts = pad & ~F.pad(pad[:-1], (1, 0), value=False)
        run = torch.where(pad, (starts.cumsum(0) - 1).clamp(max=n), n)  # run index of each pad token, n elsewhere
        lengths = torch.zeros(n + 1, dtype=torch.int64, device=pad.device).scatter_add_(0, run, pad.long())
        expected = torch.tensor(sizes + [0], dtype=torch.int64).to(pad.device, non_blocking=True)
        if not bool((starts.sum() == n) & (lengths == expected).all()):
            self._image_mismatch(pad, image_grid, sizes, row_len, sample_keys)
        return true_positions(pad, sum(sizes))

    @staticmethod
    def _image_mismatch(pad: torch.Tensor, image_grid: torch.Tensor | None, sizes: list[int], row_len: int,
                        sample_keys: Sequence[str] | None) -> None:
        """Raise the error that names the first image whose ``<|image_pad|>`` run does not match (slow path)."""
        positions = pad.nonzero().squeeze(1)
        if positions.numel():
            breaks = (positions[1:] != positions[:-1] + 1).nonzero().squeeze(1) + 1
            starts = torch.cat([positions[:1], positions[breaks]]).tolist()
            lengths = torch.diff(torch.cat([breaks.new_zeros(1), breaks, breaks.new_full((1,), len(positions))]))
            lengths = lengths.tolist()
        else:
            starts, lengths = [], []

        def name(row: int) -> str:
            return f"sample {sample_keys[row]!r}" if sample_keys is not None else f"batch row {row}"

        for i in range(max(len(starts), len(sizes))):
            if i < len(starts) and i < len(sizes) and lengths[i] == sizes[i]:
                continue
            row = starts[min(i, len(starts) - 1)] // row_len if starts else 0
            if i >= len(sizes):
                problem = f"holds more <|image_pad|> runs ({len(starts)}) than the batch has images ({len(sizes)})"
            elif i >= len(starts):
                problem = f"has fewer <|image_pad|> runs ({len(starts)}) than the batch has images ({len(sizes)})"
            else:
                h, w = image_grid[i].tolist()
                problem = (f"image {i} of the batch: its <|image_pad|> run at offset {starts[i] % row_len} holds "
                           f"{lengths[i]} tokens but its grid {h}×{w} gives {sizes[i]}")
            raise ValueError(f"{name(row)}: image tokens do not match the images: {problem}")
        raise AssertionError("the image-token check failed but no run differs")  # the device verdict is wrong

    def embed_inputs(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
                     image_grid: torch.Tensor | None = None, sample_keys: Sequence[str] | None = None) -> torch.Tensor:
        """Flattened input embeddings ``[B·L, d]``: token embeddings with the vision tower's output written into
        the ``<|image_pad|>`` positions (in order). ``input_ids`` and ``image_grid`` may be on the host: then the
        image-token check runs there, and nothing is read back from the GPU."""
        device = self.embed.weight.device
        flat = input_ids.reshape(-1)
        grid = None if image_grid is None else image_grid.cpu()
        positions = self._image_positions(flat, grid, input_ids.shape[-1], sample_keys).to(device, non_blocking=True)
        x = self.embed(flat.to(device, non_blocking=True))
        if positions.numel():
            if pixel_values is None:
                raise ValueError("pixel_values: the batch has image tokens but no pixel_values")
            image_embeds = self.vision(pixel_values, grid)
            x = x.index_put((positions,), image_embeds.to(x.dtype))
        elif self.training and torch.is_grad_enabled():
            # No image on this rank: still give every vision weight a (zero) gradient, so data-parallel ranks reduce
            # the same gradient buckets whether or not their batch holds images.
            x = x + sum(p.sum() for p in self.vision.parameters()).to(x.dtype) * 0.0
        return x

    def hidden_states(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                      pixel_values: torch.Tensor | None = None, image_grid: torch.Tensor | None = None,
                      sample_keys: Sequence[str] | None = None) -> torch.Tensor:
        """Final normalised hidden states ``[B, L, d]``. ``input_ids``, ``cu_seqlens`` and ``image_grid`` may be on
        the host: then the step reads nothing back from the GPU (on the device, the image-token check's verdict is one
        read, which waits for all work queued before it)."""
        B, L = input_ids.shape
        seq = packed_sequence(cu_seqlens, B * L, with_mask=self.decoder.needs_mask, device=self.embed.weight.device)
        x = self.embed_inputs(input_ids, pixel_values, image_grid, sample_keys)
        return self.norm(self.decoder(x, seq)).view(B, L, -1)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor,
                pixel_values: torch.Tensor | None = None, image_grid: torch.Tensor | None = None,
                sample_keys: Sequence[str] | None = None) -> ModelOutput:
        """One packed batch.

        input_ids int64 ``[B, L]``; labels int64 ``[B, L]`` aligned with input_ids (``labels[b, t]`` is token t's id
        when token t is predicted, else ``IGNORE_INDEX``; position t−1 predicts it); cu_seqlens int32 ``[S+1]``
        over the flattened ``B·L`` tokens, ending at ``B·L``; pixel_values float ``[N_patches, 588]`` and image_grid
        int64 ``[n_images, 2]`` (merged rows, cols) for the images in order of appearance; sample_keys (one per row)
        only name the sample in errors.

        Everything but pixel_values is best given on the host (the trainer does): the forward reads the counts, bounds
        and image check there and moves what the GPU needs. Read back from the device, the first of them would wait
        for the whole previous micro-batch's backward to leave the GPU queue, which then runs dry.
        """
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels: must match input_ids {tuple(input_ids.shape)}, got {tuple(labels.shape)}")
        n_loss = int((labels[:, 1:] != IGNORE_INDEX).sum())  # on the host when labels are there: no sync
        labels = labels.to(self.embed.weight.device, non_blocking=True)
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
        predicted = targets != IGNORE_INDEX
        grid = None if image_grid is None else image_grid.cpu()
        hidden = self.hidden_states(input_ids, cu_seqlens, pixel_values, grid, sample_keys)
        keep = true_positions(predicted, n_loss)
        loss_sum = chunked_cross_entropy(hidden.reshape(-1, hidden.shape[-1])[keep], self.lm_head.weight,
                                         targets[keep], self.config.ce_chunk_tokens)
        n_image = 0 if grid is None else int(grid.prod(1).sum())  # = the pad tokens (checked)
        return ModelOutput(loss=loss_sum / max(n_loss, 1), loss_sum=loss_sum, n_loss_tokens=n_loss,
                           n_tokens=input_ids.numel(), n_image_tokens=n_image)
