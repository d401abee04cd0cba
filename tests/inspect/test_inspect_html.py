"""``inspect --html``: the report opens in headless Chromium, renders something, and shows the stage numbers.

The set-up installs Debian's ``chromium`` with apt when it is missing (about 70 s on the CI box, measured 2026-12-02);
the tests are skipped only where there is no apt to install it with.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from inspect_surgery import manifest
from PIL import Image

from longweave.cli import main

CHROMIUM = Path("/usr/bin/chromium")
_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
          "--disable-background-networking", "--disable-component-update", "--disable-sync")


@pytest.fixture(scope="session")
def chromium() -> Path:
    if CHROMIUM.exists():
        return CHROMIUM
    apt = shutil.which("apt-get")
    if apt is None:
        pytest.skip("chromium is not installed and apt-get is not available to install it")
    install = [apt, "install", "-y", "chromium"]
    result = subprocess.run(install, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:  # stale or missing package lists
        subprocess.run([apt, "update"], capture_output=True, text=True, timeout=600)
        result = subprocess.run(install, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0 and CHROMIUM.exists(), f"apt-get install chromium failed:\n{result.stderr[-2000:]}"
    return CHROMIUM


def _chromium(binary: Path, profile: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(binary), *_FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True,
                          timeout=120, check=True)


@pytest.fixture(scope="module")
def report(packed_small: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("report") / "report.html"
    assert main(["inspect", str(packed_small), "--html", str(path)]) == 0
    return path


def test_report_is_self_contained(report: Path) -> None:
    page = report.read_text()
    links = re.findall(r'(?:src|href)="([^"]*)"', page)
    assert links and all(link.startswith("data:") for link in links)
    assert len(re.findall(r'src="data:image/png;base64,', page)) == 3  # the three plots
    assert re.search(r'src="data:image/jpeg;base64,', page)  # sample thumbnails
    assert "<script" not in page


def test_report_renders_in_chromium(chromium: Path, report: Path, packed_small: Path, tmp_path: Path) -> None:
    shot = tmp_path / "shot.png"
    _chromium(chromium, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1280,2000", report.as_uri())
    pixels = np.asarray(Image.open(shot).convert("L"), dtype=np.float64)
    assert pixels.shape == (2000, 1280)
    assert pixels.std() > 20  # not blank: text, tables and plots
    assert (pixels < 128).mean() > 0.01
    dom = _chromium(chromium, tmp_path / "profile", "--dump-dom", report.as_uri()).stdout
    text = re.sub(r"<[^>]+>", " ", dom)
    for stage in ("8k", "64k"):
        m = manifest(packed_small / stage)
        assert re.search(rf"\b{stage}\b", text)
        row = re.search(rf"<tr><td>{stage}</td>(.*?)</tr>", dom).group(1)
        cells = re.findall(r"<td>([^<]*)</td>", row)
        assert f"{m['packing']['samples']:,}" in cells and f"{m['packing']['fill_ratio']:.2%}" in cells
