"""Secure aggregation (SecAgg+: Bell et al. 2020, on Bonawitz et al. 2017): the PS learns only the sum of the
sites' updates, even when sites drop out during the round. docs/secure-aggregation.md describes the protocol.

One module a job: `ring` (fixed-point encoding), `stream` (ChaCha20 expansion), `kdf` (HKDF keys), `context`
(what everything is bound to), `adverts` (signed key advertisements), `graph` (the sparse neighbourhood graph and
its parameters), `shamir` (secret sharing), `sealing` (AEAD for shares), `masks`, `messages` (the records the
parties exchange), `site` and `server` (each party's pure state object).
"""
