"""The dashboard's HTTP defences against a real `fedmqtt dashboard` process (no mock, loopback only):
a Host allow-list (DNS rebinding), the security headers on every response (the event stream and errors too)
and a login throttle that counts before the password's hash is checked (per address and overall).

The certificate for the HTTPS cases comes from `openssl` itself, so these tests do not depend on how the
federation issues its own."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from fedmqtt.dashboard.throttle import FREE_FAILURES, GLOBAL_BURST, GLOBAL_PER_S, LOCK_CAP_S

PASSWORD = "correct horse battery staple"

EXPECTED = {"X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-store", "Cross-Origin-Resource-Policy": "same-origin",
            "Cross-Origin-Opener-Policy": "same-origin"}


def _report_dir(tmp: Path) -> Path:
    run = tmp / "run"
    run.mkdir()
    rounds = [{"round": r, "sites": ["a", "b"], "stragglers": [],
               "per_site": {"a": {"loss": 1 / r}, "b": {"loss": 2 / r}},
               "mean": {"loss": 1.5 / r}, "train_loss": None, "duration_s": 1.0} for r in (1, 2, 3)]
    report = {"run_id": "sec", "algorithm": "fedavg", "config": {"rounds": 3, "sites": ["a", "b"], "quorum": 1},
              "rounds": rounds, "final": {"per_site": {}, "mean": {}},
              "best_round": {"round": 3, "score": 0.5, "metric": "val loss"}, "recruitment": None}
    (run / "report.json").write_text(json.dumps(report))
    return run


def _openssl_certificate(tmp: Path) -> tuple[Path, Path]:
    """A self-signed server certificate for 127.0.0.1 and dash.test, made by the openssl command."""
    cert, key = tmp / "dash.crt", tmp / "dash.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=dash.test",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:dash.test"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


@dataclass
class Served:
    url: str
    cert: Path | None  # the server's certificate, trusted by the test's client (HTTPS only)

    @property
    def port(self) -> int:
        return int(urllib.parse.urlsplit(self.url).port or 0)

    def connection(self, source: str | None = None) -> http.client.HTTPConnection:
        address = (source, 0) if source else None
        if self.cert is None:
            return http.client.HTTPConnection("127.0.0.1", self.port, timeout=20, source_address=address)
        context = ssl.create_default_context(cafile=str(self.cert))
        return http.client.HTTPSConnection("127.0.0.1", self.port, timeout=20, context=context,
                                           source_address=address)

    def request(self, path: str, *, method: str = "GET", host: str | None = None, body: str | None = None,
                headers: dict[str, str] | None = None, source: str | None = None) -> tuple[int, dict[str, str], bytes]:
        """One request; for /events only the status and headers (the stream itself never ends)."""
        conn = self.connection(source)
        sent = dict(headers or {})
        if host is not None:
            sent["Host"] = host  # http.client then sends this one instead of its own
        if body is not None:
            sent["Content-Type"] = "application/x-www-form-urlencoded"
        try:
            conn.request(method, path, body=body, headers=sent)
            response = conn.getresponse()
            got = {k: v for k, v in response.getheaders()}
            data = b"" if path == "/events" and response.status == 200 else response.read()
            return response.status, got, data
        finally:
            conn.close()


@pytest.fixture
def plain(dashboard, tmp_path: Path) -> Callable[..., Served]:
    def start(*extra: str) -> Served:
        return Served(dashboard("--run", str(_report_dir(tmp_path)), *extra), None)

    return start


@pytest.fixture
def https(dashboard, tmp_path: Path) -> Callable[..., Served]:
    """A `--tls` dashboard with a login, its certificate from openssl and the password from a file."""

    def start(*extra: str) -> Served:
        cert, key = _openssl_certificate(tmp_path)
        secret = tmp_path / "password"
        secret.write_text(PASSWORD + "\n")
        url = dashboard("--run", str(_report_dir(tmp_path)), "--tls", "--cert", str(cert), "--key", str(key),
                        "--password-file", str(secret), *extra)
        return Served(url, cert)

    return start


def _form(password: str) -> str:
    return urllib.parse.urlencode({"password": password})


# -- 1. Host allow-list (DNS rebinding) -----------------------------------------------------------------------
ROUTES = ("/", "/static/app.js", "/static/style.css", "/api/state", "/events", "/no-such-page")


def test_a_foreign_host_header_is_refused_on_every_route(plain) -> None:
    served = plain("--allow-host", "dash.internal")
    port = served.port
    for path in ROUTES:
        # A page on evil.example whose name now resolves to 127.0.0.1 (DNS rebinding) sends its own name.
        for foreign in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}", f"[::2]:{port}"):
            status, headers, body = served.request(path, host=foreign)
            assert status == 421, (path, foreign, status, body[:200])
            assert b"Host" in body and len(body) < 200 and "runs" not in body.decode()
            assert headers.get("X-Content-Type-Options") == "nosniff"  # errors carry the headers too
        for own in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "LOCALHOST", f"dash.internal:{port}"):
            status, _headers, _body = served.request(path, host=own)
            assert status == (404 if path == "/no-such-page" else 200), (path, own, status)
    for malformed in ("", "a b", "evil.example:80:80", "::1"):
        status, _headers, _body = served.request("/api/state", host=malformed)
        assert status in (400, 421), (malformed, status)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:  # no Host header at all
        raw.sendall(b"GET /api/state HTTP/1.1\r\nConnection: close\r\n\r\n")
        assert raw.recv(64).split()[1] in (b"400", b"421")


def test_over_https_the_certificates_names_are_the_allowed_hosts(https) -> None:
    served = https()
    port = served.port
    assert served.request("/login", host=f"dash.test:{port}")[0] == 200  # a SAN of the certificate
    assert served.request("/login", host=f"127.0.0.1:{port}")[0] == 200
    for path, method, body in (("/login", "GET", None), ("/login", "POST", _form(PASSWORD)),
                               ("/api/state", "GET", None), ("/static/style.css", "GET", None)):
        status, _headers, _body = served.request(path, method=method, host=f"rebound.example:{port}", body=body)
        assert status == 421, (path, method, status)


# -- 2. Security headers on every response ---------------------------------------------------------------------
def _assert_hardened(headers: dict[str, str], what: str, *, tls: bool) -> None:
    for name, value in EXPECTED.items():
        assert headers.get(name) == value, (what, name, headers.get(name))
    csp = headers.get("Content-Security-Policy", "")
    for directive in ("default-src 'none'", "script-src 'self'", "style-src 'self'", "frame-ancestors 'none'",
                      "base-uri 'none'"):
        assert directive in csp, (what, directive, csp)
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp and "*" not in csp
    hsts = headers.get("Strict-Transport-Security", "")
    assert ("max-age=" in hsts) == tls, (what, hsts)


def test_every_plain_response_carries_the_security_headers(plain) -> None:
    served = plain()
    port = served.port
    cases = [("/", "GET", None, 200), ("/static/app.js", "GET", None, 200), ("/static/style.css", "GET", None, 200),
             ("/api/state", "GET", None, 200), ("/events", "GET", None, 200), ("/static/nope.js", "GET", None, 404),
             ("/api/state", "POST", "x", 405), ("/", "PUT", "x", 405)]
    for path, method, body, code in cases:
        status, headers, _ = served.request(path, method=method, body=body)
        assert status == code, (path, method, status)
        _assert_hardened(headers, f"{method} {path}", tls=False)
    status, headers, _ = served.request("/api/state", host=f"evil.example:{port}")
    assert status == 421
    _assert_hardened(headers, "421", tls=False)
    status, headers, _ = served.request("/events")
    assert headers["Content-Type"].startswith("text/event-stream")


def test_every_https_response_carries_the_security_headers_and_hsts(https) -> None:
    served = https()
    ok = served.request("/login", method="POST", body=_form(PASSWORD))
    assert ok[0] == 303
    token = ok[1]["Set-Cookie"].split(";")[0]
    cases = [("/login", "GET", None, {}, 200), ("/", "GET", None, {}, 303), ("/api/state", "GET", None, {}, 401),
             ("/events", "GET", None, {}, 401), ("/login", "POST", _form("wrong password!!"), {}, 401),
             ("/", "GET", None, {"Cookie": token}, 200), ("/api/state", "GET", None, {"Cookie": token}, 200),
             ("/events", "GET", None, {"Cookie": token}, 200), ("/static/app.js", "GET", None, {"Cookie": token}, 200),
             ("/api/state", "DELETE", None, {"Cookie": token}, 405)]
    for path, method, body, headers, code in cases:
        status, got, _ = served.request(path, method=method, body=body, headers=headers)
        assert status == code, (method, path, status)
        _assert_hardened(got, f"{method} {path} {code}", tls=True)
    assert "form-action 'self'" in served.request("/login")[1]["Content-Security-Policy"]
    assert "form-action 'none'" in served.request("/", headers={"Cookie": token})[1]["Content-Security-Policy"]
    for _ in range(FREE_FAILURES):  # then a 429 carries them too
        served.request("/login", method="POST", body=_form("wrong password!!"))
    status, got, _ = served.request("/login", method="POST", body=_form("wrong password!!"))
    assert status == 429
    _assert_hardened(got, "429", tls=True)


def test_a_cross_site_login_form_is_refused(https) -> None:
    served = https()
    for headers in ({"Origin": "https://elsewhere.example"}, {"Origin": "null"},
                    {"Origin": "null", "Sec-Fetch-Site": "cross-site"},
                    {"Sec-Fetch-Site": "same-site"}):
        assert served.request("/login", method="POST", body=_form(PASSWORD), headers=headers)[0] == 403, headers
    # With `Referrer-Policy: no-referrer` a browser posts the login form with `Origin: null`; its
    # `Sec-Fetch-Site` (a header no page can set) tells that the form was this server's own.
    ok = served.request("/login", method="POST", body=_form(PASSWORD),
                        headers={"Origin": "null", "Sec-Fetch-Site": "same-origin"})
    assert ok[0] == 303


# -- 3. Login throttle, counted before the hash check ---------------------------------------------------------
Answer = tuple[int, dict[str, str], float]  # status, headers, seconds from sending to the answer


def _concurrently(served: Served, passwords: list[str], sources: list[str | None]) -> list[Answer]:
    """Each password on its own connection (one per source address), all sent at once after the handshakes."""
    results: list[Answer | None] = [None] * len(passwords)
    barrier = threading.Barrier(len(passwords))

    def one(i: int) -> None:
        conn = served.connection(sources[i])
        try:
            conn.connect()
            barrier.wait(30)
            start = time.monotonic()
            conn.request("POST", "/login", body=_form(passwords[i]),
                         headers={"Content-Type": "application/x-www-form-urlencoded"})
            response = conn.getresponse()
            response.read()
            results[i] = (response.status, dict(response.getheaders()), time.monotonic() - start)
        finally:
            conn.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(passwords))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(r is not None for r in results), results
    return [r for r in results if r is not None]


def _retry_after(headers: dict[str, str]) -> int:
    value = int(headers["Retry-After"])
    assert 1 <= value <= LOCK_CAP_S, value
    return value


def test_concurrent_wrong_passwords_from_one_address_are_not_all_hash_checked(https) -> None:
    served = https()
    results = _concurrently(served, ["wrong password!!"] * 30, [None] * 30)
    checked = [r for r in results if r[0] == 401]  # a 401 is a hash check that failed
    refused = [r for r in results if r[0] == 429]
    assert len(checked) == FREE_FAILURES and len(refused) == 30 - FREE_FAILURES, sorted(r[0] for r in results)
    for _status, headers, _elapsed in refused:
        _retry_after(headers)
    # Refused before any hash: the refusals do not wait for the checks (each ~0.1 s of scrypt, two at a time).
    assert max(r[2] for r in refused) < max(r[2] for r in checked), (results,)


def test_the_right_password_works_again_after_a_short_lockout(https) -> None:
    served = https()
    for _ in range(FREE_FAILURES):
        assert served.request("/login", method="POST", body=_form("wrong password!!"))[0] == 401
    status, headers, body = served.request("/login", method="POST", body=_form(PASSWORD))
    assert status == 429 and b"Too many" in body  # locked: not even the right password is checked
    wait_s = _retry_after(headers)
    assert wait_s <= 2  # the first lockout is short
    time.sleep(wait_s + 0.2)
    status, headers, _ = served.request("/login", method="POST", body=_form(PASSWORD))
    assert status == 303 and "Set-Cookie" in headers
    # A success forgets the failures: the next wrong password is checked, not refused.
    assert served.request("/login", method="POST", body=_form("wrong password!!"))[0] == 401


def test_a_spray_from_many_addresses_hits_the_global_limit(https) -> None:
    served = https()
    sources = [f"127.0.0.{10 + i}" for i in range(30)]  # the whole 127/8 is this machine's loopback
    start = time.monotonic()
    results = _concurrently(served, ["wrong password!!"] * 30, list(sources))
    elapsed = time.monotonic() - start
    checked = sum(r[0] == 401 for r in results)
    refused = [r for r in results if r[0] == 429]
    assert checked + len(refused) == 30, sorted(r[0] for r in results)
    assert GLOBAL_BURST <= checked <= GLOBAL_BURST + int(GLOBAL_PER_S * elapsed) + 1, (checked, elapsed)
    for _status, headers, _elapsed in refused:
        _retry_after(headers)


# -- the page under its CSP, in Chromium ------------------------------------------------------------------------
def _csp_violations(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if "Content Security Policy" in e["message"]]


def _wait_rendered(driver) -> dict:
    end, page = time.monotonic() + 30, None
    while time.monotonic() < end:
        page = driver.execute_script("""
            const h = document.querySelector('section.run h2');
            if (!h) return null;
            const legend = [...document.querySelectorAll('.legend .swatch')].map(
                s => getComputedStyle(s).backgroundColor);
            return {heading: h.textContent, rows: document.querySelectorAll('table.sites tr[data-site]').length,
                    lines: document.querySelectorAll('figure.plot svg polyline').length, legend,
                    header: getComputedStyle(document.querySelector('header')).backgroundColor,
                    status: document.getElementById('status').textContent};""")
        if page and page["lines"]:
            return page
        time.sleep(0.2)
    raise AssertionError(f"the page never rendered: {page}\n{driver.page_source[:2000]}")


def _assert_renders_as_before(page: dict) -> None:
    assert page["heading"].startswith("run sec") and page["status"] == "finished" and page["rows"] == 2
    assert page["lines"] == 3  # the mean and one line per site
    assert page["header"] == "rgb(29, 43, 69)"  # style.css applied
    # Colours set by app.js through the DOM (not inline markup): allowed by the policy.
    assert page["legend"] == ["rgb(17, 17, 17)", "rgb(31, 119, 180)", "rgb(255, 127, 14)"]  # mean, a, b


@pytest.mark.e2e
def test_the_page_renders_under_its_csp_without_a_violation(plain, chrome) -> None:
    served = plain()
    chrome.get(served.url)
    _assert_renders_as_before(_wait_rendered(chrome))
    time.sleep(1)  # the event stream has delivered at least once more
    assert _csp_violations(chrome) == []
    # The console does report a violation when there is one: an inline script is refused and named.
    chrome.execute_script("const s = document.createElement('script'); s.textContent = 'document.title = \"inline\"';"
                          "document.head.append(s);")
    end = time.monotonic() + 10
    violations: list[str] = []
    while not violations and time.monotonic() < end:
        violations = _csp_violations(chrome)
        time.sleep(0.2)
    assert violations and "inline script" in violations[0] and chrome.title != "inline"


@pytest.mark.e2e
def test_the_login_and_the_page_work_under_the_csp_over_https(https, chrome_tls) -> None:
    served = https()
    chrome_tls.get(served.url)
    assert chrome_tls.current_url.endswith("/login")
    field = chrome_tls.find_element("css selector", "form.login input[name=password]")
    field.send_keys(PASSWORD)
    field.submit()  # posted with Origin: null (no-referrer) and Sec-Fetch-Site: same-origin
    _assert_renders_as_before(_wait_rendered(chrome_tls))
    assert chrome_tls.current_url == served.url
    assert _csp_violations(chrome_tls) == []
