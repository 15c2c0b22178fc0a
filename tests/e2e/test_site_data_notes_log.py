"""A site agent says in its own log, once at start and at INFO, what preparing its data did to it: per column the
values outside a plausible range that became missing, columns set to 0... (the notes `fedmqtt site check` shows),
so a hospital's IT can read them where they read everything else the site does."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from harness import wait_until

from fedmqtt.config_io import dump_toml, read_toml

pytestmark = pytest.mark.e2e
SITES = ("cleveland", "switzerland")
SPEC = {"label": "los", "task": "regression", "numeric": ["ph", "hr"],
        "ranges": {"ph": [6.5, 8.0], "hr": [0, 300]}}


def _table(path: Path) -> Path:
    """40 plausible rows and three unit errors: pH 735 (twice) and a heart rate of -5."""
    rows = ["ph,hr,los"] + [f"{7.3 + k / 400},{60 + k},{k % 9 + 1}" for k in range(40)]
    rows += ["735,80,3", "7.2,-5,2", "735,90,4"]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_a_site_logs_its_data_preparation_notes_once_at_start(cli_federation, tmp_path) -> None:
    # Prepare: cleveland reads a table with unit errors; switzerland its bundled file (cholesterol all missing)
    fed = cli_federation("notes", run_id="e2e-notes", rounds=1, sites=SITES)
    table = _table(tmp_path / "icu.csv")
    spec = tmp_path / "icu_spec.json"
    spec.write_text(json.dumps(SPEC))
    config = read_toml(fed.site_configs["cleveland"])
    config["data"] = {"format": "table", "path": str(table), "options": {"spec": str(spec)}}
    fed.site_configs["cleveland"].write_text(dump_toml(config))
    fed.start_broker()
    # Execute: the sites start and wait for a PS that never comes
    for site in SITES:
        fed.start_site(site)
    for site in SITES:
        def online(site: str = site) -> bool:
            fed.check_alive()
            return f"site {site} online" in fed.tail(site, 400)

        wait_until(online, 120, f"{site} online")
    # Assert: each note once, at INFO, in the site's own log
    cleveland = fed.tail("cleveland", 400)
    removed = re.findall(r" INFO +fedmqtt\.site: site cleveland data preparation: site file (\S+): 3 value\(s\) "
                         r"outside the plausible range set to missing: hr 1, ph 2$", cleveland, flags=re.M)
    assert removed == [str(table)], cleveland
    switzerland = fed.tail("switzerland", 400)
    zeroed = re.findall(r" INFO +fedmqtt\.site: site switzerland data preparation: .*constant or missing in train, "
                        r"set to 0: chol$", switzerland, flags=re.M)
    assert len(zeroed) == 1, switzerland
