"""The command line: fsm parse, fsm replay, fsm demo, and the mistake catalog (the store's
commands are tested in tests/store/)."""
