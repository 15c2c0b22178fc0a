"""CPU seconds a site process spends importing what it runs, now against the same with scikit-learn imported.

Each variant runs in a fresh interpreter, as `fedmqtt site start` does: it imports the CLI, the agent and the
trainer (torch), loads and splits a bundled heart-disease site and computes the metrics of a validation pass
(everything a site imports before and during its first round, short of the network). The variants:

- now: this tree as it is (the split and the metrics in numpy: fedmqtt.data.shuffle_split, fedmqtt.scoring);
- eager sklearn: the same, after `import sklearn.model_selection, sklearn.metrics`, which the split and the
  metrics imported before issue 30 (with them come scipy.stats and pandas);
- baseline tree (`--baseline-tree DIR`, optional): the same script body run from another checkout, e.g.
  `git archive <commit> | tar -x -C DIR`.

Before the runs, each tree's own packages are compiled to bytecode (`compileall`), as `pip install` does for an
installed site: without it, a checkout run with PYTHONDONTWRITEBYTECODE=1 (as on the team's machine) compiles
them from source in every process, about 0.1 CPU s more, which no deployed site pays.

CPU is user + system time of the child process (getrusage of the children, interpreter start-up included),
and separately the child's own `time.process_time()` around the imports alone. Variants alternate, `--repeats`
times each, and the medians are printed with their ratio, so both see the same machine load.

    python bench/site_imports.py --repeats 7 [--baseline-tree /tmp/base]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("fedmqtt", "schemas", "site_agent")
CLEVELAND = REPO / "fedmqtt" / "bundled" / "heart_disease" / "processed.cleveland.data"

SITE = """
import sys, time
t0 = time.process_time()
{prelude}
import fedmqtt.cli
load_site_modules = getattr(fedmqtt.cli.site, "load_site_modules", None)  # what `site start` runs first
if load_site_modules is not None:  # (trees from before issue 30's fourth pass have none)
    load_site_modules()
import site_agent.agent, site_agent.trainer
from pathlib import Path
import numpy as np
from fedmqtt.data.spec import DataSpec
from fedmqtt.metrics import task_metrics
from site_agent.data import load_site_data
imports = time.process_time() - t0
data = load_site_data(DataSpec(format="heart_disease", path=Path(sys.argv[1]), split_seed=3))
task_metrics(data.task, data.y_val, np.random.default_rng(0).random(data.y_val.shape[0]))
heavy = sorted(m for m in ("sklearn", "scipy.stats", "pandas", "wfdb", "torch") if m in sys.modules)
print(f"{{imports:.4f}} {{','.join(heavy)}}")
"""


def run_once(prelude: str, tree: Path) -> tuple[float, float, str]:
    """(child CPU s in all, child's CPU s of imports, heavy modules it had loaded)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "-c", SITE.format(prelude=prelude), str(CLEVELAND)],
                         cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True,
                         check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    imports, _, heavy = out.stdout.strip().partition(" ")
    return total, float(imports), heavy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--baseline-tree", type=Path, default=None, help="also run from this checkout")
    args = parser.parse_args()
    variants = {"now": ("", REPO), "eager sklearn": ("import sklearn.model_selection, sklearn.metrics", REPO)}
    if args.baseline_tree is not None:
        variants["baseline tree"] = ("", args.baseline_tree.resolve())
    for tree in {tree for _, tree in variants.values()}:
        subprocess.run([sys.executable, "-m", "compileall", "-q", *PACKAGES], cwd=tree, check=True)
    seen: dict[str, list[tuple[float, float, str]]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, (prelude, tree) in variants.items():
            seen[name].append(run_once(prelude, tree))
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}; {os.cpu_count()} CPUs; "
          f"medians of {args.repeats} runs each, alternating")
    now_total = statistics.median(r[0] for r in seen["now"])
    for name, runs in seen.items():
        total = statistics.median(r[0] for r in runs)
        imports = statistics.median(r[1] for r in runs)
        spread = f"{min(r[0] for r in runs):.2f}-{max(r[0] for r in runs):.2f}"
        print(f"{name:>14}: process CPU {total:.2f} s (range {spread}), imports {imports:.2f} CPU s, "
              f"{total / now_total:.2f}x now; loaded: {runs[-1][2] or 'none of the heavy ones'}")


if __name__ == "__main__":
    main()
