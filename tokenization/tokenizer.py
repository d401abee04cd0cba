"""Text tokenizer: any Hugging Face ``tokenizer.json`` that holds the special tokens of the token layout.

Special-token strings inside document text are encoded as ordinary text (``encode_special_tokens``), so a web page
that happens to contain ``<|eos|>`` cannot end a document early or fake an image.
"""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from tokenization.special import BOS, EOS, IMAGE_END, IMAGE_PAD, IMAGE_START, PAD, SPECIAL_TOKENS
from vision.geometry import DEFAULT_POLICY, VisionPolicy

__all__ = ["DEFAULT_TOKENIZER_PATH", "SpecialIds", "TextTokenizer", "load_tokenizer"]

DEFAULT_TOKENIZER_PATH = Path(__file__).parent / "data" / "tokenizer.json"


@dataclasses.dataclass(frozen=True, slots=True)
class SpecialIds:
    bos: int
    eos: int
    pad: int
    image_start: int
    image_pad: int
    image_end: int

    @property
    def image_ids(self) -> tuple[int, int, int]:
        return self.image_start, self.image_pad, self.image_end


class TextTokenizer:
    """A loaded ``tokenizer.json`` plus the ids of the layout's special tokens and a content fingerprint."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            raw = self.path.read_bytes()
            self._hf = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception on malformed JSON
            raise ValueError(f"cannot load tokenizer {str(self.path)!r}: {exc}") from None
        self._sha256 = hashlib.sha256(raw).hexdigest()
        self._hf.encode_special_tokens = True
        ids = {}
        for token in SPECIAL_TOKENS:
            token_id = self._hf.token_to_id(token)
            if token_id is None:
                raise ValueError(f"tokenizer {str(self.path)!r} lacks the special token {token!r}")
            ids[token] = token_id
        self.special = SpecialIds(
            bos=ids[BOS], eos=ids[EOS], pad=ids[PAD],
            image_start=ids[IMAGE_START], image_pad=ids[IMAGE_PAD], image_end=ids[IMAGE_END],
        )

    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` alone: no BOS/EOS, special-token strings treated as text."""
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Like :meth:`encode` for many texts at once (the Rust side runs them in parallel)."""
        return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int] | np.ndarray) -> str:
        """Text of ``ids``, special tokens included verbatim."""
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def id_to_token(self, token_id: int) -> str | None:
        return self._hf.id_to_token(token_id)

    def fingerprint(self, policy: VisionPolicy = DEFAULT_POLICY) -> str:
        """sha256 over the tokenizer file and the vision policy: shards and runs must agree on both."""
        return hashlib.sha256(f"{self._sha256}:{policy.fingerprint()}".encode()).hexdigest()

    def encode_document(self, document, policy: VisionPolicy = DEFAULT_POLICY):  # noqa: ANN001 - see layout
        """Token layout of one document; see :func:`tokenization.layout.encode_document`."""
        from tokenization.layout import encode_document

        return encode_document(document, self, policy)


def load_tokenizer(path: str | Path | None = None) -> TextTokenizer:
    """The tokenizer at ``path``, or the shipped default byte-level BPE."""
    return TextTokenizer(path or DEFAULT_TOKENIZER_PATH)
