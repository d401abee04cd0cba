"""The whole model on a real packed batch (sample-corpus prose and photographs): it learns, keeps documents apart,
checks image tokens against images, and computes the loss in chunks exactly."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels.moe import step_moe_balance
from longweave.corpus.build import CorpusConfig, build_corpus
from schemas import Document
from tokenization import load_tokenizer
from trainer.model import (IGNORE_INDEX, LongweaveModel, ModelConfig, MoEConfig, flatten_cu_seqlens, text_labels,
                           tiny)
from trainer.model.multimodal import chunked_cross_entropy
from vision.geometry import VisionPolicy
from vision.preprocess import PreprocessedImage, batch_images, image_to_patches, load_image

POLICY = VisionPolicy(min_tokens=4, max_tokens=16, max_aspect_ratio=4.0)
TOKENIZER = load_tokenizer()
SPECIAL = TOKENIZER.special


@pytest.fixture(autouse=True)
def one_thread():  # noqa: ANN201 - fixture
    """The tiny model's ops are microseconds long: a second intra-op thread only adds synchronisation, and on a
    loaded 2-core runner its spin-waits made a training step ten times slower (7 s instead of 0.7 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@dataclasses.dataclass
class Piece:
    doc_id: str
    ids: np.ndarray
    images: list[PreprocessedImage]


@pytest.fixture(scope="module")
def pieces(tmp_path_factory: pytest.TempPathFactory) -> list[Piece]:
    """Four short real documents laid out by the real tokenizer: from the sample corpus, the first photograph of a
    document with its caption and up to 400 characters of the prose after it (CPU-test sized)."""
    root = Path(tmp_path_factory.mktemp("corpus"))
    build_corpus(root, CorpusConfig(module_packages=("skimage",), subpackage_documents=()))
    out = []
    for line in (root / "documents.jsonl").read_text().splitlines():
        doc = Document.from_json(line)
        at = next((i for i, seg in enumerate(doc.segments) if seg.kind == "image"), None)
        if at is None or at == 0 or at + 1 >= len(doc.segments):
            continue
        caption, photo, prose = doc.segments[at - 1:at + 2]
        picture = load_image(root / "images" / photo.image_ref)
        photo = dataclasses.replace(photo, width=picture.size[0], height=picture.size[1])
        prose = dataclasses.replace(prose, text=prose.text[:400])
        layout = TOKENIZER.encode_document(dataclasses.replace(doc, segments=(caption, photo, prose)), POLICY)
        image = image_to_patches(picture, POLICY)
        assert [s.n_tokens for s in layout.image_spans] == [image.n_tokens]
        out.append(Piece(doc.id, layout.ids, [image]))
        if len(out) == 4:
            return out
    raise AssertionError("the sample corpus has fewer than 4 documents with a captioned photo")


def make_batch(rows: list[list[Piece]], pad_to: int = 8) -> dict:
    """Pack rows of pieces like the pipeline does: tokens padded to one length, per-row cu_seqlens, labels under
    the loss-mask rule; then the model's batch (cu_seqlens flattened, images in order of appearance)."""
    seq_len = -(-max(sum(len(p.ids) for p in row) for row in rows) // pad_to) * pad_to + pad_to
    tokens, labels, cus, images = [], [], [], []
    for row in rows:
        ids = np.full(seq_len, SPECIAL.pad, dtype=np.uint32)
        ids[:sum(len(p.ids) for p in row)] = np.concatenate([p.ids for p in row])
        cu = np.concatenate([[0], np.cumsum([len(p.ids) for p in row])]).tolist()
        tokens.append(ids)
        labels.append(text_labels(ids, cu, SPECIAL))
        cus.append(cu)
        images.extend(im for p in row for im in p.images)
    pixel_values, image_grid = batch_images(images)
    return {
        "input_ids": torch.from_numpy(np.stack(tokens).astype(np.int64)),
        "labels": torch.from_numpy(np.stack(labels)),
        "cu_seqlens": flatten_cu_seqlens(cus, seq_len),
        "pixel_values": pixel_values,
        "image_grid": image_grid,
        "sample_keys": [f"row{i}" for i in range(len(rows))],
    }


def test_labels_follow_the_loss_mask_rule(pieces: list[Piece]) -> None:
    batch = make_batch([[pieces[0], pieces[1]]])
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    first_of_piece = torch.zeros_like(ids, dtype=torch.bool)
    first_of_piece[[0, len(pieces[0].ids)]] = True
    padding = torch.arange(len(ids)) >= len(pieces[0].ids) + len(pieces[1].ids)
    image = torch.isin(ids, torch.tensor(SPECIAL.image_ids))
    ignored = first_of_piece | padding | image
    assert torch.equal(labels == IGNORE_INDEX, ignored)
    assert torch.equal(labels[~ignored], ids[~ignored])
    assert batch["cu_seqlens"].tolist() == [0, len(pieces[0].ids), len(pieces[0].ids) + len(pieces[1].ids), len(ids)]


def test_loss_falls_on_a_real_packed_batch(pieces: list[Piece]) -> None:
    """30 AdamW steps on two packed rows of real text and photos: loss falls, every part gets gradients, the MoE
    balance stats come back once per step."""
    torch.manual_seed(0)
    model = LongweaveModel(tiny())
    batch = make_batch([[pieces[0], pieces[2]], [pieces[1], pieces[3]]])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(30):
        out = model(**batch)
        out.loss.backward()
        if step == 0:
            for name in ("vision.patch_embed.weight", "decoder.layers.0.mixer.A_log", "decoder.layers.3.mixer.q_proj.weight",
                         "decoder.layers.1.ffn.w13", "decoder.residuals.queries", "lm_head.weight"):
                grad = model.get_parameter(name).grad
                assert grad is not None and bool(grad.abs().sum() > 0), name
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        stats = step_moe_balance(model)
        assert len(stats) == 3 and all(s.tokens_per_expert.sum() == 2 * out.n_tokens for s in stats)
        losses.append(out.loss.item())
    assert out.n_image_tokens == sum(im.n_tokens for p in pieces for im in p.images)
    # Column 0 opens a piece (never labelled), so shifting the labels by one loses none of them.
    assert out.n_loss_tokens == int((batch["labels"] != IGNORE_INDEX).sum())
    assert losses[0] > 9.0 and losses[-1] < losses[0] - 3.0, losses


def test_document_two_does_not_depend_on_document_one(pieces: list[Piece]) -> None:
    """Whole decoder (KDA, MLA, MoE, AttnRes, vision): replace document 1's text and photo; document 2's hidden
    states do not move, and they equal document 2 packed alone."""
    torch.manual_seed(1)
    model = LongweaveModel(tiny()).eval()
    one, two = pieces[1], pieces[0]
    changed_ids = one.ids.copy()
    text = changed_ids > SPECIAL.image_end
    changed_ids[text] = np.random.default_rng().integers(6, TOKENIZER.vocab_size, int(text.sum()))
    changed_images = [PreprocessedImage(torch.randn_like(im.patches), im.grid) for im in one.images]
    changed = Piece(one.doc_id, changed_ids, changed_images)
    hidden = {}
    with torch.no_grad():
        for name, row in (("original", [one, two]), ("changed", [changed, two]), ("alone", [two])):
            batch = make_batch([row])
            batch.pop("labels")
            hidden[name] = model.hidden_states(**batch)[0]
    n1, n2 = len(one.ids), len(two.ids)
    torch.testing.assert_close(hidden["original"][n1:n1 + n2], hidden["changed"][n1:n1 + n2], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(hidden["original"][n1:n1 + n2], hidden["alone"][:n2], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(hidden["original"][:n1], hidden["changed"][:n1])


def test_image_token_mismatch_names_the_sample(pieces: list[Piece]) -> None:
    model = LongweaveModel(tiny())
    batch = make_batch([[pieces[0]], [pieces[1]]])
    pad_at = (batch["input_ids"][1] == SPECIAL.image_pad).nonzero()[0, 0]
    batch["input_ids"][1, pad_at] = 100
    with pytest.raises(ValueError, match=r"sample 'row1': image tokens do not match the images: image \d+ of the "
                                         r"batch: its <\|image_pad\|> run at offset \d+ holds \d+ tokens but its grid"):
        model(**batch)
    batch = make_batch([[pieces[0]], [pieces[1]]])
    n_first = len(pieces[0].images)
    batch["image_grid"] = batch["image_grid"][:n_first]
    with pytest.raises(ValueError, match=r"sample 'row1': .* more <\|image_pad\|> runs"):
        model(**batch)


def test_chunked_cross_entropy_equals_the_full_loss() -> None:
    hidden = torch.randn(37, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (37,))
    loss = chunked_cross_entropy(hidden, weight, targets, chunk=8)
    (2.0 * loss).backward()
    h_ref, w_ref = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    ref = F.cross_entropy(h_ref @ w_ref.t(), targets, reduction="sum")
    (2.0 * ref).backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(hidden.grad, h_ref.grad)
    torch.testing.assert_close(weight.grad, w_ref.grad)


@pytest.mark.parametrize("change, match", [
    (dict(layer_pattern=("kda", "gdn")), r"ModelConfig.layer_pattern: must be a non-empty sequence"),
    (dict(n_layers=3), r"ModelConfig.attn_res.n_blocks: must divide the 6 sublayers"),
    (dict(moe=MoEConfig(n_dense_layers=9)), r"ModelConfig.moe.n_dense_layers: must be <= n_layers=4"),
    (dict(d_model=0), r"ModelConfig.d_model: must be a positive int, got 0"),
    (dict(checkpoint_layers=5), r"ModelConfig.checkpoint_layers: must be true, false or a layer count in \[0, 4\], "
                                r"got 5"),
])
def test_config_errors_name_the_field(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(tiny(), **change)


def test_only_the_first_n_layers_recompute(pieces: list[Piece]) -> None:
    """checkpoint_layers = N runs decoder layers 0..N-1 twice per step (forward, then the backward's recompute) and
    the others once; the loss and every gradient are the same whichever layers recompute or keep their routed rows
    (AttnRes one sublayer at a time: in two phases the blocks of recomputed layers would sum in another order)."""
    batch = make_batch([[pieces[0], pieces[1]]])
    torch.manual_seed(0)
    config = tiny()
    config.attn_res.two_phase = False
    model = LongweaveModel(config)
    calls = [0] * len(model.decoder.layers)
    for i, layer in enumerate(model.decoder.layers):
        layer.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))

    def step(setting: bool | int, keep_routed_rows: bool = False) -> tuple[list[int], float, dict[str, torch.Tensor]]:
        calls[:] = [0] * len(calls)
        model.config.checkpoint_layers, model.config.keep_routed_rows = setting, keep_routed_rows
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        return list(calls), loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    runs = {setting: step(setting) for setting in (False, 2, True)}
    runs["kept"] = step(2, keep_routed_rows=True)   # the MoE layers not recomputed keep their routed rows too
    assert [runs[s][0] for s in (False, 2, True, "kept")] == [[1, 1, 1, 1], [2, 2, 1, 1], [2, 2, 2, 2], [2, 2, 1, 1]]
    plain_loss, plain_grads = runs[False][1:]
    for setting in (2, True, "kept"):
        loss, grads = runs[setting][1:]
        assert loss == plain_loss and grads.keys() == plain_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, plain_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_config_round_trips_through_a_dict() -> None:
    config = tiny()
    assert ModelConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match=r"ModelConfig.kda: unknown fields \['heads'\]"):
        ModelConfig.from_dict({**config.to_dict(), "kda": {"heads": 2}})
    with pytest.raises(ValueError, match=r"MoEConfig.top_k: must be < n_experts=8, got 8"):
        MoEConfig(n_experts=8, top_k=8)


def test_finite_check_names_the_first_non_finite_module(pieces: list[Piece]) -> None:
    """A healthy batch reports nothing; an inf planted in layer 0's dense FFN is named first in forward order (the
    modules after it are listed too, those before it are not)."""
    from trainer.model.finite_check import finite_check

    torch.manual_seed(0)
    model = LongweaveModel(dataclasses.replace(tiny(), checkpoint_layers=True))
    batch = make_batch([[pieces[0], pieces[1]]])
    clean = finite_check(model, batch)
    assert clean.outputs == [] and clean.gradients == {} and clean.loss > 9.0
    with torch.no_grad():
        model.decoder.layers[0].ffn.w13.weight[0, 0] = float("inf")
    broken = finite_check(model, batch)
    assert broken.outputs[0] == "decoder.layers.0.ffn.w13", broken.outputs[:3]
    assert "decoder.layers.0.mixer" not in broken.outputs and "decoder.layers.1.mixer" in broken.outputs
    # Either the gradients below the inf are non-finite, or the recompute (NaN tokens routed anew) stopped the
    # backward, which the report says instead of raising.
    assert broken.gradients or broken.backward_error
    assert "  decoder.layers.0.ffn.w13" in broken.lines()
    model.config.checkpoint_layers = False   # no recompute: the backward runs through and poisons what lies below
    plain = finite_check(model, batch)
    assert plain.backward_error is None and plain.gradients["decoder.layers.0.mixer.q_proj.weight"] > 0


def test_attn_res_in_two_phases_matches_one_sublayer_at_a_time(pieces: list[Piece]) -> None:
    """``tiny`` with its AttnRes blocks' parts mixed at once gives the loss and gradients of one mixture per
    sublayer, with no layer recomputed (every block in two phases) and with two (the first blocks one at a time)."""
    batch = make_batch([[pieces[0], pieces[1]]])
    results = {}
    for two_phase, recompute in ((False, False), (True, False), (True, 2)):
        torch.manual_seed(0)
        config = dataclasses.replace(tiny(), checkpoint_layers=recompute)
        config.attn_res.two_phase = two_phase
        model = LongweaveModel(config)
        loss = model(**batch).loss
        loss.backward()
        results[two_phase, recompute] = loss.item(), {n: p.grad for n, p in model.named_parameters()
                                                      if p.grad is not None}
    plain_loss, plain_grads = results[False, False]
    for key in ((True, False), (True, 2)):
        loss, grads = results[key]
        assert loss == pytest.approx(plain_loss, rel=1e-6) and grads.keys() == plain_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, plain_grads[name], rtol=1e-4, atol=1e-6, msg=name)
