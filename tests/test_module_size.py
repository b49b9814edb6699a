"""Modules of one concern (issue 28 step 7): no module in ``fsm/`` is over :data:`MAX_LINES`
lines but the schema, which is one concern however long (``fsm/store/models.py``). A module that
grows past the limit is split along its concerns (see ``docs/reference/layout.md``), not
exempted."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fsm"

#: the most lines a module of fsm may have
MAX_LINES = 800
#: one concern however long: the schema (tables, keys, checks)
EXEMPT = frozenset({"fsm/store/models.py"})


def sizes() -> dict[str, int]:
    """Every module of fsm (its path from the repository's root) and its number of lines."""
    return {
        path.relative_to(ROOT).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def over_the_limit(found: dict[str, int]) -> dict[str, int]:
    return {
        name: lines for name, lines in found.items() if lines > MAX_LINES and name not in EXEMPT
    }


def test_no_module_is_over_the_limit() -> None:
    over = over_the_limit(sizes())
    assert not over, (
        f"modules over {MAX_LINES} lines (split each along its concerns): "
        + ", ".join(f"{name} ({lines})" for name, lines in sorted(over.items()))
    )


def test_the_limit_finds_a_long_module_and_spares_the_schema() -> None:
    found = {"fsm/a.py": MAX_LINES, "fsm/b.py": MAX_LINES + 1, "fsm/store/models.py": 5000}
    assert over_the_limit(found) == {"fsm/b.py": MAX_LINES + 1}


def test_the_exempt_schema_exists_and_every_module_is_counted() -> None:
    found = sizes()
    assert found.keys() >= EXEMPT, "an exempt module is gone: update EXEMPT"
    assert "fsm/__init__.py" in found and "fsm/store/ledger/bodies.py" in found
