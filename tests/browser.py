"""Headless Chromium for the tests of pages: the DOM after the page's scripts ran, a screenshot,
and the screenshot's pixels (a small PNG reader, so the tests need no imaging package).

Chromium comes from the system (``bash scripts/install_chromium.sh``, which ``make test`` runs).
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run")


def chromium() -> str:
    for name in NAMES:
        found = shutil.which(name)
        if found:
            return found
    pytest.fail(f"no Chromium on PATH (looked for {', '.join(NAMES)}); install it: bash scripts/install_chromium.sh")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([chromium(), *FLAGS, *args], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"chromium {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done


def dump_dom(page: Path) -> str:
    """The page's DOM once its scripts have run, as HTML."""
    return _run("--virtual-time-budget=10000", "--dump-dom", page.resolve().as_uri()).stdout


def screenshot(page: Path, out: Path, width: int = 1400, height: int = 1400) -> Path:
    _run(
        "--virtual-time-budget=10000", f"--window-size={width},{height}", f"--screenshot={out}", page.resolve().as_uri()
    )
    assert out.is_file(), f"chromium wrote no screenshot to {out}"
    return out


class Elements(HTMLParser):
    """Every element's tag and attributes, in document order."""

    def __init__(self, markup: str) -> None:
        super().__init__()
        self.found: list[tuple[str, dict[str, str]]] = []
        self.texts: list[tuple[str, str]] = []  # (the tag last opened, its text), in document order
        self.feed(markup)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.found.append((tag, {key: value or "" for key, value in attrs}))

    def handle_data(self, data: str) -> None:
        if data.strip() and self.found:
            self.texts.append((self.found[-1][0], data.strip()))

    def with_class(self, name: str) -> list[dict[str, str]]:
        return [attrs for _, attrs in self.found if name in attrs.get("class", "").split()]


def png_pixels(path: Path) -> tuple[int, int, list[tuple[int, int, int]]]:
    """Width, height and RGB pixels of an 8-bit RGB or RGBA, non-interlaced PNG (what Chromium writes)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    offset, idat, header = 8, b"", b""
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        kind, body = data[offset + 4 : offset + 8], data[offset + 8 : offset + 8 + length]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            idat += body
        offset += 12 + length
    width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert depth == 8 and color in (2, 6) and interlace == 0, f"{path}: depth {depth}, color type {color}"
    channels = 3 if color == 2 else 4
    raw, stride = zlib.decompress(idat), width * channels
    rows: list[bytearray] = []
    previous = bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up, corner = previous[i], previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + up) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 0xFF
        rows.append(line)
        previous = line
    pixels = [(row[i], row[i + 1], row[i + 2]) for row in rows for i in range(0, stride, channels)]
    return width, height, pixels
