"""``inspect --verify``: every shard against its manifest, every sample against the contract, every document accounted.

Per shard: sha256, size, and the sample / token / padding / image counts the manifest claims. Per sample: the checks of
:mod:`pipeline.inspect.sample_checks`. Per stage: each packed document's pieces tile ``[0, length)`` exactly once, in
piece order, the last one ending with ``<|eos|>``; the packed documents and the dead-letter files match the manifest's
counts; and packed + dead-lettered + not selected equals the input. Every problem is kept and listed (file, sample key
or line, what is wrong); a damaged tar is one more problem, never a crash.

The sha256 of a shard is computed on a second thread (``hashlib`` releases the GIL) while the first parses it, so the
check costs little more than hashing the files.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import mmap
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from pipeline.dead_letters import DeadLetter
from pipeline.inspect.reader import ShardReadError, expand_tar, group_by_key, open_shards
from pipeline.inspect.sample_checks import PieceSeen, SampleChecks, check_sample
from pipeline.inspect.target import StageTarget, Target
from tokenization.tokenizer import TextTokenizer
from vision.geometry import VisionPolicy

__all__ = ["Problem", "VerifyReport", "verify", "sha256_file", "print_report"]
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class Problem:
    """``where`` is a sample key, ``line N`` of a dead-letter file, or empty for the file as a whole."""

    file: str
    where: str
    what: str


@dataclasses.dataclass(slots=True)
class VerifyReport:
    problems: list[Problem] = dataclasses.field(default_factory=list)
    shards: int = 0
    samples: int = 0
    bytes: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {"ok": self.ok, "shards": self.shards, "samples": self.samples, "bytes": self.bytes,
                "seconds": round(self.seconds, 3), "problems": [dataclasses.asdict(p) for p in self.problems]}


def sha256_file(path: Path) -> tuple[str, int]:
    """``(hex digest, size)`` of a file, hashed from a memory map in one call so the GIL stays released."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size == 0:
            return hashlib.sha256().hexdigest(), 0
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return hashlib.sha256(mapped).hexdigest(), size


@dataclasses.dataclass(slots=True)
class _ShardTally:
    samples: int = 0
    tokens: int = 0
    pad_tokens: int = 0
    images: int = 0


