#!/usr/bin/env bash
# Build fsm's manual with warnings as errors: a renamed function, a broken docstring, a page
# left out of the table of contents or a missing example file fails the build.
# Needs the docs extra: pip install -e '.[docs]'
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
exec "$python" -m sphinx -W --keep-going -n -q -b html docs docs/_build/html "$@"
