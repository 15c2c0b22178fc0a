"""Broker CPU and wall time of the same 4-site, 10-round FedAvg run (e2e harness, every role its own process),
alternating without and with a live dashboard and one SSE reader. Run from the repository root:
`.venv/bin/python bench/dashboard_load.py`."""
import os, subprocess, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, "tests/e2e")
from harness import CliFederation

def cpu_s(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

def mosq_pid(conf):
    for e in Path("/proc").iterdir():
        if e.name.isdigit():
            try: a = (e / "cmdline").read_bytes().split(b"\0")
            except OSError: continue
            if a and a[0].endswith(b"mosquitto") and str(conf).encode() in a: return int(e.name)

for dash in (False, True, False, True):
    with tempfile.TemporaryDirectory() as tmp:
        fed = CliFederation(Path(tmp), run_id="load", rounds=10)
        fed.start_broker(); pid = mosq_pid(fed.layout.conf_path)
        d = None
        if dash:
            d = subprocess.Popen([sys.executable, "-m", "fedmqtt", "dashboard", "--federation", str(fed.layout.fed_dir),
                                  "--port", "8797"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(3)
            chrome = subprocess.Popen(["curl", "-sN", "http://127.0.0.1:8797/events"], stdout=subprocess.DEVNULL)
        t0 = time.time(); b0 = cpu_s(pid)
        fed.start_ps()
        for s in fed.sites: fed.start_site(s)
        fed.wait_ps_done(300)
        b1 = cpu_s(pid)
        print(f"dashboard={dash}: run {time.time()-t0:.1f} s, broker CPU {b1-b0:.2f} s", flush=True)
        if d: chrome.kill(); d.terminate(); d.wait(10)
        fed.stop_all()
