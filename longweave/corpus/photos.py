"""Real photographs that ship inside pip packages, each with a caption taken from its package's own prose.

scikit-image documents every file of its data folder in the docstring of the function that loads it; those docstrings
become the captions placed before each image in the sample corpus.
"""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from longweave.corpus.docstrings import package_root

__all__ = ["Photo", "shipped_photos"]

# scikit-image data file -> the loader function whose docstring describes it. Synthetic test patterns are left out.
_SKIMAGE_PHOTOS = {
    "astronaut.png": "astronaut", "brick.png": "brick", "camera.png": "camera", "cell.png": "cell",
    "chelsea.png": "chelsea", "clock_motion.png": "clock", "coffee.png": "coffee", "coins.png": "coins",
    "color.png": "colorwheel", "grass.png": "grass", "gravel.png": "gravel", "horse.png": "horse",
    "hubble_deep_field.jpg": "hubble_deep_field", "ihc.png": "immunohistochemistry", "logo.png": "logo",
    "microaneurysms.png": "microaneurysms", "moon.png": "moon", "motorcycle_left.png": "stereo_motorcycle",
    "page.png": "page", "retina.jpg": "retina", "rocket.jpg": "rocket", "text.png": "text",
}


@dataclasses.dataclass(frozen=True, slots=True)
class Photo:
    name: str  # file name in the corpus image folder, unique
    path: Path  # where the package ships it
    caption: str


def _description(doc: str) -> str:
    """The prose of a loader's docstring: everything before its numpydoc ``Returns`` section."""
    return doc.split("\nReturns\n", 1)[0].strip()


def shipped_photos() -> list[Photo]:
    """The photographs, sorted by name; raises if a pinned package no longer ships one (the corpus must not drift)."""
    data = package_root("skimage") / "data"
    tree = ast.parse((data / "_fetchers.py").read_bytes())
    docs = {n.name: ast.get_docstring(n) or "" for n in tree.body if isinstance(n, ast.FunctionDef)}
    photos = []
    for filename, loader in _SKIMAGE_PHOTOS.items():
        path = data / filename
        if not path.is_file() or not docs.get(loader):
            raise FileNotFoundError(f"scikit-image no longer ships {filename} with a documented loader {loader}()")
        photos.append(Photo(name=f"skimage-{filename}", path=path, caption=_description(docs[loader])))
    hopper = package_root("matplotlib") / "mpl-data" / "sample_data" / "grace_hopper.jpg"
    if not hopper.is_file():
        raise FileNotFoundError(f"matplotlib no longer ships {hopper}")
    photos.append(Photo(name="matplotlib-grace_hopper.jpg", path=hopper,
                        caption="Rear Admiral Grace Hopper, computer scientist, in uniform (matplotlib sample data)."))
    return sorted(photos, key=lambda p: p.name)
