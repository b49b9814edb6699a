"""The version of fsm, in one place: the package (:data:`fsm.__version__`), ``fsm --version``
and the distribution's metadata (``pyproject.toml`` reads it from here) all take it from this
module."""

__version__ = "0.3.0"
