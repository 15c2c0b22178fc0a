"""The coordinator's side of the federation's signing keys (fedmqtt/transport/signing.py verifies them).

`broker init` creates the coordinator key (the trust anchor) and one key per party. The coordinator's private key
and its broker login stay in <federation>/coordinator/, the coordinating team's own folder, which no party's
credentials include; each party's private key goes into that party's credentials file only. Every change of the
parties (add-site, remove-site, rotate) writes a new key list, one version up and signed by the coordinator key,
into coordinator/key-list.json and the credentials file it writes (nobody else's file changes), and publishes it
retained on `federation/keys`, where running parties take it at once and keep it (fedmqtt.transport.signing).
"""

from __future__ import annotations

import logging
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from broker import certs
from fedmqtt.errors import ConfigError, FedMqttError
from fedmqtt.transport.settings import BrokerSettings
from fedmqtt.transport.signing import (
    KeyRing,
    b64u,
    list_keys,
    load_private_pem,
    make_key_list,
    new_private_key,
    private_pem,
    public_raw,
    seal_key_list,
)
from fedmqtt.transport.topics import federation_keys_topic
from schemas.signed import KeyList

log = logging.getLogger(__name__)

COORDINATOR_DIR = "coordinator"
SIGNING_KEY_FILE = "signing-key.pem"  # the trust anchor: 0600, here and nowhere else
KEY_LIST_FILE = "key-list.json"  # the current signed key list (public)
LOGIN_FILE = "broker.toml"  # the coordinator's broker login: it may write federation/keys and nothing else
SIGNING_PARTIES = ("ps",)  # besides every site; the observer only reads, so it has no key


class Coordinator:
    """<federation>/coordinator/: the coordinator key and the key list it signed last."""

    def __init__(self, fed_dir: Path, run_id: str) -> None:
        self.dir = Path(fed_dir) / COORDINATOR_DIR
        self.run_id = run_id

    @property
    def login_path(self) -> Path:
        return self.dir / LOGIN_FILE

    @classmethod
    def create(cls, fed_dir: Path, run_id: str, parties: list[str]) -> tuple[Coordinator, dict[str, Ed25519PrivateKey]]:
        """A new coordinator key and a key for each of `parties`, and key list version 1; returns the parties'
        private keys, to be written into their own credentials files only."""
        coordinator = cls(fed_dir, run_id)
        coordinator.dir.mkdir(mode=0o700)
        key = new_private_key()
        certs.write_private(coordinator.dir / SIGNING_KEY_FILE, private_pem(key).encode("ascii"))
        private = {party: new_private_key() for party in parties}
        coordinator._write(key, make_key_list(run_id, {p: public_raw(k) for p, k in private.items()}, version=1))
        return coordinator, private

    def _signing_key(self) -> Ed25519PrivateKey:
        path = self.dir / SIGNING_KEY_FILE
        if not path.is_file():
            raise ConfigError(f"{path} not found: changing the federation's parties needs the coordinator's signing "
                              "key, which `broker init` wrote there (run this where that folder is)")
        return load_private_pem(path.read_text(encoding="ascii"), source=str(path))

    def public_key(self) -> bytes:
        return public_raw(self._signing_key())

    def sealed(self) -> bytes:
        """The current key list as signed (what parties get)."""
        return (self.dir / KEY_LIST_FILE).read_bytes()

    def key_list(self) -> KeyList:
        """The current key list, checked against the coordinator's own key."""
        ring = KeyRing(self.run_id, self.public_key(), self.sealed())
        return ring.current

    def change(self, *, set_keys: dict[str, bytes] | None = None, remove: tuple[str, ...] = ()) -> KeyList:
        """The next key list: `set_keys` added or replaced (party -> raw public key), `remove` gone."""
        current = self.key_list()
        keys = {p: raw for p, raw in list_keys(current).items() if p not in remove}
        keys.update(set_keys or {})
        new = make_key_list(self.run_id, keys, version=current.version + 1)
        self._write(self._signing_key(), new)
        log.info("key list version %d: %s", new.version, ", ".join(sorted(new.keys)))
        return new

    def _write(self, key: Ed25519PrivateKey, key_list: KeyList) -> None:
        path = self.dir / KEY_LIST_FILE
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(seal_key_list(key, key_list))
        tmp.replace(path)

    def signing_table(self, party: str, private_key: Ed25519PrivateKey | None) -> dict[str, object]:
        """The `[signing]` table of `party`'s credentials file (fedmqtt.transport.signing.SigningSettings)."""
        table: dict[str, object] = {"party": party}
        if private_key is not None:
            table["private_key"] = private_pem(private_key)
        table["coordinator_key"] = b64u(self.public_key())
        table["key_list"] = self.sealed().decode("utf-8")
        return table

    def publish(self) -> None:
        """Put the current key list on the running broker (retained), as the coordinator's own broker user."""
        from fedmqtt.config_io import load_toml
        from fedmqtt.transport.mqtt import MqttTransport

        settings = load_toml(self.login_path, BrokerSettings, section="broker")
        transport = MqttTransport(settings, client_id=f"fedmqtt-coordinator-{self.run_id}")
        try:
            transport.connect(timeout_s=10)
            transport.publish(federation_keys_topic(self.run_id), self.sealed(), retain=True, timeout_s=10)
        finally:
            transport.close()


def publish_key_list(fed_dir: Path, run_id: str) -> str:
    """Publish the current key list if this host holds the coordinator's folder; what happened, for the operator."""
    coordinator = Coordinator(fed_dir, run_id)
    if not coordinator.login_path.is_file():
        return (f"no {coordinator.dir} here: the key list reaches parties in their credentials files only "
                "(publish it where the coordinator's folder is: `fedmqtt broker keys --dir ... --publish`)")
    try:
        coordinator.publish()
    except (FedMqttError, OSError) as exc:
        return f"could not publish the key list ({exc}); running parties keep the one they have"
    version = coordinator.key_list().version
    return f"key list version {version} published on {federation_keys_topic(run_id)} (retained)"

