"""Fixtures for the browser tests: headless Chromium (Debian's chromium + chromium-driver) driven by selenium
(the `dashboard` process fixture is in tests/conftest.py). They skip locally when Chromium is missing and fail
under CI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMEDRIVER = "/usr/bin/chromedriver"


@pytest.fixture
def chrome() -> Iterator[object]:
    """A headless Chromium driven by selenium through the system chromedriver."""
    yield from _chrome(accept_insecure_certs=False)


@pytest.fixture
def chrome_tls() -> Iterator[object]:
    """The same, accepting the test federation's certificate (its CA is not in the browser's trust store)."""
    yield from _chrome(accept_insecure_certs=True)


def _chrome(*, accept_insecure_certs: bool) -> Iterator[object]:
    missing = [CHROMEDRIVER] if not os.path.exists(CHROMEDRIVER) else []
    missing += [] if shutil.which("chromium") else ["chromium"]
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing.append("selenium (pip)")
    if missing:
        why = (f"browser tests need {', '.join(missing)} (scripts/test.sh installs chromium and chromium-driver "
               "with apt-get; selenium is in the dev extra)")
        if os.environ.get("CI"):
            pytest.fail(f"{why}; CI must run the browser tests")
        pytest.skip(why)
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    options.accept_insecure_certs = accept_insecure_certs
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console, for CSP violations
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


# Two real finished runs of the bundled heart-disease sites (`fedmqtt simulate`: the PS's own code writes
# report.json, report.md, per_site.csv, the models and the audit log), different enough to compare.
# With these settings the best round by val AUROC (the selection metric) is neither the last round nor the one
# with the lowest val loss, which is what a page picking by loss would have marked.
FINISHED_RUNS = {"fedavg": ("-a", "fedavg", "--lr", "0.01", "--epochs", "5"),
                 "fedadam": ("-a", "fedadam", "-H", "eta_g=0.01", "--lr", "0.01", "--epochs", "5")}


@pytest.fixture(scope="session")
def finished_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An output folder holding two finished runs, `fedavg/` and `fedadam/` (8 rounds each)."""
    out = tmp_path_factory.mktemp("runs")
    for name, args in FINISHED_RUNS.items():
        done = subprocess.run([sys.executable, "-m", "fedmqtt", "simulate", "--rounds", "8", "--seed", "1",
                               "--out", str(out / name), "--no-progress", *args],
                              capture_output=True, timeout=600, check=False)
        assert done.returncode == 0, done.stdout.decode(errors="replace")[-3000:]
    return out


@pytest.fixture
def screenshots(tmp_path: Path) -> Path:
    """Where screenshots go: $FEDMQTT_SCREENSHOTS if set (CI artifacts), else the test's tmp dir."""
    out = Path(os.environ.get("FEDMQTT_SCREENSHOTS") or tmp_path / "screenshots")
    out.mkdir(parents=True, exist_ok=True)
    return out
