"""fedmqtt: federated learning for hospital networks over MQTT."""

__version__ = "0.1.0"
