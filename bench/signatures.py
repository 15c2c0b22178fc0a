"""What signed messages cost per round, side by side with the same round's work without signatures, on this machine.

Real messages of a FedAvg round with N sites, at each model size: the global model and the N updates travel as
chunks (above `chunk_threshold_bytes`, 4 MiB), so each is signed once, on its manifest, and each chunk is checked
against the manifest's SHA-256 as it was before signatures; tasks and statuses are small messages signed whole.

- "off": the work the round does anyway for its large payloads: encode and cut into chunks (a SHA-256 per chunk)
  on the sender, check every chunk's SHA-256 and decode on the receiver; the model once out and N times in, N
  updates out and in.
- "signatures": every seal (sign) and open (verify) of the round: (N + 1) manifests and N tasks signed and 2N
  manifests and N tasks verified, plus the statuses (3 PS statuses read by every site, 2 statuses per site read
  by the PS, one metrics message).
- for comparison, the same model signed without the manifest: Ed25519 over its bytes (two SHA-512 passes to sign,
  one to verify), and one SHA-512 pass (what the digest-then-sign of a small message costs per byte).

    python bench/signatures.py --sizes-mb 4.4 16 --sites 10 --repeat 5
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
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


def best(fn, repeat: int) -> float:  # noqa: ANN001
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


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

    # -- the round's work without signatures --------------------------------------------------------------------
    t_encode = best(lambda: encode(model, max_bytes=BUDGET), repeat)
    t_cut = best(lambda: [chunk_digest(p) for p in parts], repeat)  # split's SHA-256 per chunk

    def receive() -> None:
        for p, digest in zip(parts, manifest.chunk_sha256, strict=True):
            assert chunk_digest(p) == digest
        decode(data, max_bytes=BUDGET)

    t_receive = best(receive, repeat)
    off = (sites + 1) * (t_encode + t_cut) + 2 * sites * t_receive

    # -- signatures: per operation, then per round ----------------------------------------------------------------
    head = encode(manifest, max_bytes=BUDGET)
    sealed_head = ps.seal(model_topic, head)
    t_sign_manifest = best(lambda: ps.seal(model_topic, head), repeat * 20)
    t_open_manifest = best(lambda: site.ring.open(model_topic, "ps", sealed_head, max_bytes=BUDGET), repeat * 20)
    task, ps_status, site_status = small_messages()
    costs = {}
    for name, msg, identity, owner, topic in (
            ("task", task, ps, "ps", topics.ps_task_topic(RUN, "site-a")),
            ("ps status", ps_status, ps, "ps", topics.ps_status_topic(RUN)),
            ("site status", site_status, site, "site-a", topics.site_status_topic(RUN, "site-a"))):
        body = encode(msg)
        sealed = identity.seal(topic, body)
        costs[name] = (best(lambda b=body, i=identity, t=topic: i.seal(t, b), repeat * 20),
                       best(lambda s=sealed, t=topic, o=owner: site.ring.open(t, o, s, max_bytes=BUDGET),
                            repeat * 20), len(sealed) - len(body))
    signs = ((sites + 1) * t_sign_manifest + sites * costs["task"][0] + 4 * costs["ps status"][0]
             + 2 * sites * costs["site status"][0])
    opens = (2 * sites * t_open_manifest + sites * costs["task"][1] + 3 * sites * costs["ps status"][1]
             + 2 * sites * costs["site status"][1])
    on = signs + opens

    # -- what signing the model's bytes themselves would cost ------------------------------------------------------
    key = keys.private["ps"]
    t_pure_sign = best(lambda: key.sign(data), repeat)
    signature = key.sign(data)
    t_pure_verify = best(lambda: key.public_key().verify(signature, data), repeat)
    t_sha512 = best(lambda: hashlib.sha512(data).digest(), repeat)

    return (f"{len(data) / 1e6:>7.1f} {manifest.count:>6} {off * 1e3:>10.1f} {on * 1e3:>10.2f} {on / off:>8.4f} "
            f"{t_sign_manifest * 1e6:>9.0f} {t_open_manifest * 1e6:>9.0f} {len(sealed_head) - len(head):>6} "
            f"{costs['site status'][2]:>6} {t_pure_sign * 1e3:>9.1f} {t_pure_verify * 1e3:>9.1f} "
            f"{t_sha512 * 1e3:>8.1f} {(sites + 1) * t_pure_sign + 2 * sites * t_pure_verify:>11.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[4.4, 16])
    ap.add_argument("--sites", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(f"one FedAvg round with {args.sites} sites (best of {args.repeat}; times in ms unless said)")
    print(f"{'MB':>7} {'chunks':>6} {'off ms':>10} {'sigs ms':>10} {'ratio':>8} {'sign µs':>9} {'open µs':>9} "
          f"{'+B man':>6} {'+B st':>6} {'ed-sign':>9} {'ed-verify':>9} {'sha512':>8} {'naive s/rd':>11}")
    for mb in args.sizes_mb:
        print(measure(mb, sites=args.sites, repeat=args.repeat))
    print("off: encode + chunk SHA-256 on send, chunk SHA-256 check + decode on receive, for the model (1 out, N in)\n"
          "and N updates; sigs: every seal and open of the round (manifests, tasks, statuses, metrics); ratio =\n"
          "sigs / off; sign/open µs: one manifest; +B: bytes a signature adds to a manifest and a status;\n"
          "ed-sign/ed-verify: Ed25519 over the whole encoded model instead (ms); naive s/rd: that per round, in s")


if __name__ == "__main__":
    main()
