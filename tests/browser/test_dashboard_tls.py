"""The dashboard over HTTPS with a login: the certificate from the federation's CA, the scrypt-hashed password,
session cookies, and a real `fedmqtt dashboard --tls` process next to a real TLS broker (HTTP and Chromium)."""

from __future__ import annotations

import http.client
import json
import re
import ssl
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509

from broker.config import free_port
from broker.federation import FederationLayout, init_federation
from broker.process import BrokerProcess
from fedmqtt.dashboard import login, tls
from fedmqtt.errors import ConfigError

PASSWORD = "correct horse battery staple"


# -- certificate ---------------------------------------------------------------------------------------------
def test_the_dashboards_own_ca_issues_its_certificate_once_per_name_set(tmp_path: Path) -> None:
    """Not the federation's CA, which the parties trust: a dashboard certificate for the broker's name from it
    could stand in for the broker (tests/integration/test_tls.py)."""
    layout = init_federation(tmp_path / "fed", run_id="tlsdash", site_ids=["a"], tls=True, port=free_port())
    cert_path, key_path, ca_path = tls.federation_certificate(layout.fed_dir, ["127.0.0.1", "dash.example"])
    assert ca_path == layout.fed_dir / "dashboard" / "ca.crt" and cert_path.parent == layout.fed_dir / "dashboard"
    assert ca_path.read_bytes() != layout.ca_path.read_bytes()
    assert key_path.stat().st_mode & 0o077 == 0  # the key is readable by its owner only
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca_path.read_bytes()))
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["dash.example"]
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    first = cert_path.read_bytes()
    tls.federation_certificate(layout.fed_dir, ["dash.example"])  # covered already: kept
    assert cert_path.read_bytes() == first
    tls.federation_certificate(layout.fed_dir, ["other.example"])  # not covered: issued again
    assert cert_path.read_bytes() != first
    tls.server_context(cert_path, key_path)  # the pair loads


def test_a_federation_without_a_ca_gets_a_dashboard_ca(tmp_path: Path) -> None:
    layout = init_federation(tmp_path / "fed", run_id="plaindash", site_ids=["a"], port=free_port())
    assert not layout.tls
    cert_path, _key, ca_path = tls.federation_certificate(layout.fed_dir, ["127.0.0.1"])
    assert ca_path == layout.fed_dir / "dashboard" / "ca.crt"
    x509.load_pem_x509_certificate(cert_path.read_bytes()).verify_directly_issued_by(
        x509.load_pem_x509_certificate(ca_path.read_bytes()))


# -- password and sessions -----------------------------------------------------------------------------------
def test_the_password_is_kept_only_as_a_scrypt_hash(tmp_path: Path) -> None:
    hashed, shown = login.stored_password(tmp_path / "d")
    stored = (tmp_path / "d" / login.HASH_FILE).read_text()
    assert shown and shown not in stored and stored.startswith("scrypt$")
    assert login.PasswordHash.loads(stored).matches(shown) and not hashed.matches(shown + "x")
    again, none = login.stored_password(tmp_path / "d")  # shown once: the next start only has the hash
    assert none is None and again.matches(shown)
    renewed, other = login.stored_password(tmp_path / "d", renew=True)
    assert other and other != shown and not renewed.matches(shown)
    with pytest.raises(ConfigError, match="at least"):
        login.PasswordHash.of("short")


def test_sessions_expire() -> None:
    sessions = login.Sessions(login.PasswordHash.of(PASSWORD))
    token = sessions.login(PASSWORD, now=0.0)
    assert token and sessions.valid(token, now=10.0) and not sessions.valid(token, now=login.SESSION_S + 1)
    assert not sessions.valid("forged", now=10.0) and not sessions.valid(None)
    assert sessions.login("wrong password!", now=1.0) is None
    assert sessions.valid(token, now=10.0)  # a failed login ends no session
    # Failed logins are throttled before this check, per address and overall: tests/unit/test_dashboard_throttle.py


# -- a real dashboard process over HTTPS ---------------------------------------------------------------------
@pytest.fixture
def tls_federation(mosquitto_bin: str, tmp_path: Path) -> Iterator[FederationLayout]:
    """A TLS federation (its own CA) and its broker; no PS: the page shows the run waiting."""
    layout = init_federation(tmp_path / "fed", run_id="dash-tls", site_ids=["a", "b"], tls=True, port=free_port())
    broker = BrokerProcess.start(layout.conf_path, port=layout.port)
    try:
        yield layout
    finally:
        broker.stop()


