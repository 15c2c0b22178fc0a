"""Several site agents in one process, each with its own MQTT connection and credentials.

For scale tests and benchmarks on small machines (100+ sites on 2 cores): the agents are polled
in turn by one thread; each one is exactly the agent a hospital runs.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from fedmqtt.logs import setup_logging
from site_agent.agent import SiteAgent
from site_agent.config import load_site_config


def run_agents(config_paths: list[Path], *, exit_when_done: bool = True) -> None:
    agents = [SiteAgent(load_site_config(p)) for p in config_paths]
    stop = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True
        for agent in agents:
            agent.channel.interrupt()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, request_stop)
    for agent in agents:
        agent.start()
    try:
        while not stop and not (exit_when_done and all(a.ps_done for a in agents)):
            busy = False
            for agent in agents:
                before = agent.channel.stats.received
                agent.poll(0)
                busy = busy or agent.channel.stats.received != before
            if not busy:
                time.sleep(0.01)
    finally:
        for agent in agents:
            agent.close()


if __name__ == "__main__":  # python -m site_agent.multi CONFIG...
    from fedmqtt.transport.heap import tune_heap

    tune_heap()  # as every `fedmqtt` command does
    setup_logging()
    run_agents([Path(p) for p in sys.argv[1:]])
