"""The core imports without the store, Alembic or the command-line library."""

from __future__ import annotations

import json
import subprocess
import sys


def test_import_fsm_loads_no_store_or_cli_modules() -> None:
    code = (
        "import sys, json, fsm\n"
        "p = fsm.StreamParser(); p.receive_data(b'data: [DONE]\\n\\n'); p.receive_eof()\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('sqlalchemy', 'alembic', 'click', 'psycopg') or m.startswith(('fsm.cli', 'fsm.store'))]\n"
        "print(json.dumps(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_public_api_is_explicit() -> None:
    import fsm

    assert "StreamParser" in fsm.__all__
    for name in fsm.__all__:
        assert hasattr(fsm, name), name
