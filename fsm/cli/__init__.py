"""The ``fsm`` command line: a thin layer over the Python API (``fsm.cli.main:main``)."""
