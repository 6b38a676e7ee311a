"""Refresh the TensorBoard screenshots in docs/img from a real demo run, at TensorBoard's defaults.

Runs ``probe demo`` (unless ``--logdir`` already holds one), starts ``tensorboard --logdir LOGDIR
--port PORT --samples_per_plugin images=100`` on localhost (as README says to), and opens each tab
in a headless Chromium with a fresh profile, so every setting is TensorBoard's default (its
settings live in the browser's storage, not in the log directory)::

    pip install playwright                      # the browser driver; the browser itself:
    apt-get install chromium                    # or: python -m playwright install chromium
    python docs/img/refresh.py                  # writes docs/img/*.png
    python docs/img/refresh.py --logdir runs/demo --out /tmp/shots

Screenshots (1600 x 1000 pixels, TensorBoard's own layout at that size):

==============================  ================================================================
file                            what
==============================  ================================================================
``time_series.png``             Time Series as it opens: the headline group ``attention``
``time_series_groups.png``      the same tab scrolled down: the loss, then the collapsed groups
``time_series_outliers.png``    as it opens, with *Ignore outliers in chart scaling* unticked
``custom_scalars.png``          Custom Scalars as it opens: the loss and the headline, then bands
``images.png``                  Images as it opens: the entropy heatmaps of both runs
``histograms.png``              Histograms as it opens
``text.png``                    Text: the table of attention sites
==============================  ================================================================
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
VIEWPORT = {"width": 1600, "height": 1000}
RUNS = ("with-divisor", "no-divisor")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _chromium(given: Optional[str]) -> Optional[str]:
    """A Chromium to drive: ``--chromium``, else the system's, else playwright's own (None)."""
    if given:
        return given
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _wait_for_runs(base: str, deadline: float) -> None:
    while True:
        try:
            with urllib.request.urlopen(f"{base}/data/plugin/scalars/tags", timeout=5) as r:
                tags = json.load(r)
            if all(run in tags and "attention/entropy" in tags[run] for run in RUNS):
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"tensorboard at {base} did not serve both runs in time")
        time.sleep(1)


def _shoot(browser, url: str, path: str, action=None, settle_s: float = 4.0) -> None:
    context = browser.new_context(viewport=VIEWPORT)  # a fresh profile: TensorBoard's default settings
    page = context.new_page()
    page.goto(url)
    page.wait_for_load_state("networkidle")
    page.wait_for_timeout(settle_s * 1000)
    if action is not None:
        action(page)
        page.wait_for_timeout(settle_s * 1000)
    page.screenshot(path=path)
    context.close()
    print(f"wrote {os.path.relpath(path)}")


def _untick_outliers(page) -> None:
    page.get_by_text("Ignore outliers in chart scaling").first.click()


def _scroll_cards(page) -> None:
    # Time Series scrolls its card list, not the page
    page.evaluate("""() => {
        const all = [...document.querySelectorAll('*')].filter(e => e.scrollHeight > e.clientHeight + 50 &&
            getComputedStyle(e).overflowY.match(/auto|scroll/));
        all.sort((a, b) => b.clientHeight * b.clientWidth - a.clientHeight * a.clientWidth);
        if (all.length) all[0].scrollTop = 780;
    }""")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--logdir", help="a demo run (default: a fresh `probe demo` in a temporary directory)")
    parser.add_argument("--out", default=HERE, help="where the PNGs go (default docs/img)")
    parser.add_argument("--port", type=int, default=0, help="tensorboard's port (default: a free one)")
    parser.add_argument("--chromium", help="the Chromium executable (default: chromium on PATH, else playwright's)")
    args = parser.parse_args(argv)
    from playwright.sync_api import sync_playwright

    tmp = None
    logdir = args.logdir
    if logdir is None or not os.path.isdir(logdir) or not os.listdir(logdir):
        if logdir is None:
            tmp = tempfile.mkdtemp(prefix="probe-shots-")
            logdir = os.path.join(tmp, "demo")
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        subprocess.run([sys.executable, "-m", "probe", "demo", "--logdir", logdir], check=True, env=env)
    port = args.port or _free_port()
    base = f"http://localhost:{port}"
    tensorboard = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", logdir, "--host", "localhost", "--port", str(port),
         "--samples_per_plugin", "images=100"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_runs(base, time.monotonic() + 120)
        os.makedirs(args.out, exist_ok=True)
        out = lambda name: os.path.join(args.out, name)  # noqa: E731
        with sync_playwright() as p:
            exe = _chromium(args.chromium)
            browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"]) if exe else p.chromium.launch()
            _shoot(browser, f"{base}/#timeseries", out("time_series.png"))
            _shoot(browser, f"{base}/#timeseries", out("time_series_groups.png"), _scroll_cards)
            _shoot(browser, f"{base}/#timeseries", out("time_series_outliers.png"), _untick_outliers)
            _shoot(browser, f"{base}/#custom_scalars", out("custom_scalars.png"))
            _shoot(browser, f"{base}/#images", out("images.png"))
            _shoot(browser, f"{base}/#histograms", out("histograms.png"))
            _shoot(browser, f"{base}/#text", out("text.png"))
            browser.close()
    finally:
        tensorboard.terminate()
        tensorboard.wait(timeout=30)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
