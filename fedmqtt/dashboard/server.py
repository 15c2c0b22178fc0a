"""The dashboard's HTTP side (aiohttp) and its broker listener (the observer's MQTT session, subscribe only).

Routes are GET only: the page, its static files, `/api/state` (a JSON snapshot), `/events` (server-sent
events: the whole snapshot first, then only what changed: rounds changed and timeline events added since) and
`/runs/<n>/files/<name>` (a finished run's report, per-site CSV and models: a fixed list of names, rundir.py).

SSE instead of MQTT-over-websockets because the page must never hold broker credentials and Debian's Mosquitto
2.0.11 would not open a websockets listener here; one HTTP response stream needs nothing from the broker and
nothing in the browser but EventSource.

Every request is checked first for its Host (the dashboard's own names only: hosts.py), then for its method;
every response, the event stream and errors included, carries the security headers (`harden`). A login, when
on, is throttled before its password is hashed (throttle.py).
"""

from __future__ import annotations

import asyncio
import html
import json
import logging
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from aiohttp import hdrs, web

from fedmqtt.dashboard.hosts import AllowedHosts, allowed_hosts, host_of, is_loopback
from fedmqtt.dashboard.login import COOKIE, SESSION_S, Sessions
from fedmqtt.dashboard.rundir import CHUNK, DOWNLOADS, open_download
from fedmqtt.dashboard.state import Cursor, RunView
from fedmqtt.dashboard.throttle import LoginThrottle
from fedmqtt.errors import FedMqttError

log = logging.getLogger("fedmqtt.dashboard")

# Everything the page loads comes from this server; no inline script or style, no frames, no forms.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
LOGIN_CSP = CSP.replace("form-action 'none'", "form-action 'self'")  # the login form posts to this server only
HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",  # frame-ancestors 'none' for browsers that predate it
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",  # the run's state is never kept by a browser or a proxy; the static files are tiny
    "Cross-Origin-Resource-Policy": "same-origin",  # no other site may load /api/state as an image or script
    "Cross-Origin-Opener-Policy": "same-origin",
}
HSTS = "max-age=86400"
HASH_WORKERS = 2  # scrypt checks run at once (32 MiB each); the throttle bounds how many are queued
PUBLIC = ("/login", "/static/style.css", "/static/favicon.svg", "/favicon.ico")  # fetched before logging in
MAX_REQUEST_BYTES = 4096  # the only body ever accepted is the login form
STATIC = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css",
          "favicon.svg": "image/svg+xml"}
PUSH_EVERY_S = 0.5
HEARTBEAT_S = 15.0


def check_exposure(host: str, *, secure: bool) -> str:
    """Plain HTTP only on loopback: on a network address anyone who can reach the port would see the run."""
    if not secure and not is_loopback(host):
        raise FedMqttError(f"refusing to serve the dashboard on {host!r} over plain HTTP: a network address needs "
                           "TLS and a login (pass --federation DIR to have its CA issue a certificate, or --cert and "
                           "--key; a password is generated, or set with --password-file). Or stay on loopback and "
                           "tunnel the port, e.g. `ssh -L 8765:127.0.0.1:8765 <this host>`.")
    return host


@dataclass
class Access:
    """TLS and login; both or neither (a login over plain HTTP would send the password in clear)."""

    tls: ssl.SSLContext
    sessions: Sessions
    certificate: Path | None = None  # its names are among those the dashboard answers to


@dataclass(frozen=True)
class Sent:
    """What one event stream last sent of a run: its version and its cursor (rounds and events)."""

    version: int
    cursor: Cursor


