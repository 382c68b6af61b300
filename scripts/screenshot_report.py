"""Render the HTML report in headless Chromium and save a screenshot: the check a person would do by eye.

    python scripts/screenshot_report.py [reports/cycles/index.html] [--out reports/cycles/screenshot.png]

Network is blocked for the page (a proxy that does not exist), so a report that pulled anything from a CDN
would show it. Exits 2 with a message when no Chromium is installed (Debian: apt-get install chromium).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def find_browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def screenshot(page: Path, out: Path, *, width: int = 1200, height: int = 3000, timeout: int = 120) -> Path:
    browser = find_browser()
    if browser is None:
        raise FileNotFoundError("no Chromium found (apt-get install chromium)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as profile:
        cmd = [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--proxy-server=127.0.0.1:9",
            "--proxy-bypass-list=<-loopback>",
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            f"--screenshot={out.resolve()}",
            page.resolve().as_uri(),
        ]
        subprocess.run(cmd, check=True, capture_output=True, timeout=timeout)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("page", nargs="?", default="reports/cycles/index.html")
    parser.add_argument("--out", default=None, help="PNG path (default: screenshot.png beside the page)")
    args = parser.parse_args()
    page = Path(args.page)
    if not page.exists():
        print(f"no report at {page}: run `lopd cycle` or `lopd report` first", file=sys.stderr)
        return 1
    try:
        path = screenshot(page, Path(args.out) if args.out else page.with_name("screenshot.png"))
    except FileNotFoundError as exc:
        print(f"screenshot skipped: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
