"""A run started from `init_model` is checkpointed like any other: a PS SIGKILLed after round 1 resumes from its
checkpoint (the file is not read again) and ends bit for bit as the uninterrupted simulation. Before round 1 has
closed there is no checkpoint, so a resumed PS loads the file again: only the file the run started from."""

from __future__ import annotations

import hashlib
import json
import signal
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from fedmqtt.simulation import SimulationConfig, bundled_sites, run_simulation
from fedmqtt.training.weights import initial_arrays
from schemas import messages as m

ROUNDS = 3
SITES = ("cleveland", "switzerland")
BN_MODEL = {"name": "mlp", "args": {"in_features": 15, "hidden": [16], "norm": "bn"}}
TRAIN = {"epochs": 1, "batch_size": 32, "lr": 0.01}


def test_ps_killed_after_round_one_resumes_from_its_checkpoint(cli_federation: Any, tmp_path) -> None:
    # Prepare: a backbone with a 3-class head; both sites needed in every round
    init = tmp_path / "pretrained.safetensors"
    save_file(initial_arrays(BN_MODEL["name"], {**BN_MODEL["args"], "out_features": 3}, 42), str(init))
    init_model = {"path": str(init), "tensors": "matching"}
    fed = cli_federation("init-resume", run_id="init-resume", rounds=ROUNDS, sites=SITES, algorithm="fedfbn",
                         hyper={}, train=TRAIN, model=BN_MODEL, ps_extra={"init_model": init_model})
    text = fed.ps_config.read_text()
    fed.ps_config.write_text(text.replace("quorum = 1\n", f"quorum = {len(SITES)}\n"))
    sim = SimulationConfig(run_id="init-resume", algorithm="fedfbn", rounds=ROUNDS, seed=0, out_dir=tmp_path / "sim",
                           model=BN_MODEL, train=TRAIN, init_model=init_model,
                           sites={s: d for s, d in bundled_sites().items() if s in SITES})
    reference = run_simulation(sim, progress=False)
    fed.start_broker()
    fed.start_ps(fault="after_checkpoint:1")
    for site in SITES:
        fed.start_site(site)
    # Execute: kill after round 1's checkpoint; spoil the file, which the resumed PS must not need
    rc = fed.procs["ps"].wait(180)
    init.write_bytes(b"not a model any more")
    fed.start_ps(resume=True)
    fed.wait_ps_done(240)
    # Assert
    assert rc == -signal.SIGKILL, fed.tail("ps")
    assert "resuming from checkpoint of round 1" in fed.tail("ps", 400)
    report = json.loads((fed.work / "ps" / "report.json").read_text())
    assert [r["model_hash"] for r in report["rounds"]] == [r["model_hash"] for r in reference["rounds"]]
    assert report["init_model"]["kept"] == reference["init_model"]["kept"] == ["head.weight", "head.bias"]
    assert report["final"]["per_site"] == reference["final"]["per_site"]
    simulated = json.loads((tmp_path / "sim" / "report.json").read_text())["final"]["model_hash"]
    assert report["final"]["model_hash"] == simulated
    weights = fed.final_weights()
    assert all(np.isfinite(v).all() for v in weights.values())


def test_ps_resumed_before_round_one_refuses_another_init_model_file(cli_federation, tmp_path) -> None:
    # Prepare: a PS started from a pretrained file, waiting for its sites (none come: round 1 never closes)
    init = tmp_path / "pretrained.safetensors"
    save_file(initial_arrays(BN_MODEL["name"], BN_MODEL["args"], 42), str(init))
    original = init.read_bytes()
    fed = cli_federation("init-check", run_id="init-check", rounds=ROUNDS, sites=SITES, algorithm="fedavg",
                         model=BN_MODEL, ps_extra={"init_model": {"path": str(init)}})
    fed.start_broker()
    fed.watch()
    fed.start_ps()
    first = fed.wait_message(lambda msg: isinstance(msg, m.DaemonStatus) and msg.state == "waiting_for_sites", 120,
                             "the PS to wait for its sites")
    fed.kill("ps")
    # Execute: another model's weights under the same name, then --resume
    save_file(initial_arrays(BN_MODEL["name"], BN_MODEL["args"], 43), str(init))
    swapped = hashlib.sha256(init.read_bytes()).hexdigest()
    fed.start_ps(resume=True)
    rc = fed.procs["ps"].wait(120)
    refusal = fed.tail("ps", 5)
    # ... the original file back, and --resume again
    init.write_bytes(original)
    fed.start_ps(resume=True)
    second = fed.wait_message(lambda msg: isinstance(msg, m.DaemonStatus) and msg.state == "waiting_for_sites"
                              and msg.session != first.session, 120, "the resumed PS")  # type: ignore[attr-defined]
    # Assert: refused by name, with both hashes and the fix; the original accepted as the file the run started from
    assert rc == 2, fed.tail("ps")
    started_with = hashlib.sha256(original).hexdigest()
    assert f"has sha256 {swapped}, but this run started from a file with sha256 {started_with}" in refusal, refusal
    assert "put the file it started from back at init_model.path" in refusal and "without --resume" in refusal
    assert f"--resume: init_model {init} is the file this run started from" in fed.tail("ps", 400)
    assert isinstance(second, m.DaemonStatus) and fed.procs["ps"].poll() is None
