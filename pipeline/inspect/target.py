"""What ``longweave inspect PATH`` looks at: a ``pack`` output folder, one stage folder, or one shard.

A manifest that breaks the schema is still read as far as it can be (its problem is kept), so that ``--verify`` can
check the shards against whatever the manifest claims and report both, instead of stopping at the first error.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from schemas.errors import SchemaError
from schemas.manifest import MANIFEST_NAME, DocumentCounts, ShardEntry, ShardManifest
from schemas.stage import STAGE_ORDER, StageSpec

__all__ = ["StageTarget", "Target", "resolve_target", "load_manifest", "DEAD_LETTERS_DIR"]

DEAD_LETTERS_DIR = "dead_letters"


@dataclasses.dataclass(frozen=True, slots=True)
class StageTarget:
    """One stage to inspect. ``shards`` are the ``.tar`` files to read (all in the folder, or the one asked for);
    ``whole_stage`` is False when PATH named a single shard, so document reconciliation does not apply."""

    name: str
    folder: Path
    manifest: ShardManifest | None
    manifest_problems: tuple[str, ...]
    shards: tuple[Path, ...]
    whole_stage: bool

    @property
    def manifest_path(self) -> Path:
        return self.folder / MANIFEST_NAME

    @property
    def seq_len(self) -> int | None:
        return self.manifest.stage.seq_len if self.manifest else None


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """``root`` is the folder that problem paths are shown relative to."""

    root: Path
    stages: tuple[StageTarget, ...]
    dead_letters: Path | None  # the dead-letter folder, when PATH covers whole stages of a pack output

    def relative(self, path: Path) -> str:
        try:
            return path.relative_to(self.root).as_posix()
        except ValueError:
            return str(path)


def _same(value: object) -> object:
    return value


def load_manifest(path: Path) -> tuple[ShardManifest | None, tuple[str, ...]]:
    """The manifest at ``path`` and the problems found reading it (none when it is valid)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        return None, (f"cannot read: {exc.strerror}",)
    try:
        return ShardManifest.from_json(raw), ()
    except SchemaError as exc:
        problem = str(exc)
    # Keep what still parses, unvalidated, so the shards can be compared with what it claims.
    nested = {"stage": StageSpec.from_dict, "shards": lambda v: tuple(ShardEntry(**s) for s in v),
              "documents": lambda v: DocumentCounts(**v)}
    try:
        data = json.loads(raw)
        manifest = ShardManifest(**{f.name: nested.get(f.name, _same)(data[f.name])
                                    for f in dataclasses.fields(ShardManifest)})
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, (problem,)
    return manifest, (problem,)


def _stage(folder: Path, name: str | None, shards: tuple[Path, ...] | None) -> StageTarget:
    manifest, problems = load_manifest(folder / MANIFEST_NAME)
    return StageTarget(
        name=manifest.stage.name if manifest else (name or folder.name),
        folder=folder,
        manifest=manifest,
        manifest_problems=problems,
        shards=shards if shards is not None else tuple(sorted(folder.glob("*.tar"))),
        whole_stage=shards is None,
    )


def _stage_sort_key(folder: Path) -> tuple[int, str]:
    return (STAGE_ORDER.index(folder.name) if folder.name in STAGE_ORDER else len(STAGE_ORDER), folder.name)


def resolve_target(path: str | Path) -> Target:
    """Classify ``path``; raises ``FileNotFoundError`` / ``ValueError`` with a message fit for the command line."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder")
    if path.is_file():
        if path.suffix != ".tar":
            raise ValueError(f"{path}: not a shard (.tar), a stage folder or a pack output folder")
        stage = _stage(path.parent, path.name.split("-", 1)[0], (path,))
        return Target(root=path.parent, stages=(stage,), dead_letters=None)
    if (path / MANIFEST_NAME).exists() or any(path.glob("*.tar")):
        dead = path.parent / DEAD_LETTERS_DIR
        return Target(root=path.parent, stages=(_stage(path, None, None),),
                      dead_letters=dead if dead.is_dir() else None)
    folders = sorted((p for p in path.iterdir() if p.is_dir() and p.name != DEAD_LETTERS_DIR
                      and ((p / MANIFEST_NAME).exists() or any(p.glob("*.tar")))), key=_stage_sort_key)
    if not folders:
        raise ValueError(f"{path}: holds no stage folder (<stage>/{MANIFEST_NAME}) and no shard")
    dead = path / DEAD_LETTERS_DIR
    return Target(root=path, stages=tuple(_stage(f, None, None) for f in folders),
                  dead_letters=dead if dead.is_dir() else None)