class _StageVerifier:
    """Checks one stage; problems go to ``report``, pieces are kept for the reconciliation at the end."""

    def __init__(self, target: Target, stage: StageTarget, checks: SampleChecks, report: VerifyReport,
                 hasher: ThreadPoolExecutor) -> None:
        self.target, self.stage, self.checks, self.report, self.hasher = target, stage, checks, report, hasher
        self.pieces: dict[str, list[tuple[PieceSeen, str]]] = defaultdict(list)
        self.manifest_file = target.relative(stage.manifest_path)

    def problem(self, file: str, where: str, what: str) -> None:
        self.report.problems.append(Problem(file, where, what))

    def run(self) -> None:
        for problem in self.stage.manifest_problems:
            self.problem(self.manifest_file, "", problem)
        self._check_listing()
        for path in self.stage.shards:
            self._verify_shard(path)
        if self.stage.whole_stage:
            self._reconcile_pieces()

    def _check_listing(self) -> None:
        manifest = self.stage.manifest
        if manifest is None:
            return
        listed = {s.path for s in manifest.shards}
        found = {p.name for p in self.stage.shards}
        if self.stage.whole_stage:
            for name in sorted(listed - found):
                self.problem(self.manifest_file, "", f"lists shard {name}, which does not exist")
        for path in self.stage.shards:
            if path.name not in listed:
                self.problem(self.target.relative(path), "", "shard not listed in the manifest")

    def _verify_shard(self, path: Path) -> None:
        file = self.target.relative(path)
        digest = self.hasher.submit(sha256_file, path)
        tally = _ShardTally()

        def handler(error: ShardReadError) -> None:
            self.problem(file, error.key or "", error.problem)

        for raw in group_by_key(expand_tar(open_shards([path], handler), handler), handler):
            result = check_sample(raw, self.checks)
            key = str(raw["__key__"])
            for what in result.problems:
                self.problem(file, key, what)
            for piece in result.pieces:
                self.pieces[piece.doc_id].append((piece, file))
            tally.samples += 1
            tally.tokens += result.tokens
            tally.pad_tokens += result.pad_tokens
            tally.images += result.images
        try:
            sha256, size = digest.result()
        except OSError as exc:
            self.problem(file, "", f"cannot hash: {exc.strerror}")
            return
        self.report.shards += 1
        self.report.samples += tally.samples
        self.report.bytes += size
        listed = self.stage.manifest.shards if self.stage.manifest else ()
        entry = next((s for s in listed if s.path == path.name), None)
        if entry is None:
            return
        if sha256 != entry.sha256:
            self.problem(file, "", f"sha256 {sha256} differs from the manifest's {entry.sha256}")
        for name, found, claimed in (("bytes", size, entry.bytes), ("samples", tally.samples, entry.samples),
                                     ("tokens", tally.tokens, entry.tokens),
                                     ("pad tokens", tally.pad_tokens, entry.pad_tokens),
                                     ("images", tally.images, entry.images)):
            if found != claimed:
                self.problem(file, "", f"holds {found:,} {name}; the manifest says {claimed:,}")

    def _reconcile_pieces(self) -> None:
        """Each document's pieces: indices 0..n-1 once each, contiguous from token 0, only the last ending in EOS."""
        for doc_id, seen in sorted(self.pieces.items()):
            seen.sort(key=lambda item: (item[0].piece_index, item[0].start))
            position = 0
            for i, (piece, file) in enumerate(seen):
                label = f"document {doc_id!r} piece {piece.piece_index}"
                if piece.piece_index != i:
                    what = "appears twice" if piece.piece_index < i else f"follows piece {i - 1}: piece {i} is missing"
                    self.problem(file, piece.key, f"{label} {what}")
                    break
                if piece.start != position:
                    gap = ("overlaps the previous piece" if piece.start < position
                           else "leaves a gap after the previous piece")
                    self.problem(file, piece.key, f"{label} starts at token {piece.start}: {gap} (ends at {position})")
                position = piece.end
                last = i == len(seen) - 1
                if piece.ends_with_eos is not None and piece.ends_with_eos != last:
                    what = ("is the last piece found but does not end with <|eos|>: later pieces are missing" if last
                            else "ends with <|eos|> but is not the last piece")
                    self.problem(file, piece.key, f"{label} {what}")

    def packed_documents(self) -> set[str]:
        return set(self.pieces)


def _read_dead_letters(target: Target, report: VerifyReport) -> list[tuple[str, int, DeadLetter]]:
    """Every dead letter with its file and line; unreadable lines and misfiled reasons are problems."""
    letters = []
    if target.dead_letters is None:
        return letters
    for path in sorted(target.dead_letters.glob("*.jsonl")):
        file = target.relative(path)
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                try:
                    letter = DeadLetter.from_json(line)
                except (ValueError, TypeError) as exc:
                    report.problems.append(Problem(file, f"line {number}", f"not a dead letter ({exc})"))
                    continue
                if letter.reason != path.stem:
                    report.problems.append(Problem(file, f"line {number}", f"reason {letter.reason!r} in the file of "
                                                                           f"{path.stem!r}"))
                letters.append((file, number, letter))
    return letters


