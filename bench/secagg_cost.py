"""What secure aggregation (fedmqtt/secagg, SecAgg+) costs one site and the PS, as the federation and the model grow,
next to the cost of sending the same update in the clear. One process plays every party of one round.

    .venv/bin/python bench/secagg_cost.py                 # n = 10, 30, 100, 300 at 10k coordinates; n = 10 at 1.1M
    .venv/bin/python bench/secagg_cost.py --quick         # n = 10, 30 at 10k; n = 10 at 100k

Per site: CPU seconds (key generation and signing, sharing, masking, answering the unmasking request) and bytes it
sends and receives by stage (advertisement, roster, sealed shares, masked input, answer), with the clear update
(float32 bytes) and the CPU time to put it on the wire in the clear (tensor blobs and their SHA-256, as
an update message carries them; signing aside) beside them. The PS: CPU seconds to route, check and unmask.
A fraction of the sites (--lost, default 0.1) drops after sharing keys, so the PS also rebuilds their mask keys.
The degree k and threshold t of the graph are printed: per-site cost follows k (~log n), not n.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# Runnable as a plain script from the repository root (bench/ is not a package).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedmqtt.secagg import messages as msg  # noqa: E402
from fedmqtt.secagg.context import RoundContext  # noqa: E402
from fedmqtt.secagg.ring import FixedPoint  # noqa: E402
from fedmqtt.secagg.sealing import SEALED_BYTES  # noqa: E402
from fedmqtt.secagg.server import ServerSession  # noqa: E402
from fedmqtt.secagg.shamir import SHARE_BYTES  # noqa: E402
from fedmqtt.secagg.site import SiteSession  # noqa: E402
from fedmqtt.transport.signing import FederationKeys  # noqa: E402
from schemas.tensors import arrays_to_blobs, tensors_hash  # noqa: E402

ID_BYTES = 8  # a site id on the wire, about
ADVERT_BYTES = 32 + 32 + 32 + 64 + 16 + ID_BYTES  # two keys, the commitment, the signature and its key id
# a roster: every site's id (the graph is built from them) and the k + 1 advertisements of a neighbourhood


STAGES = ("keys", "share", "mask", "unmask")


@dataclass
class Cost:
    cpu: dict[str, float] = field(default_factory=dict)  # site -> CPU seconds over all its steps
    by_stage: dict[str, dict[str, float]] = field(default_factory=lambda: {stage: {} for stage in STAGES})


def timed(cost: Cost, site: str, stage: str, action):  # type: ignore[no-untyped-def]
    start = time.process_time()
    result = action()
    spent = time.process_time() - start
    cost.cpu[site] = cost.cpu.get(site, 0.0) + spent
    cost.by_stage[stage][site] = cost.by_stage[stage].get(site, 0.0) + spent
    return result


def one_round(n: int, length: int, lost: float, dropout: float, seed: int) -> dict[str, float]:
    names = [f"site-{i:03d}" for i in range(n)]
    keys = FederationKeys("bench", ["ps", *names])
    ring = keys.identity("observer").ring
    ctx = RoundContext("bench", 1)
    fixed = FixedPoint(clip=8.0, fraction_bits=16, bits=32, max_sites=n)
    rng = np.random.default_rng(seed)
    updates = {s: rng.normal(size=length).astype(np.float32) for s in names}
    cost, server_cpu = Cost(), 0.0
    sites = {s: timed(cost, s, "keys", lambda s=s: SiteSession(ctx, s, keys.private[s], ring, fixed, length,
                                                          dropout=dropout)) for s in names}
    server = ServerSession(ctx, names, ring, fixed, length, dropout=dropout)

    def on_server(action):  # type: ignore[no-untyped-def]
        nonlocal server_cpu
        start = time.process_time()
        result = action()
        server_cpu += time.process_time() - start
        return result

    for s in names:
        advert = timed(cost, s, "keys", sites[s].advertise)
        on_server(lambda a=advert: server.receive_advert(a))
    roster = on_server(server.close_adverts)
    assert isinstance(roster, dict)
    for s in names:
        bundle = timed(cost, s, "share", lambda s=s: sites[s].share(roster[s]))
        on_server(lambda b=bundle: server.receive_shares(b))
    inbox = on_server(server.close_shares)
    assert isinstance(inbox, dict)
    gone = set(names[:: max(1, round(1 / lost))][: int(lost * n)]) if lost > 0 else set()
    for s in names:
        if s in gone:
            continue
        masked = timed(cost, s, "mask", lambda s=s: sites[s].mask(updates[s], inbox[s]))
        on_server(lambda m=masked: server.receive_masked(m))
    request = on_server(server.close_masked)
    assert isinstance(request, msg.UnmaskRequest), request
    answers = {}
    for s in request.survivors:
        answers[s] = timed(cost, s, "unmask", lambda s=s: sites[s].unmask(request))
        on_server(lambda a=answers[s]: server.receive_answer(a))
    outcome = on_server(server.finish)
    assert isinstance(outcome, msg.RoundSum), outcome
    clear = np.sum([np.clip(updates[s].astype(np.float64), -8, 8) for s in request.survivors], axis=0)
    assert np.max(np.abs(outcome.total - clear)) <= fixed.sum_error_bound(len(request.survivors))

    graph = server._graph()
    k = graph.params.degree
    survivor = request.survivors[0]
    answer = answers[survivor]
    answered = len(answer.seed_shares) + len(answer.mask_key_shares)
    start = time.process_time()
    for _ in range(20):  # what a site does to put the same update on the wire in the clear (signing aside)
        tensors_hash(arrays_to_blobs({"update": updates[survivor]}))
    clear_cpu = (time.process_time() - start) / 20
    survivor_cpu = [cost.cpu[s] for s in request.survivors]
    return {
        "n": n, "length": length, "k": k, "t": graph.params.threshold, "lost": len(gone),
        "site_cpu_median": statistics.median(survivor_cpu), "site_cpu_max": max(survivor_cpu),
        "clear_cpu": clear_cpu, "server_cpu": server_cpu,
        **{f"cpu_{stage}": statistics.median(cost.by_stage[stage][s] for s in request.survivors) for stage in STAGES},
        "keys_sent": ADVERT_BYTES, "keys_received": n * ID_BYTES + (k + 1) * ADVERT_BYTES,
        "shares_sent": k * (SEALED_BYTES + 2 * ID_BYTES), "shares_received": k * (SEALED_BYTES + 2 * ID_BYTES),
        "masked_sent": length * fixed.bytes_per_coordinate + k * ID_BYTES,
        "answer_sent": answered * (2 + SHARE_BYTES + ID_BYTES), "clear_sent": length * 4,
    }


def kib(value: float) -> str:
    return f"{value / 1024:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    parser.add_argument("--lost", type=float, default=0.1, help="fraction of sites lost after sharing keys")
    parser.add_argument("--dropout", type=float, default=0.1, help="target dropout fraction of the graph")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    small, large = (10_000, 100_000) if args.quick else (10_000, 1_100_000)
    sizes = [(10, small), (30, small)] if args.quick else [(n, small) for n in (10, 30, 100, 300)]
    sizes.append((10, large))
    print("| sites | coords | k | t | lost | site CPU s (median / max) | clear encode s | PS CPU s | keys out / in KiB "
          "| shares out / in KiB | masked out KiB | answer KiB | clear update KiB | bytes / clear |")
    print("| ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: |")
    rows = []
    for n, length in sizes:
        r = one_round(n, length, args.lost, args.dropout, args.seed)
        rows.append(r)
        total = r["keys_sent"] + r["keys_received"] + r["shares_sent"] + r["shares_received"] + r["masked_sent"] \
            + r["answer_sent"]
        print(f"| {n} | {length} | {r['k']} | {r['t']} | {r['lost']} | {r['site_cpu_median']:.3f} / "
              f"{r['site_cpu_max']:.3f} | {r['clear_cpu']:.5f} | {r['server_cpu']:.2f} | {kib(r['keys_sent'])} / "
              f"{kib(r['keys_received'])} | {kib(r['shares_sent'])} / {kib(r['shares_received'])} | "
              f"{kib(r['masked_sent'])} | {kib(r['answer_sent'])} | {kib(r['clear_sent'])} | "
              f"{total / r['clear_sent']:.2f} |", flush=True)
    print("\nA site's CPU by step (median over the survivors, milliseconds):\n")
    print("| sites | coords | keys (generate, sign) | share (check roster, split, seal) | mask (open, encode, mask) "
          "| unmask (answer) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['n']} | {r['length']} | " + " | ".join(f"{1000 * r[f'cpu_{stage}']:.1f}" for stage in STAGES)
              + " |")


if __name__ == "__main__":
    main()
