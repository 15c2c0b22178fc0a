"""`python -m fedmqtt.docgen [--check]`: write the generated docs, or list the stale ones and exit 1."""

from __future__ import annotations

import sys

from fedmqtt.docgen import REPO, rendered, stale

if "--check" in sys.argv[1:]:
    old = stale()
    for rel in old:
        print(f"stale: {rel} (run: python -m fedmqtt.docgen)")
    sys.exit(1 if old else 0)
for rel, text in rendered().items():
    path = REPO / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")
        print(f"wrote {rel}")
