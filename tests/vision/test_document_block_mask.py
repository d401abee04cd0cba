"""The FlexAttention block mask read off segment bounds equals the one ``create_block_mask`` finds by evaluating the
mask on every (query, key) pair: the same partial and full tiles, both ways (kv tiles per query tile and query tiles
per kv tile), causal and not."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from vision.attention import document_block_mask, document_ids

PAIRS = (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
         ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices"))


def tiles(mask, count: str, indices: str) -> list[list[int]]:  # noqa: ANN001 - BlockMask
    """The tile indices of each row, as sets (the order inside a row is the builder's)."""
    n = getattr(mask, count)[0, 0]
    return [sorted(getattr(mask, indices)[0, 0, r, :n[r]].tolist()) for r in range(n.shape[0])]


def random_lengths() -> list[int]:
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print(f"seed={seed}")
    gen = torch.Generator().manual_seed(seed)
    choices = torch.tensor([0, 1, 3, 64, 127, 128, 129, 200, 500])
    return choices[torch.randint(0, len(choices), (int(torch.randint(1, 8, (), generator=gen)),), generator=gen)].tolist()


@pytest.mark.parametrize("lengths", [
    pytest.param([128], id="one-tile"),
    pytest.param([1000], id="one-segment-partial-last-tile"),
    pytest.param([5, 300, 1, 1, 200], id="tiny-segments"),
    pytest.param([128, 128, 256], id="tile-aligned"),
    pytest.param([64, 192, 0, 129], id="empty-segment"),
    pytest.param(None, id="random"),
])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_block_mask_equals_create_block_mask(lengths: list[int] | None, causal: bool) -> None:
    lengths = lengths or random_lengths()
    if sum(lengths) == 0:
        lengths = lengths + [1]
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    doc = document_ids(cu, total)

    def mask_mod(b, h, q, k):  # noqa: ANN001, ANN202
        same = doc[q] == doc[k]
        return same & (q >= k) if causal else same

    want = create_block_mask(mask_mod, None, None, total, total, device="cpu")
    got = document_block_mask(cu, doc, causal, mask_mod)
    for count, indices in PAIRS:
        assert torch.equal(getattr(got, count), getattr(want, count)), count
        assert tiles(got, count, indices) == tiles(want, count, indices), indices
