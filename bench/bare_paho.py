"""The floor for one round's communication: the same bytes through the same broker with bare paho clients.

One "server" client publishes `model_bytes` as QoS-2 retained messages of `chunk_bytes` to N "site" clients
(fan-out), then every site publishes as many bytes back (fan-in). No schemas, hashing, validation, disk or
training: only MQTT. Run it as a separate process against a running broker:

    python bench/bare_paho.py --port P --user ps --password-file F --prefix fedmqtt/v1/many/bench \
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


def _client(name: str, args: argparse.Namespace, on_message=None) -> mqtt.Client:  # noqa: ANN001
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=name, protocol=mqtt.MQTTv5)
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
    t0 = time.perf_counter()
    _publish_all(server, [f"{args.prefix}/down/{i}" for i in range(n_chunks)], payload)
    assert down.done.wait(600), f"fan-out incomplete: {down.n}/{down.target}"
    t1 = time.perf_counter()
    threads = [threading.Thread(target=_publish_all, args=(s, [f"{args.prefix}/up/{k}/{i}" for i in range(n_chunks)],
                                                            payload)) for k, s in enumerate(sites)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert up.done.wait(600), f"fan-in incomplete: {up.n}/{up.target}"
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
    ap.add_argument("--user", required=True)
    ap.add_argument("--password-file", type=Path, required=True, help="a file holding the password")
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--sites", type=int, required=True)
    ap.add_argument("--model-mb", type=float, required=True)
    ap.add_argument("--chunk-bytes", type=int, default=2 * 1024 * 1024)
    args = ap.parse_args()
    args.password = args.password_file.read_text().strip()
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
