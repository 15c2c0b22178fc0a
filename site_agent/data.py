"""Load this site's own data: the format's adapter, its part of a partition (simulations), local splits."""

from __future__ import annotations

from fedmqtt.data.registry import load_site_data

__all__ = ["load_site_data"]