class Board:
    """The runs shown, guarded by one lock (the MQTT thread writes, the HTTP loop reads)."""

    def __init__(self, runs: list[RunView]) -> None:
        self.runs = runs
        self.lock = threading.Lock()
        self.note = ""  # e.g. "broker unreachable, retrying"

    def version(self) -> tuple[int, ...]:
        with self.lock:
            return tuple(r.version for r in self.runs) + (hash(self.note),)

    def snapshot(self) -> dict[str, Any]:
        now = time.time()
        with self.lock:
            return {"runs": [r.snapshot(now=now) | {"key": i} for i, r in enumerate(self.runs)], "note": self.note,
                    "now": now, "delta": False}

    def delta(self, sent: list[Sent] | None) -> tuple[dict[str, Any], list[Sent]]:
        """What changed since an earlier call (None: everything), and what this call sent (one stream's
        bookkeeping). Runs whose version did not change are left out; the others come with only their new
        rounds and timeline events, the rest of their view whole."""
        now = time.time()
        with self.lock:
            if sent is None:
                runs = [r.snapshot(now=now) | {"key": i} for i, r in enumerate(self.runs)]
            else:
                runs = [r.snapshot(now=now, since=sent[i].cursor) | {"key": i} for i, r in enumerate(self.runs)
                        if r.version != sent[i].version]
            return ({"runs": runs, "note": self.note, "now": now, "delta": sent is not None},
                    [Sent(r.version, r.cursor()) for r in self.runs])

    def directory(self, key: int) -> Path | None:
        """The folder of finished run `key` (from the command line), None for a live run or no such run."""
        with self.lock:
            return self.runs[key].directory if 0 <= key < len(self.runs) else None


class BrokerListener(threading.Thread):
    """Subscribes as the observer to ps/status, ps/metrics and site/+/status of one run; never publishes."""

    def __init__(self, board: Board, view: RunView, settings: Any, *, seat: str | None) -> None:
        super().__init__(name="dashboard-mqtt", daemon=True)
        self.board, self.view, self.settings, self.seat = board, view, settings, seat
        self.stop = threading.Event()
        self.transport: Any = None

    def filters(self) -> list[str]:
        from fedmqtt.transport import topics

        prefix = topics.run_prefix(self.view.run_id)
        return [topics.ps_status_topic(self.view.run_id), topics.ps_metrics_topic(self.view.run_id),
                f"{prefix}/site/+/status", topics.federation_keys_topic(self.view.run_id)]

    def connect(self) -> None:
        from fedmqtt.transport.mqtt import MqttTransport

        self.transport = MqttTransport(self.settings, client_id=f"fedmqtt-dashboard-{int(time.time() * 1000) % 10**9}",
                                       seat=self.seat)
        self.transport.connect()
        self.transport.subscribe(self.filters())

    def run(self) -> None:
        try:
            self._listen()
        except Exception as exc:  # noqa: BLE001 - the page must say the feed stopped, not freeze silently
            log.exception("dashboard: broker listener stopped")
            with self.board.lock:
                self.board.note = f"broker listener stopped ({type(exc).__name__}: {exc}); restart the dashboard"
                self.view.version += 1

    def _listen(self) -> None:
        max_bytes = self.settings.max_payload_bytes
        while not self.stop.is_set():
            raw = self.transport.get(0.2)
            note = ("" if self.transport.connected
                    else "broker connection lost: reconnecting (the page shows the last known state)")
            with self.board.lock:
                if self.view.broker_connected != self.transport.connected:
                    self.view.broker_connected = self.transport.connected
                    self.view.version += 1
                self.board.note = note
                if raw is not None:
                    self.view.on_message(raw.topic, raw.payload, now=time.time(), max_bytes=max_bytes)

    def close(self) -> None:
        self.stop.set()
        if self.transport is not None:
            self.transport.close()


def host_guard(allowed: AllowedHosts) -> Any:
    """Refuse a request for any name but the dashboard's own (DNS rebinding; hosts.py), before anything else."""
    logged: set[str] = set()

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        given = request.headers.getall(hdrs.HOST, [])
        if len(given) == 1 and allowed.allows(given[0]):
            return await handler(request)
        if len(given) != 1 or host_of(given[0]) is None:
            raise web.HTTPBadRequest(text="one valid Host header is required\n")
        if len(logged) < 20 and given[0] not in logged:  # say it to the operator, without a line per request
            logged.add(given[0])
            log.warning("dashboard: refused a request for Host %r (not one of %s; --allow-host adds a name)",
                        given[0], allowed.describe())
        raise web.HTTPMisdirectedRequest(text="unknown Host: this dashboard answers to its own names only\n")

    return check


