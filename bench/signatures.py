"""What signed messages cost per round, side by side with the same round's work without signatures, on this machine.

Real messages of a FedAvg round with N sites, at each model size: the global model and the N updates travel as
chunks (above `chunk_threshold_bytes`, 4 MiB), so each is signed once, on its manifest, and each chunk is checked
against the manifest's SHA-256 as it was before signatures; tasks and statuses are small messages signed whole.

- "off": the work each party does in a round anyway: encode and cut into chunks (a SHA-256 per chunk) what it
  sends, check every chunk's SHA-256 and decode what it takes. The PS sends the model, N tasks, 3 statuses and
  the metrics and takes N updates and 2 statuses per site; a site takes the model, its task and 3 PS statuses and
  sends its update and 2 statuses.
- "sig": every seal (sign) and open (verify) of the same messages: one per manifest, task, status and metrics.
- for comparison, the same model signed without the manifest: Ed25519 over its bytes (two SHA-512 passes to sign,
  one to verify), and one SHA-512 pass (what the digest-then-sign of a small message costs per byte).

Every timed piece runs once per pass, in turn (with and without signatures alternate), and the best of the passes
is kept; the load average is printed before and after.

    python bench/signatures.py --sizes-mb 4.4 16 --sites 10 --repeat 9
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedmqtt.transport import topics
from fedmqtt.transport.bulk import split
from fedmqtt.transport.signing import FederationKeys
from schemas import messages as m
from schemas.chunks import chunk_digest
from schemas.codec import decode, encode
from schemas.tensors import arrays_to_blobs, tensors_hash

RUN = "bench"
CHUNK = 2 * 1024 * 1024
BUDGET = 1 << 31


def interleaved(fns: dict[str, Callable[[], object]], repeat: int, *, calls: dict[str, int]) -> dict[str, float]:
    """Best time of one call of each function over `repeat` passes; a pass calls every function in turn (`calls`
    times each, for those that take microseconds), so the work without and with signatures alternates and a busy
    moment of the machine hits both alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            for _ in range(calls.get(name, 1)):
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
    return {name: min(ts) for name, ts in times.items()}


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def model_of(mb: float) -> m.GlobalModel:
    n = int(mb * 1e6 / 4)
    arrays = {"fc1.weight": np.random.default_rng(0).normal(size=n - 2048).astype(np.float32),
              "fc1.bias": np.zeros(1024, np.float32), "fc2.weight": np.ones(1024, np.float32)}
    blobs = arrays_to_blobs(arrays)
    return m.GlobalModel(run_id=RUN, sender="ps", round=1, model=m.ModelSpec(name="mlp"),
                         model_hash=tensors_hash(blobs), tensors=blobs)


def small_messages() -> tuple[m.TrainTask, m.DaemonStatus, m.SiteStatus]:
    task = m.TrainTask(run_id=RUN, sender="ps", round=1, site_id="site-a", model_hash="h" * 64, deadline=1e9,
                       settings=m.TrainSettings(), session="ab" * 8)
    ps_status = m.DaemonStatus(run_id=RUN, sender="ps", round=1, state="training", algorithm="fedavg",
                               rounds_total=20, sites_expected=tuple(f"site-{i}" for i in range(10)),
                               sites_online=tuple(f"site-{i}" for i in range(10)), detail="round 1")
    site_status = m.SiteStatus(run_id=RUN, sender="site-a", round=1, state="training", n_train=1000, n_val=200,
                               n_test=200, detail="round 1")
    return task, ps_status, site_status


