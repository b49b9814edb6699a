"""``python -m fsm``: the command line."""

from fsm.cli.main import main

main()
