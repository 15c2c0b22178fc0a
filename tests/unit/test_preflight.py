"""`fedmqtt site check` without a broker: the clock verdicts, the state directory, the data and device findings,
the credentials file's owner and contents, and how the checklist reads (tests/integration/test_site_check.py
runs it against a real federation)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from fedmqtt.config_io import dump_toml
from fedmqtt.data.heart_disease import bundled_path
from fedmqtt.data.spec import DataSpec
from site_agent.config import SiteConfig, load_site_config
from site_agent.data import load_site_data
from site_agent.preflight.clock import StatusSample, assess_clock
from site_agent.preflight.config_checks import check_credentials
from site_agent.preflight.data_check import check_data
from site_agent.preflight.device_check import check_device
from site_agent.preflight.disk_check import DEFAULT_FREE_BYTES, check_state_dir
from site_agent.preflight.findings import Finding, Report
from site_agent.preflight.render import Checklist
from site_agent.preflight.runner import CHECKS, run_checks

NOW = 1_800_000_000.0


@pytest.mark.parametrize(("samples", "status", "says"), [
    ([StatusSample(NOW - 0.4, NOW, live=True)], "pass", "+0.4 s, live ps/status"),
    ([StatusSample(NOW - 30, NOW, live=True), StatusSample(NOW - 31, NOW, live=True)], "warn", "30.0 s ahead of"),
    ([StatusSample(NOW + 900, NOW, live=True)], "fail", "15 min behind"),
    ([StatusSample(NOW + 900, NOW, live=False)], "fail", "at least 15 min behind"),
    ([StatusSample(NOW - 2, NOW, live=False)], "pass", "retained ps/status from just now"),
    ([StatusSample(NOW - 3600, NOW, live=False)], "warn", "no current reference"),
    ([], "warn", "no reference"),
])
def test_clock_verdicts(samples: list[StatusSample], status: str, says: str) -> None:
    """A live status measures the offset (the smallest delay wins); a retained one only bounds it."""
    # Execute
    finding = assess_clock(samples)

    # Assert
    assert (finding.status, says in finding.found) == (status, True), finding
    assert bool(finding.fix) == (status != "pass")


def test_state_dir_private_and_roomy_passes_open_warns_and_too_small_for_the_model_fails(tmp_path: Path) -> None:
    # Prepare
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    state.chmod(0o700)

    # Execute
    fine = check_state_dir(state, None)
    missing = check_state_dir(tmp_path / "not-yet" / "state", None)
    state.chmod(0o755)
    open_ = check_state_dir(state, None)
    huge = check_state_dir(state, 10**15)  # a petabyte model: no disk has 8 of those free

    # Assert
    assert fine.status == "pass" and "private (0700), writable" in fine.found
    assert fine.facts["needed_bytes"] == DEFAULT_FREE_BYTES and "default" in fine.found
    assert missing.status == "pass" and "the agent creates it" in missing.found
    assert not (tmp_path / "not-yet").exists()  # the check creates nothing
    assert open_.status == "warn" and f"chmod 700 {state}" in open_.fix
    assert huge.status == "fail" and "Free " in huge.fix and huge.facts["model_bytes"] == 10**15


def test_a_state_dir_that_is_a_file_fails(tmp_path: Path) -> None:
    # Prepare
    (tmp_path / "state").write_text("")

    # Execute
    finding = check_state_dir(tmp_path / "state", None)

    # Assert
    assert finding.status == "fail" and "is a file" in finding.found


def test_data_finding_agrees_with_the_agents_own_loading_and_counts_missing_values() -> None:
    # Prepare
    spec = DataSpec(format="heart_disease", path=bundled_path("hungary"))
    agent = load_site_data(spec)

    # Execute
    finding = check_data(spec)

    # Assert
    facts = finding.facts
    assert finding.status == "pass", finding
    assert facts["rows"] == {"train": agent.n_train, "val": agent.n_val, "test": agent.n_test}
    assert facts["label_histogram"] == agent.label_histogram()
    assert facts["missing_values"]["chol"] > 0  # Hungary's files code unmeasured cholesterol as 0
    assert re.search(r"\d+ missing values in \d+ features \(chol \d+", finding.found)


def test_data_finding_counts_values_outside_the_plausible_range(tmp_path: Path) -> None:
    # Prepare: pH 735 (a unit error) and a heart rate of 3000 among plausible rows
    csv = tmp_path / "export.csv"
    rows = [f"{7.3 + k / 100},{70 + k},{k % 2}" for k in range(12)] + ["735,80,1", "7.2,3000,0"]
    csv.write_text("ph,hr,outcome\n" + "\n".join(rows) + "\n")
    spec = DataSpec.model_validate({"format": "table", "path": str(csv), "options": {"spec": {
        "label": "outcome", "numeric": ["ph", "hr"], "ranges": {"ph": [6.5, 8.0], "hr": [0, 300]}}}})

    # Execute
    finding = check_data(spec)

    # Assert
    assert finding.facts["out_of_range"] == {"hr": 1, "ph": 1}
    assert "2 values outside the plausible range set to missing (hr 1, ph 1)" in finding.found
    assert any("outside the plausible range" in line for line in finding.details)


def test_a_table_without_a_spec_column_fails_naming_it(tmp_path: Path) -> None:
    # Prepare
    csv = tmp_path / "export.csv"
    csv.write_text("age,outcome\n61,1\n70,0\n")
    spec = DataSpec.model_validate({"format": "table", "path": str(csv), "options": {
        "spec": {"label": "outcome", "numeric": ["age", "bmi"]}}})

    # Execute
    finding = check_data(spec)

    # Assert
    assert finding.status == "fail" and "'bmi'" in finding.found and "[data] spec" in finding.fix


def test_cuda_asked_for_without_cuda_fails_with_the_fix(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    # Prepare
    config = _config(tmp_path, device="cuda")

    # Execute
    finding = check_device(config)

    # Assert
    assert finding.status == "fail" and 'device = "cuda"' in finding.found and 'device = "cpu"' in finding.fix


def test_credentials_owned_by_another_user_or_for_another_site_fail(tmp_path: Path) -> None:
    # Prepare
    config = _config(tmp_path)
    path = config.credentials
    path.write_text(dump_toml({"broker": {"username": "site-b", "password": "pw"}}))
    path.chmod(0o600)

    # Execute
    other_site = check_credentials(config)[1]
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)
        other_owner = check_credentials(config)[1]
        assert other_owner.status == "fail" and "sudo chown" in other_owner.fix

    # Assert
    assert other_site.status == "fail" and "logs in as 'site-b'" in other_site.found


def test_without_a_config_every_other_check_is_skipped_and_the_exit_code_is_1(tmp_path: Path) -> None:
    # Execute
    report = run_checks(tmp_path / "absent.toml")

    # Assert
    assert [f.check for f in report.findings] == list(CHECKS)
    assert [f.status for f in report.findings] == ["fail"] + ["skip"] * (len(CHECKS) - 1)
    assert report.exit_code == 1 and report.to_json()["counts"] == {"pass": 0, "warn": 0, "fail": 1, "skip": 10}


def test_checklist_columns_line_up_wrap_under_the_finding_and_colour_only_when_asked() -> None:
    # Prepare
    findings = [Finding("config", "pass", "site.toml: fine"),
                Finding("credentials", "fail", "open to other users " * 6, "Make it private: `chmod 600 x`.")]
    report = Report("site.toml", findings=findings)

    # Execute
    plain = Checklist(colour=False, width=80)
    coloured = Checklist(colour=True, width=None)
    text = "\n".join(plain.line(f) for f in findings)

    # Assert
    lines = text.splitlines()
    assert lines[0].index("site.toml") == lines[1].index("open") == 21
    assert all(len(line) <= 80 for line in lines)
    assert all(line.startswith(" " * 21) for line in lines[2:])
    assert any(line.startswith(" " * 21 + "fix: Make it private") for line in lines)
    assert "\033[" not in text + plain.summary(report, "site.toml")
    assert "\033[1;31mFAIL\033[0m" in coloured.line(findings[1])
    assert "1 passed, 0 warnings, 1 failed" in plain.summary(report, "site.toml")
    assert report.exit_code == 1


def _config(tmp_path: Path, **site: object):  # noqa: ANN202 - a SiteConfig
    path = tmp_path / "site.toml"
    path.write_text(dump_toml({"site_id": "site-a", "run_id": "run-1", "credentials": "site-a.toml",
                               "state_dir": "state", "data": {"format": "heart_disease",
                                                              "path": str(bundled_path("cleveland"))}, **site}))
    return load_site_config(path)


def test_privacy_check_reports_the_policy_and_the_ledger_and_fails_on_a_damaged_ledger(tmp_path: Path) -> None:
    """`site check`'s privacy line: the rules set, the DP-SGD steps and their epsilon; a damaged ledger fails with
    the fix (the agent would refuse every DP task until it is restored)."""
    pytest.importorskip("opacus")
    from fedmqtt.training.privacy import epsilon
    from site_agent.policy import PrivacyPolicy
    from site_agent.preflight.privacy_check import check_privacy
    from site_agent.privacy_ledger import PrivacyLedger

    config = _privacy_config(tmp_path, PrivacyPolicy())
    plain = check_privacy(config)
    assert plain.status == "pass" and "none (trains whatever the run asks)" in plain.found
    strict = _privacy_config(tmp_path, PrivacyPolicy(max_epsilon=8.0, require_record_dp=True, models=("mlp",)))
    PrivacyLedger(tmp_path / "state" / "privacy").save([(2.0, 1 / 6, 240)])
    finding = check_privacy(strict)
    assert finding.status == "pass"
    assert "max_epsilon 8, require_record_dp, models mlp" in finding.found and "240 DP-SGD steps" in finding.found
    assert finding.facts["epsilon"] == pytest.approx(epsilon([(2.0, 1 / 6, 240)], 1e-5))
    (tmp_path / "state" / "privacy" / "accountant.json").write_text("[]")
    damaged = check_privacy(strict)
    assert damaged.status == "fail" and "damaged" in damaged.found and "backup" in damaged.fix


def _privacy_config(tmp_path: Path, policy: object) -> SiteConfig:
    return SiteConfig.model_validate({"site_id": "a", "run_id": "r", "credentials": str(tmp_path / "c.toml"),
                                      "state_dir": str(tmp_path / "state"), "privacy": policy,
                                      "data": {"format": "heart_disease", "path": str(tmp_path / "x.data")}})
