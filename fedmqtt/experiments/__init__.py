"""Experiment workflow: `fedmqtt grid` runs simulations over a grid, `fedmqtt report` tabulates them."""

# No imports here: mounting `fedmqtt.cli.grid` must not slow down `fedmqtt --help`.
