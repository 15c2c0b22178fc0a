"""The audit trail: append-only, hash-chained JSON lines of who changed what (docs/audit.md).

`record` defines one record (schema, canonical bytes, hashes), `writer` appends records to a log, `verify`
checks a log that may have been tampered with, `signing` is the optional Ed25519 signature on each record.
"""
