"""Open a page in headless Chromium: the DOM after its scripts ran, console messages, a screenshot.

Used by the tests and by the docs script to check that a report renders in a real browser.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from PIL import Image

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")
_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-default-apps",
    "--enable-logging=stderr", "--v=0", "--virtual-time-budget=3000",
)


def find_chromium() -> str | None:
    """The path of a Chromium (or Chrome) executable, or None."""
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


def _run(browser: str, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run([browser, *_FLAGS, f"--user-data-dir={profile}", *args],
                              capture_output=True, text=True, timeout=timeout)


def console_messages(stderr: str) -> list[str]:
    """The page's console lines (``CONSOLE`` log entries) in Chromium's stderr log."""
    return [line for line in stderr.splitlines() if re.search(r":CONSOLE\(\d+\)|Uncaught", line)]


def _palette_png(path: Path) -> None:
    """Re-encode a screenshot with a 256-colour palette: plots and text lose nothing visible,
    and the file shrinks by half or more."""
    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)


def render(page: Path, screenshot: Path | None = None, size: tuple[int, int] = (1400, 1000),
           timeout: float = 120) -> tuple[str, list[str]]:
    """(DOM after load, console messages) of ``page``; also a PNG screenshot when asked."""
    browser = find_chromium()
    if browser is None:
        raise FileNotFoundError("no Chromium found (apt-get install chromium)")
    url = Path(page).resolve().as_uri()
    dumped = _run(browser, ["--dump-dom", url], timeout)
    messages = console_messages(dumped.stderr)
    if screenshot is not None:
        shot = _run(browser, [f"--screenshot={Path(screenshot).resolve()}", f"--window-size={size[0]},{size[1]}",
                              "--hide-scrollbars", url], timeout)
        messages += console_messages(shot.stderr)
        if not Path(screenshot).is_file():
            raise RuntimeError(f"Chromium wrote no screenshot:\n{shot.stderr[-2000:]}")
        _palette_png(Path(screenshot))
    return dumped.stdout, messages