def measure(mb: float, *, sites: int, repeat: int) -> str:
    keys = FederationKeys(RUN, ["ps", "site-a"])
    ps, site = keys.identity("ps"), keys.identity("site-a")
    model = model_of(mb)
    data = encode(model, max_bytes=BUDGET)
    manifest, chunks = split(data, model, chunk_bytes=CHUNK)
    parts = [c.data for c in chunks()]
    model_topic = topics.ps_model_topic(RUN)

    head = encode(manifest, max_bytes=BUDGET)
    sealed_head = ps.seal(model_topic, head)
    key = keys.private["ps"]
    signature = key.sign(data)

    def receive() -> None:
        for p, digest in zip(parts, manifest.chunk_sha256, strict=True):
            assert chunk_digest(p) == digest
        decode(data, max_bytes=BUDGET)

    # The work a round does anyway (no signatures) and every signature, all timed in turn within each pass
    fns: dict[str, Callable[[], object]] = {
        "send": lambda: (encode(model, max_bytes=BUDGET), [chunk_digest(p) for p in parts]),
        "receive": receive,
        "sign": lambda: ps.seal(model_topic, head),
        "open": lambda: site.ring.open(model_topic, "ps", sealed_head, max_bytes=BUDGET),
        # what signing the model's bytes themselves would cost
        "pure sign": lambda: key.sign(data),
        "pure verify": lambda: key.public_key().verify(signature, data),
        "sha512": lambda: hashlib.sha512(data).digest(),
    }
    task, ps_status, site_status = small_messages()
    extra: dict[str, int] = {}  # kind -> bytes a signature adds
    for name, msg, identity, owner, topic in (
            ("task", task, ps, "ps", topics.ps_task_topic(RUN, "site-a")),
            ("ps status", ps_status, ps, "ps", topics.ps_status_topic(RUN)),
            ("site status", site_status, site, "site-a", topics.site_status_topic(RUN, "site-a"))):
        body = encode(msg)
        sealed = identity.seal(topic, body)
        extra[name] = len(sealed) - len(body)
        fns |= {f"enc {name}": lambda m_=msg: encode(m_),
                f"dec {name}": lambda b=body: decode(b, max_bytes=BUDGET),
                f"sig {name}": lambda b=body, i=identity, t=topic: i.seal(t, b),
                f"opn {name}": lambda s_=sealed, t=topic, o=owner: site.ring.open(t, o, s_, max_bytes=BUDGET)}
    quick = ("sign", "open", *(f"{op} {k}" for op in ("enc", "dec", "sig", "opn") for k in extra))
    best = interleaved(fns, repeat, calls=dict.fromkeys(quick, 20))
    t_send, t_receive, t_sign, t_open = best["send"], best["receive"], best["sign"], best["open"]
    enc, dec, sig, opn = ({k: best[f"{op} {k}"] for k in extra} for op in ("enc", "dec", "sig", "opn"))

    # The PS: sends the model, N tasks, 3 statuses and the metrics; takes N updates and 2 statuses per site.
    ps_off = (t_send + sites * t_receive + sites * enc["task"] + 4 * enc["ps status"]
              + 2 * sites * dec["site status"])
    ps_sigs = t_sign + sites * sig["task"] + 4 * sig["ps status"] + sites * t_open + 2 * sites * opn["site status"]
    # A site: takes the model, its task and 3 PS statuses; sends its update and 2 statuses.
    site_off = t_receive + dec["task"] + 3 * dec["ps status"] + t_send + 2 * enc["site status"]
    site_sigs = t_open + opn["task"] + 3 * opn["ps status"] + t_sign + 2 * sig["site status"]
    t_pure_sign, t_pure_verify, t_sha512 = best["pure sign"], best["pure verify"], best["sha512"]

    ms = 1e3
    return (f"{len(data) / 1e6:>7.1f} {manifest.count:>6} {ps_off * ms:>8.1f} {ps_sigs * ms:>8.2f} "
            f"{ps_sigs / ps_off:>7.4f} {site_off * ms:>8.1f} {site_sigs * ms:>8.2f} {site_sigs / site_off:>7.4f} "
            f"{t_sign * 1e6:>7.0f} {t_open * 1e6:>7.0f} {len(sealed_head) - len(head):>5} "
            f"{extra['site status']:>5} {t_pure_sign * ms:>8.1f} {t_pure_verify * ms:>8.1f} {t_sha512 * ms:>7.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[4.4, 16])
    ap.add_argument("--sites", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(f"one FedAvg round with {args.sites} sites, best of {args.repeat} interleaved passes; "
          f"load average {load_average()} at the start")
    print(f"{'MB':>7} {'chunks':>6} {'PS off':>8} {'PS sig':>8} {'ratio':>7} {'site off':>8} {'site sig':>8} "
          f"{'ratio':>7} {'sign':>7} {'open':>7} {'+Bman':>5} {'+Bst':>5} {'ed-sign':>8} {'ed-vrfy':>8} "
          f"{'sha512':>7}")
    for mb in args.sizes_mb:
        print(measure(mb, sites=args.sites, repeat=args.repeat))
    print(f"load average {load_average()} at the end")
    print("PS/site off (ms): the round's encode, chunk SHA-256 and decode work of that party without signatures;\n"
          "PS/site sig (ms): every seal and open it does with them (one per manifest, task, status, metrics);\n"
          "ratio = sig / off; sign/open (µs): one manifest; +Bman/+Bst: bytes a signature adds to a manifest and a\n"
          "status; ed-sign/ed-vrfy (ms): Ed25519 over the whole encoded model instead; sha512 (ms): one pass over it")


if __name__ == "__main__":
    main()
