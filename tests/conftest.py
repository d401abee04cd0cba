"""Shared pytest set-up: GPU tests are skipped where there is no CUDA device."""
from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory: pytest.TempPathFactory):
    """A small real corpus (scikit-image module docs + shipped photos), built once per test session."""
    from longweave.corpus.build import CorpusConfig, build_corpus

    folder = tmp_path_factory.mktemp("corpus")
    build_corpus(folder, CorpusConfig(module_packages=("skimage",), subpackage_documents=()))
    return folder


@pytest.fixture(scope="session")
def full_corpus(tmp_path_factory: pytest.TempPathFactory):
    """The demo corpus (about 600 documents, 3M tokens): ``(folder, summary)``."""
    from longweave.corpus.build import build_corpus

    folder = tmp_path_factory.mktemp("full_corpus")
    return folder, build_corpus(folder)


@pytest.fixture(scope="session")
def packed_small(small_corpus, tmp_path_factory: pytest.TempPathFactory):
    """``longweave pack`` output of the small corpus for the 8k and 64k stages (FnApiRunner, in process)."""
    from longweave.cli import main

    out = tmp_path_factory.mktemp("packed")
    rc = main(["pack", "--input", str(small_corpus / "documents.jsonl"), "--format", "jsonl", "--output", str(out),
               "--image-root", str(small_corpus / "images"), "--stages", "8k,64k"])
    assert rc == 0
    return out


@pytest.fixture(scope="session")
def short_shards(small_corpus, tmp_path_factory: pytest.TempPathFactory):
    """The small corpus packed at 512 and 1024 tokens (stages ``s512``, ``s1k``): cheap tiny-model steps on a CPU."""
    from longweave.cli import main

    out = tmp_path_factory.mktemp("short_shards")
    (out / "stages.yaml").write_text(
        "stages:\n"
        "  - {name: s512, seq_len: 512, token_budget: 1, buckets: [{min_tokens: 0, max_tokens: null, weight: 1.0}]}\n"
        "  - {name: s1k, seq_len: 1024, token_budget: 1, buckets: [{min_tokens: 0, max_tokens: null, weight: 1.0}]}\n"
    )
    assert main(["pack", "--input", str(small_corpus / "documents.jsonl"), "--format", "jsonl",
                 "--output", str(out / "data"), "--image-root", str(small_corpus / "images"),
                 "--config", str(out / "stages.yaml")]) == 0
    return out / "data"
