"""`fedmqtt pretrain`: train a model centrally on a data set and write it for a run's `init_model`."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer()


@app.command("pretrain")
def pretrain(
    config: Path = typer.Argument(..., help="Simulation TOML naming the model, the training settings and the sites "
                                  "whose training rows are pooled (e.g. BloodMNIST)."),
    out: Path = typer.Option(..., "--out", help="The safetensors file to write."),
    fraction: float = typer.Option(1.0, help="Share of every site's training rows to pool (stratified), in (0, 1]; "
                                   "1: all of them."),
    epochs: int = typer.Option(20, min=1, help="Epochs over the pooled rows."),
    seed: int | None = typer.Option(None, help="Seeds the initialisation, the draw of rows and training (default: "
                                    "the config's)."),
) -> None:
    """Train the config's model on the pooled training rows of its sites and write its tensors to --out.

    The file starts another run from this model: `\\[init_model] path = ...` in a PS or simulation config
    (tensors = "matching" where that run's head has another number of classes). Train it on data outside the
    federation it will start: pooling the federation's own rows is a simulation's shortcut, not a deployment's.
    """
    from fedmqtt.simulation import load_simulation_config, pretrain_pooled
    from fedmqtt.training.models import model_manifest
    from fedmqtt.training.weights import initial_arrays
    from ps_daemon.init_model_file import load_init_model

    if not 0 < fraction <= 1:
        raise typer.BadParameter(f"{fraction} is not in (0, 1]", param_hint="--fraction")
    cfg = load_simulation_config(config, seed=seed)
    written = pretrain_pooled(cfg, epochs=epochs, fraction=fraction, path=out)
    # The file as a run will read it: every tensor of the model, finite, with the manifest's dtypes and shapes.
    args = dict(cfg.model.args)
    _, record = load_init_model(written, initial_arrays(cfg.model.name, args, cfg.seed),
                                model_manifest(cfg.model.name, args), tensors="all")
    typer.echo(f"wrote {written}: {len(record.loaded)} tensors of {cfg.model.name}, sha256 {record.sha256}")
