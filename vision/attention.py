"""Attention over packed sequences in which no segment sees another: images in the vision tower, documents in the
decoder's MLA layers.

Both pack many variable-length segments into one sequence to avoid padding. The mask is built once per forward from
``cu_seqlens`` and shared by every layer. On CUDA there are two kernels for it, picked by ``LONGWEAVE_ATTENTION``
(``varlen`` or ``flex``, or ``flex/varlen`` for one per kind of mask, causal then bidirectional; unset:
``DEFAULT_CUDA_BACKEND``): PyTorch's variable-length flash attention
(``torch.nn.attention.varlen``), which walks each segment's own tiles from ``cu_seqlens``, or FlexAttention with a
``BlockMask`` in which blocks that cross a segment boundary (or lie above the diagonal when causal) are skipped. Either
way cost and memory follow the segments, not the whole length squared. Elsewhere attention runs segment by segment
with ``scaled_dot_product_attention`` on each slice (``is_causal`` inside a segment): exact, and its memory follows
the longest segment, so a 64K-token pack of documents and a pack of dozens of images both fit a CPU.

This lives in ``vision`` because the vision tower may not import ``trainer``; the decoder imports it from here.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import types
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

__all__ = ["DocumentMask", "backend_for", "cuda_backend", "document_block_mask", "document_ids", "document_mask",
           "document_attention", "flex_kernel_options", "varlen_flash_attention"]

TILE = 128  # FlexAttention's default block size, both ways
BACKENDS = ("varlen", "flex")
# LONGWEAVE_ATTENTION's values: one backend for both kinds of mask, or ``CAUSAL/BIDIRECTIONAL`` (the decoder's, then
# the vision tower's), since each kernel won one kind in isolation and lost the pair inside the model.
SETTINGS = BACKENDS + tuple(f"{a}/{b}" for a in BACKENDS for b in BACKENDS if a != b)
# In the model the varlen kernels win: `small` at 131K tokens stepped in 1,234 ms with them against 1,330 ms with
# FlexAttention (H200, 2026-12-04, `trainer.model.profile --attention varlen flex`), and the 8k stage's attention
# took 1.34 s per step against FlexAttention's 2.92 s (sixth session), although FlexAttention is faster in the
# isolated bench (`vision.attention_bench`: 15.0 against 20.3 ms at 131K tokens, causal). cuDNN's fused attention over
# the same ragged layout (`aten._cudnn_attention_forward` with `cum_seq_q`, as nested tensors call it) was tried and
# dropped (H100, torch 2.11, cuDNN 9.19, 2026-12-06): 84 ms forward against varlen's 2.2 at 65,536 causal tokens,
# and an illegal memory access on q, k, v that are column slices of one projection (BENCHMARKS.md).
# Since each kind of mask compiles its own FlexAttention (2026-12-06), the decoder's causal masks run faster on it
# in the stage too: the 8k step on an H100 10.47-10.89 s against 10.75-10.81 (4 x 8K micro-batches, three steps
# each in one call) and 10.70-10.91 against 10.84-10.94 (8 x 8K, the session before); the tower stays on varlen.
DEFAULT_CUDA_BACKEND = "flex/varlen"


# Inductor says so each time it splits a long FlexAttention reduction (11 multi-line warnings in a 1M-token step's
# log); the split is correct, only slower, and there is nothing a user can do about it.
warnings.filterwarnings("ignore", message="Online softmax is disabled on the fly", category=UserWarning)


# FlexAttention's kernel options for document masks: FlexAttention's defaults, or what ``LONGWEAVE_FLEX_OPTIONS``
# gives per kind of mask, as JSON with the keys "causal" (the decoder's documents) and "bidirectional" (the tower's
# images): block sizes, warps and stages to try in a run (their names are FlexAttention's: ``fwd_BLOCK_M``,
# ``bwd_BLOCK_N1``, ``num_warps`` …; ``vision.attention_bench --flex-options`` times them side by side). Not
# ``ROWS_GUARANTEED_SAFE``, although every query sees at least itself: a query tile that spans two documents reads
# the first one's partial kv tiles first, where the second document's rows see no key, and without the guard their
# running max stays -inf and the softmax turns NaN (the 8k stage's first step on an H100, 2026-12-07).
FLEX_OPTIONS_KINDS = ("causal", "bidirectional")


def flex_kernel_options(causal: bool) -> dict:
    """The kernel options ``LONGWEAVE_FLEX_OPTIONS`` gives this kind of mask (none unset)."""
    return dict(_flex_options_setting(os.environ.get("LONGWEAVE_FLEX_OPTIONS", "{}"))[int(not causal)])


@functools.cache
def _flex_options_setting(text: str) -> tuple[dict, dict]:
    try:
        setting = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"LONGWEAVE_FLEX_OPTIONS: not JSON ({e}): {text!r}") from None
    if not isinstance(setting, dict) or set(setting) - set(FLEX_OPTIONS_KINDS) or not all(
            isinstance(v, dict) for v in setting.values()):
        raise ValueError(f"LONGWEAVE_FLEX_OPTIONS: must be a JSON object of kernel options under the keys "
                         f"{FLEX_OPTIONS_KINDS}, got {text!r}")
    return tuple(setting.get(kind, {}) for kind in FLEX_OPTIONS_KINDS)


def _flex_attention_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask,
                         scale: float | None, kernel_options: dict) -> torch.Tensor:
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, kernel_options=kernel_options)


@functools.cache
def _compiled_flex_attention(causal: bool):  # noqa: ANN202 - the compiled callable's type is torch-internal
    """Compiled once per process and kind of mask: uncompiled FlexAttention materialises the full score matrix.

    Dynamo keeps compiled code, and its record of which sizes have changed, per code object. With one compiled
    function for both kinds, the vision tower's patch count (new with every micro-batch) turns the code dynamic in
    the sequence length for the decoder's fixed-length calls too. So each kind compiles its own copy of
    ``_flex_attention_call``, a distinct code object. With one compiled function the decoder on FlexAttention lost
    inside the 8k stage while faster alone; with one per kind it no longer does (H100, 2026-12-06: 10.70–10.91 s a
    step against varlen's 10.84–10.94, BENCHMARKS.md)."""
    code = _flex_attention_call.__code__.replace(co_name=f"flex_attention_{'causal' if causal else 'bidirectional'}")
    return torch.compile(types.FunctionType(code, _flex_attention_call.__globals__))


def _check_shape(cu_seqlens: torch.Tensor) -> None:
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")


def document_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Segment index int32 ``[total]`` of every position, from ``cu_seqlens`` int ``[S+1]`` (0 … total)."""
    _check_shape(cu_seqlens)
    positions = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return (torch.searchsorted(cu_seqlens[1:].contiguous(), positions, right=True)).to(torch.int32)


def document_block_mask(cu_seqlens: torch.Tensor, doc: torch.Tensor, causal: bool, mask_mod) -> BlockMask:  # noqa: ANN001
    """The FlexAttention ``BlockMask`` of a packed sequence, read off its segment bounds.

    ``create_block_mask`` finds the same tiles by evaluating ``mask_mod`` on every (query, key) pair, total² of them:
    9.1 ms of the 8k stage's 131K-token step on the H200 (measured), growing with the square of the length. Here,
    in O(tiles²) index arithmetic: a query tile's keys are one contiguous range of kv tiles, from the tile of its
    first token's segment start to its own tile (causal) or to the tile of its last token's segment end; a pair of
    tiles is full (no ``mask_mod`` needed) when both lie whole inside one segment and, causal, the kv tile is the
    earlier one. The rest of the range is partial: at most the tile where the segment starts and, causal, the
    diagonal one, or all of it when the query tile spans segments. ``cu_seqlens`` int ``[S+1]`` and ``doc``
    (``document_ids``) on the mask's device; no host sync."""
    total = doc.shape[0]
    n = -(-total // TILE)
    i = torch.arange(n, device=doc.device)
    cu = cu_seqlens.to(torch.int64)
    first_doc = doc[i * TILE].long()
    last_doc = doc[torch.clamp((i + 1) * TILE, max=total) - 1].long()
    lo = cu[first_doc] // TILE
    hi = i if causal else (cu[last_doc + 1] - 1) // TILE
    whole = (first_doc == last_doc) & ((i + 1) * TILE <= total)  # the query tile lies whole inside one segment
    full_lo = -(-cu[first_doc] // TILE)
    full_hi = i - 1 if causal else cu[first_doc + 1] // TILE - 1
    has_full = whole & (full_hi >= full_lo)
    full_lo, full_hi = torch.where(has_full, full_lo, hi + 1), torch.where(has_full, full_hi, hi)
    # Per query tile, as int32 columns: the [tiles, tiles] tables below are 256 MiB each at 1M tokens.
    lo, full_lo, full_hi = (t.to(torch.int32)[:, None] for t in (lo, full_lo, full_hi))
    left, right = full_lo - lo, hi.to(torch.int32)[:, None] - full_hi  # partial tiles before and after the full ones
    c = torch.arange(n, device=doc.device, dtype=torch.int32)[None, :]
    partial = torch.where(c < left, lo + c, full_hi + 1 + c - left)
    partial = torch.where(c < left + right, partial, 0)
    full = torch.where(c < full_hi - full_lo + 1, full_lo + c, 0)
    return BlockMask.from_kv_blocks((left + right).view(1, 1, n), partial[None, None],
                                    (full_hi - full_lo + 1).view(1, 1, n), full[None, None], BLOCK_SIZE=TILE,
                                    mask_mod=mask_mod, seq_lengths=(total, total))


def varlen_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                           max_length: int, *, causal: bool, scale: float | None = None) -> torch.Tensor:
    """Attention inside segments by PyTorch's variable-length flash kernels: q, k, v ``[T, H, D]`` (last dim
    contiguous), ``cu_seqlens`` int32 ``[S+1]`` on their device, ``max_length`` the longest segment -> ``[T, H, D]``.
    torch 2.9 spelled the causal mask ``is_causal``; later releases, ``window_size=(-1, 0)``."""
    from torch.nn.attention.varlen import varlen_attn

    if "is_causal" in _varlen_parameters():
        mask = dict(is_causal=causal)
    else:
        mask = dict(window_size=(-1, 0) if causal else (-1, -1))
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_length, max_length, scale=scale, **mask)


@functools.cache
def _varlen_parameters() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def cuda_backend() -> str:
    """``LONGWEAVE_ATTENTION`` if set (one of ``SETTINGS``), else ``DEFAULT_CUDA_BACKEND``."""
    name = os.environ.get("LONGWEAVE_ATTENTION", DEFAULT_CUDA_BACKEND)
    if name not in SETTINGS:
        raise ValueError(f"LONGWEAVE_ATTENTION: must be one of {SETTINGS}, got {name!r}")
    return name


def backend_for(causal: bool) -> str:
    """The kernel ``cuda_backend()`` gives causal masks (the decoder's documents) or bidirectional ones (the vision
    tower's images): a setting ``CAUSAL/BIDIRECTIONAL`` names one for each."""
    causal_kind, _, bidirectional = cuda_backend().partition("/")
    return causal_kind if causal or not bidirectional else bidirectional


@dataclasses.dataclass(frozen=True, slots=True)
class DocumentMask:
    """Which keys each query may see: same segment (and not later, when ``causal``). On CUDA either ``block_mask``
    (FlexAttention) or ``cu_seqlens`` (int32 on the device) and ``max_length`` (varlen flash attention) is set;
    elsewhere ``bounds`` lists the ``(start, end)`` of every segment for the per-segment path."""

    doc_ids: torch.Tensor
    causal: bool
    block_mask: BlockMask | None
    bounds: tuple[tuple[int, int], ...]
    cu_seqlens: torch.Tensor | None = None
    max_length: int = 0

    @property
    def length(self) -> int:
        return int(self.doc_ids.shape[0])


def document_mask(cu_seqlens: torch.Tensor, total: int, *, causal: bool, backend: str | None = None,
                  device: torch.device | str | None = None) -> DocumentMask:
    """Mask on ``device`` (default: cu_seqlens') for a packed sequence of ``total`` positions split by ``cu_seqlens``
    (``cu_seqlens[-1] == total``).

    ``cu_seqlens`` is checked (and the CPU path's bounds and the longest segment read) on the host: pass it on the
    CPU and nothing waits for the GPU; a CUDA one costs one sync. ``backend``: ``"varlen"``, ``"flex"`` or
    ``"segments"`` (the per-segment path); default ``backend_for(causal)`` on CUDA, ``"segments"`` elsewhere. The flex
    block mask is read off the segment bounds (``document_block_mask``), so 1M-token masks stay cheap.
    """
    device = torch.device(cu_seqlens.device if device is None else device)
    if backend is not None and backend not in (*BACKENDS, "segments"):
        raise ValueError(f"document_mask: backend must be varlen, flex or segments, got {backend!r}")
    _check_shape(cu_seqlens)
    cuts = cu_seqlens.tolist()
    if cuts[-1] != total or cuts[0] != 0:
        raise ValueError(f"cu_seqlens: must run from 0 to the sequence length {total}, got {cuts[0]} … {cuts[-1]}")
    cu_device = cu_seqlens.to(device, torch.int32, non_blocking=True)
    doc = document_ids(cu_device, total)
    if backend is None:
        backend = backend_for(causal) if doc.is_cuda else "segments"
    if backend == "varlen":
        longest = max(b - a for a, b in zip(cuts, cuts[1:]))
        return DocumentMask(doc_ids=doc, causal=causal, block_mask=None, bounds=(), cu_seqlens=cu_device,
                            max_length=longest)
    if backend == "flex":
        if causal:
            def mask_mod(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202 - FlexAttention's mask_mod protocol
                return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
        else:
            def mask_mod(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
                return doc[q_idx] == doc[kv_idx]
        block = document_block_mask(cu_device, doc, causal, mask_mod)
        return DocumentMask(doc_ids=doc, causal=causal, block_mask=block, bounds=())
    bounds = tuple((a, b) for a, b in zip(cuts, cuts[1:]) if b > a)
    return DocumentMask(doc_ids=doc, causal=causal, block_mask=None, bounds=bounds)


INT32_EXTENT = 2**31


def compact_if_huge(x: torch.Tensor, limit: int = INT32_EXTENT) -> torch.Tensor:
    """x itself, or a contiguous copy when the memory its view spans reaches ``limit`` elements.

    The decoder hands the attention kernels column slices of a joint projection: at 1M tokens MLA's q spans
    1M × 2560 = 2.7e9 elements, past what a Triton kernel's 32-bit offsets reach, while q alone holds 1.07e9.
    A FlexAttention build that picks 32-bit indexing from q's size rather than its span would read the wrong memory
    for the last fifth of the tokens; a compact copy cannot be misread, and costs one copy only at that length."""
    span = 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride()) if n > 0)
    return x.contiguous() if span >= limit else x


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask,
                       scale: float | None = None, flex_options: dict | None = None) -> torch.Tensor:
    """Softmax attention inside segments. q, k ``[1, H, T, Dk]``, v ``[1, H, T, Dv]`` -> ``[1, H, T, Dv]``.
    ``flex_options``: FlexAttention's kernel options in place of ``flex_kernel_options``'s (a benchmark's)."""
    if q.shape[0] != 1 or q.shape[2] != mask.length:
        raise ValueError(f"q: expected [1, H, {mask.length}, D], got {tuple(q.shape)}")
    if mask.cu_seqlens is not None or mask.block_mask is not None:
        q, k, v = (compact_if_huge(t) for t in (q, k, v))
    if mask.cu_seqlens is not None:
        # [T, H, D]: the projections' own layout. squeeze, not t[0]: a select's backward writes its gradient into
        # fresh zeros of the input's size (a fill and a copy of each of q, k and v per layer), a squeeze's is a view.
        rows = [t.squeeze(0).transpose(0, 1) for t in (q, k, v)]
        out = varlen_flash_attention(*rows, mask.cu_seqlens, mask.max_length, causal=mask.causal, scale=scale)
        return out.transpose(0, 1).unsqueeze(0)
    if mask.block_mask is not None:
        options = flex_kernel_options(mask.causal) if flex_options is None else flex_options
        return _compiled_flex_attention(mask.causal)(q, k, v, mask.block_mask, scale, options)
    return torch.cat([F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=mask.causal,
                                                     scale=scale) for a, b in mask.bounds], dim=2)
