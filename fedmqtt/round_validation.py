"""`evaluation = "all"` in `fedmqtt simulate`: every site validates every round's global model.

Training selection (all, a fraction, the recruited) says who trains; this says who validates the model that the
best-round rule (docs/algorithms.md 17.1) scores. With `"selected"` a round is scored on its selected sites'
validation only, so under sampling each round is judged on other sites' data and the choice of round is noisy;
with `"all"` every configured site, selected or not, recruited or not, validates every round's model (as Flower's
`fraction_evaluate = 1`), so rounds are compared on the same validation data. The simulation holds every site
in its process, so it asks each site agent directly and hands the PS the scores as one `RoundValidated` event
before any update of the round can close it; no message carries this yet, so a deployed PS refuses the option.
"""

from __future__ import annotations

from collections.abc import Sequence

from fedmqtt.errors import ConfigError
from ps_daemon.events import RoundValidated
from ps_daemon.runner import DaemonRunner
from site_agent.agent import SiteAgent


class EverySiteValidation:
    """Feeds the PS each training round's `RoundValidated`, once per round and model."""

    def __init__(self, runner: DaemonRunner, agents: Sequence[SiteAgent]) -> None:
        self.runner = runner
        self.agents = sorted(agents, key=lambda a: a.config.site_id)
        self._done: tuple[int, str] | None = None

    def poll(self, now: float) -> bool:
        """Validate the open round's model on every site if that has not been done; True if it was done now."""
        state = self.runner.state
        key = (state.round, state.model_hash)
        if state.phase != "training" or state.validated is not None or key == self._done:
            return False
        machine = self.runner.machine
        local = sorted(set(state.weights) - set(machine.shared_names(state)))
        if local or state.personal:
            raise ConfigError(
                "evaluation = \"all\" needs a model every site holds whole (the PS's global model); "
                f"{self.runner.config.algorithm} keeps tensors on the sites ({', '.join(local[:3]) or 'personal ones'}"
                "), so a site that did not train would validate another model than its own. Set evaluation = "
                "\"selected\"")
        weights = {**state.weights, **state.extras.get("eval", {})}  # what the best round keeps (FedDyn: theta_avg)
        best = state.best.round if state.best is not None else None
        spec = self.runner.config.model
        per_site = {a.config.site_id: a.validate_round(spec, weights, state.round, best) for a in self.agents}
        self._done = key
        self.runner.apply(RoundValidated(now, state.round, state.model_hash, per_site))
        return True
