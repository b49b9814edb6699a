"""The agent loop: its tools, formats, telemetry, and the ledger through the loop (crashes, live
owners, commit failures)."""