def _request(url: str, path: str, *, ca: Path, method: str = "GET", body: dict | None = None,
             cookie: str | None = None, origin: str | None = None) -> http.client.HTTPResponse:
    """One HTTPS request that checks the certificate against `ca` and the host name, following no redirect."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPSConnection(parts.hostname, parts.port, timeout=10,
                                       context=ssl.create_default_context(cafile=str(ca)))
    headers = {"Cookie": f"{login.COOKIE}={cookie}"} if cookie else {}
    if origin:
        headers["Origin"] = origin
    data = None
    if body is not None:
        data = urllib.parse.urlencode(body).encode()
        headers["Content-Type"] = "application/x-www-form-urlencoded"
    conn.request(method, path, body=data, headers=headers)
    response = conn.getresponse()
    response.read_body = response.read()  # type: ignore[attr-defined]
    conn.close()
    return response


def test_https_needs_the_password_and_then_serves_the_run(tls_federation: FederationLayout, dashboard,
                                                          tmp_path: Path) -> None:
    layout = tls_federation
    url = dashboard("--federation", str(layout.fed_dir), "--tls")
    ca = tls.dashboard_dir(layout.fed_dir) / "ca.crt"  # browsers trust the dashboard's own CA
    log = (tmp_path / f"dashboard-{urllib.parse.urlsplit(url).port}.log").read_text()
    password = re.search(r"dashboard password \(shown only now; .*\): (\S+)", log).group(1)  # type: ignore[union-attr]
    assert password not in (layout.fed_dir / "dashboard" / login.HASH_FILE).read_text()

    # Without a session: the page redirects to the login, the data and the script are refused.
    assert _request(url, "/", ca=ca).getheader("Location") == "/login"
    for path in ("/api/state", "/events", "/static/app.js"):
        assert _request(url, path, ca=ca).status == 401, path
    assert _request(url, "/api/state", ca=ca, cookie="forged-token").status == 401
    assert _request(url, "/login", ca=ca).status == 200

    # A wrong password is refused; the right one gets a Secure, HttpOnly, SameSite=Strict session cookie.
    assert _request(url, "/login", ca=ca, method="POST", body={"password": "not the password"}).status == 401
    assert _request(url, "/login", ca=ca, method="POST", body={"password": password},
                    origin="https://elsewhere.example").status == 403  # a form posted from another site
    ok = _request(url, "/login", ca=ca, method="POST", body={"password": password})
    assert ok.status == 303 and ok.getheader("Location") == "/"
    cookie = ok.getheader("Set-Cookie")
    for attribute in ("Secure", "HttpOnly", "SameSite=Strict"):
        assert attribute in cookie, cookie
    token = cookie.split(";")[0].split("=", 1)[1]
    state = _request(url, "/api/state", ca=ca, cookie=token)
    assert state.status == 200 and "max-age" in state.getheader("Strict-Transport-Security")
    text = state.read_body.decode()  # type: ignore[attr-defined]
    run = json.loads(text)["runs"][0]
    assert run["run_id"] == "dash-tls" and run["status"] in ("waiting", "live")
    assert layout.settings("observer").password not in text and password not in text

    # Plain HTTP is not served on the HTTPS port.
    plain = http.client.HTTPConnection("127.0.0.1", urllib.parse.urlsplit(url).port, timeout=5)
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        plain.request("GET", "/api/state")
        plain.getresponse()


def test_a_network_address_is_refused_without_tls_material(tmp_path: Path) -> None:
    """Plain HTTP never leaves loopback; HTTPS needs a certificate and a login to start at all."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "report.json").write_text(json.dumps({"run_id": "r", "rounds": []}))
    cases = [((), "needs a certificate"),  # a network host means HTTPS; --run alone has neither cert nor login
             (("--cert", str(tmp_path / "c.pem")), "--cert and --key go together")]
    for extra, why in cases:
        done = subprocess.run([sys.executable, "-m", "fedmqtt", "dashboard", "--run", str(run), "--host", "192.0.2.1",
                               *extra], capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and why in done.stdout + done.stderr, (extra, done.stdout, done.stderr)


def _wait(predicate, driver, what: str, timeout_s: float = 20) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"the browser never showed {what}: {driver.current_url}\n{driver.page_source[:3000]}")


@pytest.mark.e2e
def test_a_browser_logs_in_over_https(tls_federation: FederationLayout, dashboard, chrome_tls,
                                      tmp_path: Path, screenshots: Path) -> None:
    layout = tls_federation
    secret = tmp_path / "dashboard-password"
    secret.write_text(PASSWORD + "\n")
    url = dashboard("--federation", str(layout.fed_dir), "--tls", "--password-file", str(secret))
    chrome_tls.get(url)
    assert chrome_tls.current_url.endswith("/login")
    chrome_tls.save_screenshot(str(screenshots / "tls-01-login.png"))
    form = chrome_tls.find_element("css selector", "form.login input[name=password]")
    form.send_keys("a wrong password")
    form.submit()
    _wait(lambda: "Wrong password" in chrome_tls.page_source, chrome_tls, "the wrong password refused")
    form = chrome_tls.find_element("css selector", "form.login input[name=password]")
    form.send_keys(PASSWORD)
    form.submit()
    end = time.monotonic() + 20
    heading = ""
    while time.monotonic() < end and "dash-tls" not in heading:
        heading = chrome_tls.execute_script("const h = document.querySelector('section.run h2'); "
                                            "return h ? h.textContent : '';")
        time.sleep(0.2)
    assert "dash-tls" in heading and chrome_tls.current_url == url
    assert chrome_tls.execute_script("return document.cookie") == ""  # HttpOnly: the page's script cannot read it
    chrome_tls.save_screenshot(str(screenshots / "tls-02-after-login.png"))