@web.middleware
async def read_only(request: web.Request, handler: Any) -> web.StreamResponse:
    if request.method not in ("GET", "HEAD") and not (request.method == "POST" and request.path == "/login"):
        raise web.HTTPMethodNotAllowed(request.method, ["GET"])
    return await handler(request)


async def harden(request: web.Request, response: web.StreamResponse) -> None:
    """The security headers, on every response: a signal run as any response is prepared, so the event
    stream (prepared by its handler, past any middleware) and errors (401, 404, 405, 421, 429) get them too."""
    response.headers.setdefault("Content-Security-Policy", CSP)
    response.headers.update(HEADERS)
    if request.secure:
        response.headers["Strict-Transport-Security"] = HSTS


def login_required(sessions: Sessions) -> Any:
    """Everything but the login page and its style sheet needs a valid session cookie."""

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path in PUBLIC or sessions.valid(request.cookies.get(COOKIE)):
            return await handler(request)
        if request.path == "/":
            raise web.HTTPSeeOther("/login")
        raise web.HTTPUnauthorized(text="log in at /login\n")

    return check


def login_page(message: str = "") -> str:
    note = f'<p class="warn">{html.escape(message)}</p>' if message else ""
    return ('<!doctype html><html lang="en"><head><meta charset="utf-8"><title>fedmqtt dashboard: log in</title>'
            '<link rel="stylesheet" href="/static/style.css"></head><body>'
            '<header><h1>fedmqtt dashboard</h1></header>'
            '<form class="login" method="post" action="/login">'
            '<label for="password">Dashboard password</label>'
            '<input id="password" name="password" type="password" autocomplete="current-password" required autofocus>'
            f'{note}<button type="submit">Log in</button></form></body></html>')


def same_origin_form(request: web.Request) -> bool:
    """Whether a login POST comes from this server's own form, not a form on another site.

    `Sec-Fetch-Site` is set by the browser and no page can forge it. `Referrer-Policy: no-referrer` makes a
    browser send `Origin: null` with the form, so `null` is taken only when `Sec-Fetch-Site` says same-origin.
    A request with neither header is not a browser's (a script has no session cookie to ride on).
    """
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None and site not in ("same-origin", "none"):
        return False
    origin = request.headers.get("Origin")
    if origin is None:
        return True
    if origin == "null":
        return site == "same-origin"
    return origin == f"{request.scheme}://{request.host}"


def _login_answer(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, text=login_page(message), content_type="text/html",
                        headers={"Content-Security-Policy": LOGIN_CSP, **(headers or {})})


def add_login_routes(app: web.Application, sessions: Sessions) -> None:
    throttle = LoginThrottle()
    hashing = ThreadPoolExecutor(max_workers=HASH_WORKERS, thread_name_prefix="dashboard-scrypt")

    async def stop_hashing(_app: web.Application) -> None:
        hashing.shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(stop_hashing)

    async def form(request: web.Request) -> web.Response:
        return _login_answer(200, "")

    async def submit(request: web.Request) -> web.Response:
        if not same_origin_form(request):
            raise web.HTTPForbidden(text="cross-site login refused\n")
        password = str((await request.post()).get("password", ""))
        client = request.remote or "?"
        # Admitted or refused before the hash, with no await in between: concurrent attempts see each other.
        verdict = throttle.admit(client)
        if not verdict.allowed:
            return _login_answer(429, f"Too many login attempts: try again in {verdict.retry_after_s} s.",
                                 {"Retry-After": str(verdict.retry_after_s)})
        # scrypt takes ~0.1 s of CPU: off the event loop, so the live page keeps streaming meanwhile.
        token = await asyncio.get_running_loop().run_in_executor(hashing, sessions.login, password)
        if token is None:
            log.warning("dashboard: failed login from %s (%d in a row)", client, throttle.failures(client))
            return _login_answer(401, "Wrong password.")
        throttle.succeeded(client)
        response = web.Response(status=303, headers={"Location": "/"})
        response.set_cookie(COOKIE, token, max_age=SESSION_S, path="/", secure=True, httponly=True, samesite="Strict")
        return response

    app.router.add_get("/login", form)
    app.router.add_post("/login", submit)


