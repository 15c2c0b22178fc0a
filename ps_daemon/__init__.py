"""The parameter-server daemon: a pure state machine (`machine.step`) driven by one I/O runner."""
