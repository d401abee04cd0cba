"""Train the default byte-level BPE tokenizer shipped as ``tokenization/data/tokenizer.json``.

Source: the docstrings (read with ``ast``, see ``longweave.corpus.docstrings``) of the Python 3.11 standard library and
of the pinned numpy, scipy and matplotlib packages: about 9.5 MB of real English technical prose, available offline.
Exact command (run from the repository root after ``make install``)::

    .venv/bin/python -m tokenization.train_bpe --vocab-size 32768 --output tokenization/data/tokenizer.json

Byte-level pre-tokenisation with no normaliser, so ``decode(encode(text)) == text`` for any Unicode string.
"""
from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from longweave.corpus.docstrings import iter_module_docs
from tokenization.special import SPECIAL_TOKENS

TRAINING_PACKAGES = ("stdlib", "numpy", "scipy", "matplotlib")
log = logging.getLogger(__name__)


def training_texts(packages: tuple[str, ...] = TRAINING_PACKAGES) -> Iterator[str]:
    for package in packages:
        for module in iter_module_docs(package):
            for _, text in module.entries:
                yield text


def train(vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tokenizer.train_from_iterator(training_texts(), trainer=trainer)
    return tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=32768)
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "data" / "tokenizer.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    tokenizer = train(args.vocab_size)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.output))
    log.info("wrote %s (vocabulary %d)", args.output, tokenizer.get_vocab_size())


if __name__ == "__main__":
    main()
