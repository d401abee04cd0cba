"""Tokenizer round trips on real text, special-token safety, fingerprints, and the interleaved token layout."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from longweave.corpus.docstrings import iter_module_docs
from schemas import Document, SchemaError, Segment
from tokenization import SPECIAL_TOKENS, load_tokenizer
from tokenization.tokenizer import TextTokenizer
from vision.geometry import DEFAULT_POLICY, VisionPolicy, merged_grid

# Real non-ASCII prose: opening sentences of the Universal Declaration of Human Rights (public domain) in five scripts.
UDHR = [
    "Alle Menschen sind frei und gleich an Würde und Rechten geboren.",
    "Tous les êtres humains naissent libres et égaux en dignité et en droits.",
    "Все люди рождаются свободными и равными в своем достоинстве и правах.",
    "人人生而自由,在尊严和权利上一律平等。",
    "Όλοι οι άνθρωποι γεννιούνται ελεύθεροι και ίσοι στην αξιοπρέπεια και τα δικαιώματα.",
]


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return load_tokenizer()


def test_default_tokenizer_has_layout_specials(tokenizer: TextTokenizer) -> None:
    assert 30000 <= tokenizer.vocab_size <= 33000
    ids = [tokenizer._hf.token_to_id(t) for t in SPECIAL_TOKENS]
    assert ids == list(range(len(SPECIAL_TOKENS)))
    assert tokenizer.special.image_pad == ids[4]


def test_round_trip_on_real_text(tokenizer: TextTokenizer) -> None:
    texts = [text for module in iter_module_docs("skimage") for _, text in module.entries][:300]
    texts += UDHR + ["tabs\tand\r\nCRLF,   runs of spaces, emoji 🧵🪡 and a stray \u200b zero-width space"]
    assert len(texts) > 250
    for text in texts:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
    english = " ".join(texts[:50])
    assert len(english) / len(tokenizer.encode(english)) > 3.0  # a trained BPE compresses English prose


def test_special_token_strings_in_text_stay_text(tokenizer: TextTokenizer) -> None:
    text = "a page that mentions <|eos|> and <|image_pad|> literally"
    ids = tokenizer.encode(text)
    assert not set(ids) & set(range(len(SPECIAL_TOKENS)))
    assert tokenizer.decode(ids) == text


def test_loads_any_tokenizer_json_and_checks_specials(tmp_path, tokenizer: TextTokenizer) -> None:
    bad = tmp_path / "no_image_end.json"
    bad.write_text(tokenizer.path.read_text().replace("<|image_end|>", "<|img_end|>"))
    with pytest.raises(ValueError, match=r"no_image_end\.json.*<\|image_end\|>"):
        load_tokenizer(bad)
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        (tmp_path / "broken.json").write_text("{")
        load_tokenizer(tmp_path / "broken.json")


def test_fingerprint_covers_tokenizer_and_policy(tmp_path, tokenizer: TextTokenizer) -> None:
    assert tokenizer.fingerprint() == load_tokenizer().fingerprint()
    assert tokenizer.fingerprint() != tokenizer.fingerprint(VisionPolicy(max_tokens=2048))
    copy = tmp_path / "tok.json"
    copy.write_bytes(tokenizer.path.read_bytes() + b"\n")  # same tokenizer, different file: a different pair
    assert load_tokenizer(copy).fingerprint() != tokenizer.fingerprint()


def test_layout_of_interleaved_document(tokenizer: TextTokenizer) -> None:
    sp = tokenizer.special
    doc = Document(
        id="d", source="t",
        segments=(
            Segment.of_text(UDHR[0]),
            Segment.of_image(ref="a.png", width=300, height=200),
            Segment.of_text(UDHR[1]),
            Segment.of_image(ref="b.png", width=1000, height=1000),
        ),
    ).validate()
    layout = tokenizer.encode_document(doc)
    ids = layout.ids
    assert ids.dtype == np.uint32
    t0, t1 = tokenizer.encode(UDHR[0]), tokenizer.encode(UDHR[1])
    g0, g1 = merged_grid(200, 300, DEFAULT_POLICY), merged_grid(1000, 1000, DEFAULT_POLICY)
    n0, n1 = g0[0] * g0[1], g1[0] * g1[1]
    expected = ([sp.bos] + t0 + [sp.image_start] + [sp.image_pad] * n0 + [sp.image_end] + t1
                + [sp.image_start] + [sp.image_pad] * n1 + [sp.image_end] + [sp.eos])
    assert ids.tolist() == expected
    s0, s1 = layout.image_spans
    assert (s0.start, s0.n_tokens, s0.grid_h, s0.grid_w) == (1 + len(t0) + 1, n0, *g0)
    assert (ids[s1.start - 1], ids[s1.start + s1.n_tokens]) == (sp.image_start, sp.image_end)
    assert layout.segment_ends == (1 + len(t0), 1 + len(t0) + n0 + 2, 1 + len(t0) + n0 + 2 + len(t1), len(ids))


def test_layout_requires_decoded_images(tokenizer: TextTokenizer) -> None:
    doc = Document(id="d9", source="t", segments=(Segment.of_image(ref="a.png"),)).validate()
    with pytest.raises(SchemaError, match=r"document 'd9': field 'segments\[0\]\.width'"):
        tokenizer.encode_document(doc)
    extreme = dataclasses.replace(doc, segments=(Segment.of_image(ref="a.png", width=5000, height=4),))
    with pytest.raises(SchemaError, match="aspect ratio"):
        tokenizer.encode_document(extreme)
