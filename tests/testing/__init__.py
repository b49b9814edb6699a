"""fsm.testing: the replay server, and the pytest plugin as a user gets it."""
