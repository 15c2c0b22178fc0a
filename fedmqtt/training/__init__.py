"""Local training with torch (the only torch-importing package here; needs the `fedmqtt[site]` extra)."""
