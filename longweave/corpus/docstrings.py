"""Real English prose that ships offline: the docstrings of installed Python packages and of the standard library.

Docstrings are read with ``ast`` from the source files, never by importing the modules, so collecting them has no side
effects and gives the same text on every machine with the same pinned packages and Python version.
"""
from __future__ import annotations

import ast
import dataclasses
import sysconfig
from collections.abc import Iterator
from pathlib import Path

__all__ = ["ModuleDocs", "package_root", "iter_module_docs"]

# Folders whose files are tests, vendored copies or tools rather than library documentation.
_SKIP_PARTS = frozenset(
    {"test", "tests", "testing", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__", "_vendor",
     "vendored", "_vendored", "turtledemo", "ensurepip", "benchmarks"}
)


@dataclasses.dataclass(frozen=True, slots=True)
class ModuleDocs:
    """The docstrings of one module in source order: ``(qualified name, docstring)`` pairs, module first."""

    module: str
    entries: tuple[tuple[str, str], ...]

    @property
    def chars(self) -> int:
        return sum(len(text) for _, text in self.entries)


def package_root(name: str) -> Path:
    """Folder of an installed package, or of the standard library for ``name == "stdlib"``."""
    if name == "stdlib":
        return Path(sysconfig.get_paths()["stdlib"])
    return Path(sysconfig.get_paths()["purelib"]) / name


def _walk(tree: ast.AST, prefix: str) -> Iterator[tuple[str, str]]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}.{node.name}"
            doc = ast.get_docstring(node)
            if doc:
                yield name, doc
            yield from _walk(node, name)


def iter_module_docs(package: str, *, min_chars: int = 1) -> Iterator[ModuleDocs]:
    """Every module of ``package`` (sorted by path) that holds at least ``min_chars`` of docstrings."""
    root = package_root(package)
    if not root.is_dir():
        raise FileNotFoundError(f"package {package!r} not found at {root}")
    prefix = "" if package == "stdlib" else package
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _SKIP_PARTS.intersection(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError):
            continue  # a few shipped files are templates or Python-2 relics; they hold no prose we need
        parts = [p for p in rel.with_suffix("").parts if p != "__init__"]
        module = ".".join([prefix, *parts] if prefix else parts) or package
        entries = []
        doc = ast.get_docstring(tree)
        if doc:
            entries.append((module, doc))
        entries.extend(_walk(tree, module))
        found = ModuleDocs(module=module, entries=tuple(entries))
        if entries and found.chars >= min_chars:
            yield found
