"""The site agent a hospital deploys: holds the data, trains locally, publishes only model updates."""
