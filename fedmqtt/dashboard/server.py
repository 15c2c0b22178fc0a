"""The dashboard's HTTP side (aiohttp) and its broker listener (the observer's MQTT session, subscribe only).

Routes are GET only: the page, its static files, `/api/state` (a JSON snapshot) and `/events` (server-sent
events: the same snapshot, pushed when it changes). SSE instead of MQTT-over-websockets because the page must
never hold broker credentials and Debian's Mosquitto 2.0.11 would not open a websockets listener here; one
HTTP response stream needs nothing from the broker and nothing in the browser but EventSource.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import threading
import time
from importlib import resources
from typing import Any

from aiohttp import web

from fedmqtt.dashboard.state import RunView
from fedmqtt.errors import FedMqttError

log = logging.getLogger("fedmqtt.dashboard")

# Everything the page loads comes from this server; no inline script or style, no frames, no forms.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
STATIC = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}
PUSH_EVERY_S = 0.5
HEARTBEAT_S = 15.0


def require_loopback(host: str) -> str:
    """The page has no login and no TLS yet: serving it beyond this machine would show the run to anyone."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise FedMqttError(f"refusing to serve the dashboard on {host!r}: it has no login or TLS, so it only listens "
                           "on loopback (127.0.0.1 or ::1). To watch from another machine, tunnel the port, e.g. "
                           "`ssh -L 8765:127.0.0.1:8765 <this host>`.")
    return host


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
            return {"runs": [r.snapshot(now=now) for r in self.runs], "note": self.note, "now": now}


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
                f"{prefix}/site/+/status"]

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
            note = "" if self.transport.connected else "broker connection lost: reconnecting (the page shows the last known state)"
            with self.board.lock:
                self.board.note = note
                if raw is not None:
                    self.view.on_message(raw.topic, raw.payload, now=time.time(), max_bytes=max_bytes)

    def close(self) -> None:
        self.stop.set()
        if self.transport is not None:
            self.transport.close()


@web.middleware
async def security_headers(request: web.Request, handler: Any) -> web.StreamResponse:
    if request.method not in ("GET", "HEAD"):
        raise web.HTTPMethodNotAllowed(request.method, ["GET"])
    response = await handler(request)
    response.headers["Content-Security-Policy"] = CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["Cache-Control"] = "no-store"
    return response


def make_app(board: Board) -> web.Application:
    app = web.Application(middlewares=[security_headers])
    files = resources.files("fedmqtt.dashboard") / "static"

    async def static(request: web.Request) -> web.Response:
        name = request.match_info.get("name", "index.html")
        if name not in STATIC:  # a fixed list: no path from the request ever reaches the file system
            raise web.HTTPNotFound()
        return web.Response(body=(files / name).read_bytes(), content_type=STATIC[name])

    async def state(request: web.Request) -> web.Response:
        return web.json_response(board.snapshot())

    async def events(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        sent, last_write = None, 0.0
        try:
            while True:
                version = board.version()
                if version != sent:
                    await response.write(f"data: {json.dumps(board.snapshot())}\n\n".encode())
                    sent, last_write = version, time.monotonic()
                elif time.monotonic() - last_write > HEARTBEAT_S:
                    await response.write(b": still here\n\n")  # keeps proxies and the browser from timing out
                    last_write = time.monotonic()
                await asyncio.sleep(PUSH_EVERY_S)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return response

    app.router.add_get("/", static)
    app.router.add_get("/static/{name}", static)
    app.router.add_get("/api/state", state)
    app.router.add_get("/events", events)
    return app


def serve(board: Board, *, host: str, port: int, on_ready: Any = None) -> None:
    require_loopback(host)

    async def main() -> None:
        runner = web.AppRunner(make_app(board), access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        if on_ready is not None:
            on_ready(f"http://{host}:{port}/" if ":" not in host else f"http://[{host}]:{port}/")
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
