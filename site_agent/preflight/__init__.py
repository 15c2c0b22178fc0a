"""`fedmqtt site check`: the pre-flight a hospital runs before its agent joins a federation (docs/site-check.md).

Each check is a small function that returns a Finding (PASS, WARN, FAIL or SKIP, what was found, the fix);
`runner.run_checks` runs them in order, skipping those whose premise failed; `render` prints the checklist.
The checks reuse the agent's own code (config and credentials loading, data loading, device choice, the
broker's TLS and login handling), so a check cannot pass where the agent would fail, or the reverse.
"""