def _reconcile_documents(verifier: _StageVerifier, letters: list[tuple[str, int, DeadLetter]], target: Target) -> None:
    """The stage's documents: packed ones found in the shards, dead letters in the files, both match the manifest."""
    stage, manifest = verifier.stage, verifier.stage.manifest
    packed = verifier.packed_documents()
    if manifest is None:
        return
    if len(packed) != manifest.documents.packed:
        verifier.problem(verifier.manifest_file, "", f"documents.packed is {manifest.documents.packed:,}, "
                                                     f"the shards hold {len(packed):,} documents")
    mine = [(file, n, d) for file, n, d in letters if d.stage in ("", stage.name)]
    counted = Counter(d.reason for _, _, d in mine)
    if target.dead_letters is None and manifest.documents.dead_lettered:
        verifier.problem(verifier.manifest_file, "", f"counts {manifest.documents.dead_lettered} dead letters, "
                                                     "but there is no dead_letters folder")
    elif target.dead_letters is not None:
        for reason in sorted(set(counted) | set(manifest.dead_letters)):
            found, claimed = counted.get(reason, 0), manifest.dead_letters.get(reason, 0)
            if found != claimed:
                file = target.relative(target.dead_letters / f"{reason}.jsonl")
                verifier.problem(file, "", f"{found} dead letters of stage {stage.name!r}; "
                                           f"its manifest counts {claimed}")
    for file, number, letter in mine:
        # duplicate_id letters name the id of the copy that was kept and packed.
        if letter.reason != "duplicate_id" and letter.doc_id in packed:
            verifier.problem(file, f"line {number}", f"document {letter.doc_id!r} is dead-lettered and also packed "
                                                     f"in stage {stage.name!r}")


def _check_fingerprints(target: Target, tokenizer: TextTokenizer, policy: VisionPolicy, report: VerifyReport) -> None:
    expected = {"tokenizer_fingerprint": tokenizer.fingerprint(policy), "vision_fingerprint": policy.fingerprint()}
    inputs = {}
    for stage in target.stages:
        if stage.manifest is None:
            continue
        file = target.relative(stage.manifest_path)
        for field, value in expected.items():
            if getattr(stage.manifest, field) != value:
                report.problems.append(Problem(file, "", f"{field} differs from the tokenizer and vision policy used "
                                                         "to verify (pass the pack run's --tokenizer)"))
        inputs[file] = (stage.manifest.input_fingerprint, stage.manifest.documents.input)
    if len(set(inputs.values())) > 1:
        for file, (fingerprint, count) in sorted(inputs.items()):
            report.problems.append(Problem(file, "", f"stages disagree on their input: this one has {count:,} input "
                                                     f"documents, fingerprint {fingerprint[:12]}…"))


def verify(target: Target, tokenizer: TextTokenizer, policy: VisionPolicy, *,
           decode_images: bool = False) -> VerifyReport:
    """Run every check over ``target``; the report lists the problems sorted by file, then place."""
    started = time.perf_counter()
    report = VerifyReport()
    _check_fingerprints(target, tokenizer, policy, report)
    letters = _read_dead_letters(target, report)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256") as hasher:
        for stage in target.stages:
            log.info("verifying stage %s: %d shard(s)", stage.name, len(stage.shards))
            checks = SampleChecks(stage=stage.name, seq_len=stage.seq_len, special=tokenizer.special,
                                  vocab_size=tokenizer.vocab_size, policy=policy, decode_images=decode_images)
            verifier = _StageVerifier(target, stage, checks, report, hasher)
            verifier.run()
            if stage.whole_stage:
                _reconcile_documents(verifier, letters, target)
    report.problems.sort()
    report.seconds = time.perf_counter() - started
    return report


def print_report(report: VerifyReport, console: Console) -> None:
    """Every problem as a table row (file, sample or line, what), then the verdict."""
    if report.problems:
        table = Table(title=f"{len(report.problems)} problem(s)")
        for column in ("file", "sample / line", "problem"):
            table.add_column(column, overflow="fold")
        for p in report.problems:
            table.add_row(Text(p.file), Text(p.where), Text(p.what))  # problem text is never markup
        console.print(table)
    verdict = "[green]OK[/green]" if report.ok else f"[red]{len(report.problems)} problem(s)[/red]"
    console.print(f"verified {report.shards} shard(s), {report.samples:,} samples, {report.bytes / 2**20:,.1f} MiB "
                  f"in {report.seconds:.2f} s: {verdict}")
