"""One error tree for the whole project, so callers can catch `FedMqttError`."""

from __future__ import annotations


class FedMqttError(Exception):
    """Base of every error fedmqtt raises on purpose."""


class ConfigError(FedMqttError):
    """A configuration file or option is invalid; the message names the field."""


class SchemaError(FedMqttError):
    """A payload could not be decoded or failed validation; the message says why."""


class TopicError(FedMqttError):
    """A topic or an id is malformed."""


class BrokerError(FedMqttError):
    """Mosquitto could not be set up, started or reached."""


class DataError(FedMqttError):
    """A site's data file is missing or malformed; the message names file and column."""


class CheckpointError(FedMqttError):
    """No usable checkpoint, or one written by a different configuration."""


class PermanentBrokerError(BrokerError):
    """The broker refused something in a way that retrying cannot fix (bad credentials, ACL, TLS, size limits);
    the message names the cause and the fix. Transient refusals are retried instead and never raise this."""