def make_app(board: Board, sessions: Sessions | None = None, *, hosts: AllowedHosts) -> web.Application:
    middlewares = [host_guard(hosts), read_only] + ([login_required(sessions)] if sessions is not None else [])
    app = web.Application(middlewares=middlewares, client_max_size=MAX_REQUEST_BYTES)
    app.on_response_prepare.append(harden)
    if sessions is not None:
        add_login_routes(app, sessions)
    files = resources.files("fedmqtt.dashboard") / "static"

    async def static(request: web.Request) -> web.Response:
        name = "favicon.svg" if request.path == "/favicon.ico" else request.match_info.get("name", "index.html")
        if name not in STATIC:  # a fixed list: no path from the request ever reaches the file system
            raise web.HTTPNotFound()
        return web.Response(body=(files / name).read_bytes(), content_type=STATIC[name])

    async def state(request: web.Request) -> web.Response:
        return web.json_response(board.snapshot())

    async def events(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        sent, last_write, cursors = None, 0.0, None
        try:
            while True:
                version = board.version()
                if version != sent:
                    # The first message is whole; later ones only what changed (the page merges them).
                    update, cursors = board.delta(cursors)
                    await response.write(f"data: {json.dumps(update)}\n\n".encode())
                    sent, last_write = version, time.monotonic()
                elif time.monotonic() - last_write > HEARTBEAT_S:
                    await response.write(b": still here\n\n")  # keeps proxies and the browser from timing out
                    last_write = time.monotonic()
                await asyncio.sleep(PUSH_EVERY_S)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return response

    async def download(request: web.Request) -> web.StreamResponse:
        """A file of a finished run's folder: only the names in DOWNLOADS, opened without following links."""
        key, name = request.match_info["key"], request.match_info["name"]
        directory = board.directory(int(key)) if key.isdigit() and len(key) < 6 else None
        opened = open_download(directory, name) if directory is not None else None
        if opened is None:
            raise web.HTTPNotFound(text="no such file: a finished run offers report.json, report.md, per_site.csv "
                                        "and its models\n")
        fh, size = opened
        response = web.StreamResponse(headers={
            "Content-Type": DOWNLOADS[name].content_type, "Content-Length": str(size),
            "Content-Disposition": f'attachment; filename="{name}"'})
        loop = asyncio.get_running_loop()
        with fh:
            await response.prepare(request)
            while request.method != "HEAD" and (block := await loop.run_in_executor(None, fh.read, CHUNK)):
                await response.write(block)  # a model may be large: read off the loop, a MiB at a time
        await response.write_eof()
        return response

    app.router.add_get("/", static)
    app.router.add_get("/favicon.ico", static)
    app.router.add_get("/static/{name}", static)
    app.router.add_get("/api/state", state)
    app.router.add_get("/events", events)
    app.router.add_get("/runs/{key}/files/{name}", download)
    return app


def serve(board: Board, *, host: str, port: int, access: Access | None = None, hosts: AllowedHosts | None = None,
          on_ready: Any = None) -> None:
    """Serve until interrupted; `hosts` defaults to the bind address's names and the certificate's."""
    check_exposure(host, secure=access is not None)
    if hosts is None:
        hosts = allowed_hosts(host, certificate=access.certificate if access is not None else None)

    async def main() -> None:
        app = make_app(board, access.sessions if access is not None else None, hosts=hosts)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, host, port, ssl_context=access.tls if access is not None else None)
        await site.start()
        if on_ready is not None:
            scheme = "https" if access is not None else "http"
            on_ready(f"{scheme}://{host}:{port}/" if ":" not in host else f"{scheme}://[{host}]:{port}/")
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
