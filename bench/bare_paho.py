"""The floor for one round's communication: the same bytes through a broker with the same limits, bare paho clients.

One "server" client publishes `model_bytes` as QoS-2 retained messages of `chunk_bytes` to N "site" clients
(fan-out), then every site publishes as many bytes back (fan-in). No schemas, hashing, validation, disk or
training: only MQTT. Run it as a separate process against a running broker:

    python bench/bare_paho.py --port P [--user U --password-file F] --prefix fedmqtt/v1/many/bench \
        --sites 20 --model-mb 16
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt


class Counter:
    def __init__(self, target: int) -> None:
        self.target, self.n, self.done = target, 0, threading.Event()
        self.lock = threading.Lock()

    def add(self, k: int = 1) -> None:
        with self.lock:
            self.n += k
            if self.n >= self.target:
                self.done.set()


def _client(name: str, args: argparse.Namespace, on_message=None) -> mqtt.Client:
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=name, protocol=mqtt.MQTTv5)
    if args.user:
        c.username_pw_set(args.user, args.password)
    c.max_inflight_messages_set(20)
    if on_message is not None:
        c.on_message = on_message
    ready = threading.Event()
    c.on_connect = lambda *_: ready.set()
    c.connect("127.0.0.1", args.port, keepalive=60)
    c.loop_start()
    assert ready.wait(20), f"{name} did not connect"
    return c


def _subscribe(c: mqtt.Client, topic: str) -> None:
    acked = threading.Event()
    c.on_subscribe = lambda *_: acked.set()
    c.subscribe(topic, qos=2)
    assert acked.wait(20)


def _publish_all(c: mqtt.Client, topics: list[str], payload: bytes, window: int = 16) -> None:
    pending = []
    for t in topics:
        pending.append(c.publish(t, payload, qos=2, retain=False))
        if len(pending) >= window:
            pending.pop(0).wait_for_publish(60)
    for info in pending:
        info.wait_for_publish(60)


def run(args: argparse.Namespace) -> dict[str, float]:
    chunk = args.chunk_bytes
    n_chunks = max(1, round(args.model_mb * 1e6 / chunk))
    payload = bytes(chunk)
    down = Counter(args.sites * n_chunks)
    up = Counter(args.sites * n_chunks)
    server = _client("bare-server", args, on_message=lambda *_: up.add())
    _subscribe(server, f"{args.prefix}/up/#")
    sites = [_client(f"bare-site-{i}", args, on_message=lambda *_: down.add()) for i in range(args.sites)]
    for s in sites:
        _subscribe(s, f"{args.prefix}/down/#")
    window = max(1, args.window_bytes // chunk)  # the same flow control as fedmqtt's fetch window

    def wait_for(counter: Counter, n: int) -> None:
        deadline = time.monotonic() + 600
        while counter.n < n and time.monotonic() < deadline:
            time.sleep(0.002)
        assert counter.n >= n, f"only {counter.n} of {n} messages arrived"

    t0 = time.perf_counter()
    # Fan-out: a window of chunks to every site, then wait until all have it (a broker ack is not delivery;
    # without this, queues past max_queued_bytes make Mosquitto drop messages silently).
    for first in range(0, n_chunks, window):
        last = min(n_chunks, first + window)
        _publish_all(server, [f"{args.prefix}/down/{i}" for i in range(first, last)], payload)
        wait_for(down, args.sites * last)
    t1 = time.perf_counter()
    # Fan-in: `--concurrent` sites at a time, each a window at a time.
    sent = 0
    for first_site in range(0, len(sites), args.concurrent):
        batch = list(enumerate(sites[first_site:first_site + args.concurrent], start=first_site))
        step = max(1, window // len(batch))  # the window is shared by the sites sending at once
        for first in range(0, n_chunks, step):
            last = min(n_chunks, first + step)
            threads = [threading.Thread(target=_publish_all, args=(
                s, [f"{args.prefix}/up/{k}/{i}" for i in range(first, last)], payload)) for k, s in batch]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            sent += len(batch) * (last - first)
            wait_for(up, sent)
    t2 = time.perf_counter()
    for c in [server, *sites]:
        c.disconnect()
        c.loop_stop()
    moved = 2 * args.sites * n_chunks * chunk
    return {"fan_out_s": t1 - t0, "fan_in_s": t2 - t1, "total_s": t2 - t0, "bytes_moved": moved,
            "mb_per_s": moved / (t2 - t0) / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--user", default=None, help="user name (default: anonymous, for a broker that allows it)")
    ap.add_argument("--password-file", type=Path, default=None, help="a file holding the password")
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--sites", type=int, required=True)
    ap.add_argument("--model-mb", type=float, required=True)
    ap.add_argument("--chunk-bytes", type=int, default=2 * 1024 * 1024)
    ap.add_argument("--concurrent", type=int, default=4, help="sites sending to the server at once in the fan-in")
    ap.add_argument("--window-bytes", type=int, default=64 * 1024 * 1024, help="bytes in flight per receiver")
    args = ap.parse_args()
    args.password = args.password_file.read_text().strip() if args.password_file else None
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
