"""A large model end to end: a real Mosquitto, a real PS and S real site processes; each party's peak memory
over the model, and what the broker still holds retained under the sites' topics once the run is over.

    python bench/big_model.py --model-mb 1000 --sites 2 --rounds 2

The model is bench/many_sites.py's MLP of about `--model-mb` MB of float32 weights (one H x H layer holds
nearly all of it: the worst case for anything done tensor by tensor), local work one SGD step, so the run is
mostly moving, checking, storing and averaging the model. Peaks are VmHWM (the kernel's own high-water mark of
resident memory) read every `--sample-s`; ratios are MiB over the model's MiB. A site's peak includes its local
training (bench/train_alone.py measures that alone: `--train-alone`). A site process runs one agent.

After the PS has finished, and before the sites stop, a fresh MQTT client logs in as the PS (the one user that may
read every site's topics) and lists every retained message under the sites' uplink topics: after a run, nothing
of an update, a chunk or a report should be left there.
"""

from __future__ import annotations

import argparse
import json
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from many_sites import model_bytes, model_spec, peak_rss_mb, write_configs  # noqa: E402

from broker.config import free_port  # noqa: E402
from broker.federation import init_federation  # noqa: E402
from broker.process import BrokerProcess  # noqa: E402
from fedmqtt.transport import topics  # noqa: E402

UPLINKS = ("update", "report", "secagg")  # the site topics that carry models or results


def available_mib() -> float:
    """MemAvailable of the machine, in MiB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("inf")


def rss_parts(pid: int) -> tuple[float, ...] | None:
    """(VmRSS, RssAnon, RssFile, RssShmem) of `pid` in MiB."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        return tuple(int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "RssAnon", "RssFile", "RssShmem"))
    except (OSError, KeyError, ValueError):
        return None


def explain_peak(trace: list[tuple[float, tuple[float, ...]]], log_path: Path, model_mib: float) -> str:
    """The PS's highest resident memory between one log line and the next (run with -v), the top few: which
    step each peak follows."""
    from datetime import datetime

    stamped = []
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            stamped.append((datetime.fromisoformat(line[:23]).timestamp(), line[24:150]))
        except ValueError:
            continue
    stamped.append((float("inf"), ""))
    steps = []
    for (begin, text), (end, _) in zip(stamped, stamped[1:], strict=False):
        inside = [parts for at, parts in trace if begin <= at < end]
        if inside:
            top = max(inside, key=lambda p: p[0])
            steps.append((top[0], f"{top[0]:6.0f} MiB ({top[0] / model_mib:.2f}x; anon {top[1]:.0f}, file "
                                  f"{top[2]:.0f}, shmem {top[3]:.0f}) after: {text}"))
    steps.sort(reverse=True)
    return "PS resident memory, highest samples by the log line they follow:\n  " + "\n  ".join(
        text for _, text in steps[:6])


