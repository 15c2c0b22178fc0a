"""Run the checks in order; a check whose premise failed is skipped, saying which one it waits for."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from site_agent.preflight.clock import CLOCK, assess_clock
from site_agent.preflight.config_checks import CONFIG, CREDENTIALS, check_config, check_credentials
from site_agent.preflight.data_check import DATA, check_data
from site_agent.preflight.device_check import DEVICE, check_device
from site_agent.preflight.disk_check import STATE, check_state_dir, stored_model_bytes
from site_agent.preflight.findings import Finding, Report, skipped
from site_agent.preflight.network import BROKER, TLS, check_broker_address, check_tls
from site_agent.preflight.privacy_check import PRIVACY, check_privacy
from site_agent.preflight.session import LOGIN, RUN, check_run, visit

# Every check, in the order they run and print.
CHECKS = (CONFIG, CREDENTIALS, DATA, DEVICE, PRIVACY, BROKER, TLS, LOGIN, RUN, CLOCK, STATE)
DEFAULT_TIMEOUT_S = 5.0  # per network step: DNS and TCP, TLS handshake, CONNACK
DEFAULT_LIVE_WAIT_S = 2.0  # for a status sent now, when no current one is retained


def run_checks(config_path: Path, *, timeout_s: float = DEFAULT_TIMEOUT_S, live_wait_s: float = DEFAULT_LIVE_WAIT_S,
               on_finding: Callable[[Finding], None] | None = None) -> Report:
    """All checks for the site config at `config_path`; `on_finding` sees each finding as it is made."""
    report = Report(str(config_path))

    def add(finding: Finding) -> None:
        report.findings.append(finding)
        if on_finding is not None:
            on_finding(finding)

    def skip_rest(why: str) -> None:
        for name in CHECKS:
            if all(f.check != name for f in report.findings):
                add(skipped(name, why))

    config, finding = check_config(Path(config_path))
    add(finding)
    if config is None:
        skip_rest("needs a site config that loads")
        return report
    report.site_id, report.run_id = config.site_id, config.run_id
    settings, finding = check_credentials(config)
    add(finding)
    add(check_data(config.data))
    add(check_device(config))
    add(check_privacy(config))
    model_bytes = stored_model_bytes(config.state_dir)
    if settings is None:
        for name in (BROKER, TLS, LOGIN, RUN, CLOCK):
            add(skipped(name, "needs usable credentials"))
    else:
        address = check_broker_address(settings, timeout_s=timeout_s)
        add(address)
        tls = check_tls(settings, timeout_s=timeout_s) if address.status != "fail" else skipped(TLS, "needs the "
                                                                                                "broker reachable")
        add(tls)
        if tls.status == "fail" or tls.status == "skip":
            for name in (LOGIN, RUN, CLOCK):
                add(skipped(name, "needs a TLS handshake with the broker" if tls.status == "fail"
                            else "needs the broker reachable"))
        else:
            seen, finding = visit(settings, config.run_id, timeout_s=timeout_s, live_wait_s=live_wait_s)
            add(finding)
            if seen is None:
                add(skipped(RUN, "needs a login"))
                add(skipped(CLOCK, "needs a login"))
            else:
                add(check_run(seen, config.site_id, config.run_id, broker_run=tls.facts.get("run_id")))
                add(assess_clock(seen.samples()))
                model_bytes = seen.model_bytes or model_bytes
    add(check_state_dir(config.state_dir, model_bytes))
    return report
