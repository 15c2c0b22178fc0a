"""Several site agents in one process, each with its own MQTT connection and credentials.

For scale tests and benchmarks on small machines (100+ sites on 2 cores): the agents are polled
in turn by one thread; each one is exactly the agent a hospital runs.

One thread cannot answer while it trains, so each pass first lets every agent handle what has arrived
(model chunks, tasks, upload turns), then lets one agent train or evaluate. An agent's upload turn is
thus answered right after the next agent's local work, not after every other agent's: its upload
overlaps their training, as it would with one agent per machine.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from fedmqtt.logs import setup_logging
from site_agent.agent import SiteAgent
from site_agent.config import load_site_config

MESSAGES_PER_PASS = 64  # e.g. every chunk of a 128 MB model (2 MB chunks by default)


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
        serve(agents, until=lambda: stop or (exit_when_done and all(a.ps_done for a in agents)))
    finally:
        for agent in agents:
            agent.close()


def serve(agents: Sequence[SiteAgent], *, until: Callable[[], bool]) -> None:
    """Poll started agents until `until()`: each pass, every agent handles what has arrived, then one
    agent (the next in turn after the last that worked) trains or evaluates, if any has a task ready."""
    next_worker = 0
    while not until():
        busy = False
        for agent in agents:
            busy = _handle_arrived(agent) or busy
        for k in range(len(agents)):
            if agents[(next_worker + k) % len(agents)].work():
                next_worker = (next_worker + k + 1) % len(agents)
                busy = True
                break
        if not busy:
            time.sleep(0.01)


def _handle_arrived(agent: SiteAgent) -> bool:
    """Let `agent` handle the messages that have arrived, at most MESSAGES_PER_PASS (the others' turn comes
    after); True if there were any."""
    handled = 0
    while handled < MESSAGES_PER_PASS:
        before = agent.channel.stats.received
        agent.receive(0)
        if agent.channel.stats.received == before:  # nothing (left) to handle
            break
        handled += 1
    return handled > 0


if __name__ == "__main__":  # python -m site_agent.multi CONFIG...
    from fedmqtt.transport.heap import tune_heap

    tune_heap()  # as every `fedmqtt` command does
    setup_logging()
    run_agents([Path(p) for p in sys.argv[1:]])