def retained_under(settings, filters: list[str], wait_s: float = 3.0) -> list[tuple[str, int]]:  # noqa: ANN001
    """(topic, payload bytes) of every non-empty retained message under `filters`, as `settings`' user reads them."""
    import paho.mqtt.client as mqtt

    got: queue.Queue[tuple[str, int]] = queue.Queue()
    ready: queue.Queue[object] = queue.Queue()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=settings.username, protocol=mqtt.MQTTv5)
    client.username_pw_set(settings.username, settings.password)
    client.on_connect = lambda _c, _u, _f, reason, _p: ready.put(reason)
    client.on_subscribe = lambda *_a: ready.put("subscribed")
    client.on_message = lambda _c, _u, msg: got.put((msg.topic, len(msg.payload))) if msg.retain else None
    client.connect(settings.host, settings.port)
    client.loop_start()
    try:
        reason = ready.get(timeout=10)
        if getattr(reason, "is_failure", False):
            raise SystemExit(f"the broker refused the reader: {reason}")
        client.subscribe([(f, 1) for f in filters])
        ready.get(timeout=10)
        time.sleep(wait_s)  # retained messages arrive right after the SUBACK
    finally:
        client.disconnect()
        client.loop_stop()
    out = []
    while not got.empty():
        topic, size = got.get()
        if size:
            out.append((topic, size))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-mb", type=float, required=True, help="model size in MB of float32 weights")
    ap.add_argument("--sites", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--upload-turns", type=int, default=2, help="the PS's upload_turns (its default: 2)")
    ap.add_argument("--sample-s", type=float, default=0.1)
    ap.add_argument("--train-alone", action="store_true", help="also run a site's local training alone")
    ap.add_argument("--trace", action="store_true", help="log the PS at debug level and say what it did "
                    "just before its highest resident-memory sample")
    ap.add_argument("--min-available-mb", type=float, default=1500, help="stop every process of the run when "
                    "the machine's available memory falls below this (a shared machine must not reach its OOM killer)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (logs, checkpoints)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fedmqtt-big-"))
    work.chmod(0o711)  # mosquitto runs as its own user and must pass through to its config
    layout = init_federation(work / "federation", run_id="big", site_ids=[f"site-{i}" for i in range(args.sites)],
                             port=free_port(), force=True)
    cfg = argparse.Namespace(rounds=args.rounds, selection="all", model_mb=args.model_mb,
                             upload_turns=args.upload_turns, fraction=None)
    ps_path, site_paths = write_configs(work, layout, cfg)
    (work / "logs").mkdir(exist_ok=True)
    started = time.monotonic()
    procs: list[subprocess.Popen] = []
    ps: subprocess.Popen | None = None
    try:
        with BrokerProcess.start(layout.conf_path, port=layout.port) as broker:
            for k, path in enumerate(site_paths):
                log = open(work / "logs" / f"site-{k}.log", "wb")  # noqa: SIM115 - the child holds it
                procs.append(subprocess.Popen([sys.executable, "-m", "site_agent.multi", str(path)], stdout=log,
                                              stderr=log))
            ps_log = open(work / "logs" / "ps.log", "wb")  # noqa: SIM115
            ps = subprocess.Popen([sys.executable, "-m", "fedmqtt", "ps", "start", "--config", str(ps_path),
                                   *(["-v"] if args.trace else [])], stdout=ps_log, stderr=ps_log)
            trace: list[tuple[float, tuple[float, ...]]] = []
            peak = broker_peak = 0.0
            site_peaks = [0.0] * len(procs)
            while ps.poll() is None:
                peak = max(peak, peak_rss_mb(ps.pid) or 0.0)
                parts = rss_parts(ps.pid) if args.trace else None
                if parts is not None:
                    trace.append((time.time(), parts))
                broker_peak = max(broker_peak, peak_rss_mb(broker.pid) or 0.0)
                site_peaks = [max(old, peak_rss_mb(p.pid) or 0.0) for old, p in zip(site_peaks, procs, strict=True)]
                if available_mib() < args.min_available_mb:
                    raise SystemExit(f"stopped: only {available_mib():.0f} MiB of memory left on the machine")
                failed = [k for k, p in enumerate(procs) if p.poll() not in (None, 0)]
                if failed:
                    raise SystemExit(f"site {failed[0]} failed; see {work / 'logs' / f'site-{failed[0]}.log'}")
                time.sleep(args.sample_s)
            broker_peak = max(broker_peak, peak_rss_mb(broker.pid) or 0.0)
            time.sleep(2.0)  # the sites see the run end (and clear what they left) before the broker is read
            broker_peak = max(broker_peak, peak_rss_mb(broker.pid) or 0.0)
            site_peaks = [max(old, peak_rss_mb(p.pid) or 0.0) for old, p in zip(site_peaks, procs, strict=True)]
            filters = [f"{topics.run_prefix(layout.run_id)}/site/+/{kind}/#" for kind in UPLINKS]
            left = retained_under(layout.settings("ps"), filters) if ps.returncode == 0 else []
    finally:
        for p in [*procs, *([ps] if ps is not None else [])]:
            if p.poll() is None:
                p.terminate()
        for p in [*procs, *([ps] if ps is not None else [])]:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        if sys.exc_info()[0] is not None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)  # a 1 GB run leaves gigabytes of checkpoints and spool
    assert ps is not None
    if ps.returncode != 0:
        raise SystemExit(f"PS failed ({ps.returncode}); see {work / 'logs' / 'ps.log'}")
    report = json.loads((work / "ps" / "report.json").read_text())
    raw = model_bytes(model_spec(args.model_mb))
    model_mib = raw / 2**20
    print(f"model {raw / 1e6:.1f} MB ({model_mib:.0f} MiB) of float32, {args.sites} sites, {args.rounds} rounds, "
          f"upload_turns {args.upload_turns}")
    print("round wall time (s): " + ", ".join(f"{r['duration_s']:.1f}" for r in report["rounds"]))
    print(f"PS peak {peak:.0f} MiB = {peak / model_mib:.2f}x the model")
    print(f"broker peak {broker_peak:.0f} MiB = {broker_peak / model_mib:.2f}x the model")
    print("site peaks " + ", ".join(f"{p:.0f} MiB = {p / model_mib:.2f}x" for p in site_peaks))
    if args.trace:
        print(explain_peak(trace, work / "logs" / "ps.log", model_mib))
    if args.train_alone:
        import tomllib

        ps_cfg = tomllib.loads(ps_path.read_text())
        alone = subprocess.run([sys.executable, str(Path(__file__).with_name("train_alone.py")),
                                json.dumps(ps_cfg["model"]), json.dumps(ps_cfg["train"])],
                               capture_output=True, text=True, check=True)
        alone_mib = json.loads(alone.stdout.strip().splitlines()[-1])["peak_mb"]
        print(f"local training alone (bench/train_alone.py): {alone_mib:.0f} MiB; a site's peak beyond it = "
              f"{(max(site_peaks) - alone_mib) / model_mib:.2f}x the model")
    print(f"retained under the sites' uplink topics after the run: {len(left)} messages, "
          f"{sum(n for _, n in left):,} bytes" + (f" (e.g. {left[0][0]})" if left else ""))
    print(f"total wall time {time.monotonic() - started:.1f} s")
    if args.keep:
        print(f"work dir {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
