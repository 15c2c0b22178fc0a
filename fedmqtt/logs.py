"""One logging format for every role, so the broker, PS and site logs read alike."""

from __future__ import annotations

import logging


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        # Milliseconds: a round's steps (model out, updates in, turns) take tens of ms; merged PS and site logs
        # then sort into the order in which they happened.
        format="%(asctime)s.%(msecs)03d %(levelname)-7s %(name)s: %(message)s",
        datefmt="%Y-%m-%dT%H:%M:%S",
    )
