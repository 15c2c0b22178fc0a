"""A site goes online before torch has loaded: the agent module does not import torch, and the trainer is
built on a worker thread (issue 16, start-up)."""

from __future__ import annotations

import subprocess
import sys


def test_the_agent_module_does_not_import_torch() -> None:
    # Execute: a fresh interpreter, as `fedmqtt site start` is
    out = subprocess.run([sys.executable, "-c", "import sys, site_agent.agent, fedmqtt.cli; "
                          "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"],
                         capture_output=True, text=True, check=True)
    # Assert
    assert out.stdout.strip() == "[]"


# What a site process runs, short of the network: the CLI and agent modules, the trainer (torch), loading and
# splitting its data, and the metrics of a validation pass.
SITE_PATH = """
import sys
from pathlib import Path

import numpy as np

import fedmqtt.cli, site_agent.agent, site_agent.trainer
from fedmqtt.data.spec import DataSpec
from fedmqtt.metrics import task_metrics
from site_agent.data import load_site_data

data = load_site_data(DataSpec(format="heart_disease", path=Path(sys.argv[1]), split_seed=3))
scores = np.random.default_rng(0).random(data.y_val.shape[0])
assert task_metrics(data.task, data.y_val, scores)[0]["auroc"] is not None
print(sorted(m for m in sys.modules if m.split(".")[0] in ("sklearn", "pandas", "wfdb") or m == "scipy.stats"
             or (m.startswith("fedmqtt.strategies.") and m != "fedmqtt.strategies.params")))
"""


def test_a_site_process_never_imports_scikit_learn_scipy_stats_pandas_or_the_server_rules() -> None:
    """Importing scikit-learn costs a site about a CPU second, with scipy.stats and pandas (issue 30): the split
    and the metrics are numpy's (fedmqtt.data.shuffle_split, fedmqtt.scoring), wfdb is for ECG data only. The
    server rules (fedmqtt.strategies, loaded by name on first use) are the PS's; a site reads only `params`."""
    from pathlib import Path

    import fedmqtt

    cleveland = Path(fedmqtt.__file__).parent / "bundled" / "heart_disease" / "processed.cleveland.data"
    # Execute: a fresh interpreter, as `fedmqtt site start` is
    out = subprocess.run([sys.executable, "-c", SITE_PATH, str(cleveland)], capture_output=True, text=True,
                         check=True)
    # Assert
    assert out.stdout.strip() == "[]"


def test_a_site_loads_secure_aggregation_participant_dp_and_x509_only_when_used() -> None:
    """Secure aggregation (fedmqtt.secagg.site and its round), the participant-level DP accountants and cryptography's
    x509 (the broker-key check, loaded with a TLS context) cost a site process about 50 ms of CPU at start; a task
    that uses them loads them (issue 30, goal 3)."""
    # Execute: a fresh interpreter, as `fedmqtt site start` is
    lazy = ("fedmqtt.secagg.site", "site_agent.secagg_round", "fedmqtt.participant_dp", "site_agent.distributed_dp",
            "fedmqtt.secagg.skellam", "fedmqtt.transport.broker_identity", "cryptography.x509")
    out = subprocess.run([sys.executable, "-c", "import sys, fedmqtt.cli, site_agent.agent, site_agent.trainer; "
                          f"print(sorted(m for m in {lazy!r} if m in sys.modules))"],
                         capture_output=True, text=True, check=True)
    # Assert
    assert out.stdout.strip() == "[]"


def test_the_secure_aggregation_store_sizes_secrets_as_the_protocol_does() -> None:
    from fedmqtt.secagg.site import SECRETS_BYTES
    from site_agent import secagg_store

    assert secagg_store.SECRETS_BYTES == SECRETS_BYTES


# `fedmqtt site start`'s own path: the CLI, load_site_modules (the agent's modules, then kept), then what the
# agent's worker thread imports (the trainer, torch); the collector's passes counted per generation.
COLLECTOR_PATH = """
import gc
before = [s["collections"] for s in gc.get_stats()]
import fedmqtt.cli
fedmqtt.cli.site.load_site_modules()
import site_agent.trainer
after = [s["collections"] for s in gc.get_stats()]
print(after[1] - before[1], after[2] - before[2], gc.isenabled(), gc.get_freeze_count() > 10000)
"""


def test_a_site_imports_without_the_collectors_passes_and_keeps_what_it_loaded() -> None:
    """Each full pass of the collector during a site's imports walked every object made so far: 3 full and 36
    middle passes, about 0.25 CPU s of 1.5 (issue 30, goal 3). They are off while the CLI, the agent's modules
    and torch load, the collector is on again afterwards, and the agent's modules are frozen out of later passes."""
    # Execute: a fresh interpreter, as `fedmqtt site start` is
    out = subprocess.run([sys.executable, "-c", COLLECTOR_PATH], capture_output=True, text=True, check=True)
    # Assert
    middle, full, enabled, frozen = out.stdout.split()
    assert int(full) == 0
    assert int(middle) <= 2
    assert enabled == "True"
    assert frozen == "True"
