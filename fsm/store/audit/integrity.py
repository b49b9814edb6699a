""":func:`check` re-verifies the whole history contract of ``spec/store.md`` and every
rule the database enforces (keys, foreign keys, checks, column types) with set-based SQL over
batches of conversations, streaming :class:`Violation` rows (see :data:`VIOLATION_KINDS`): a
database edited with its enforcement switched off is reported, never called clean.

This module runs the check; the families of checks are modules of their own:
:mod:`~fsm.store.audit.violations` (what is reported), :mod:`~fsm.store.audit.contract_sql` (the
history contract as set-based SQL), :mod:`~fsm.store.audit.row_rules` (the database's rules
re-checked row by row) and :mod:`~fsm.store.audit.findings` (each flagged message's and call's
detail).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, TypeAlias

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from fsm.store.audit import row_rules
from fsm.store.audit.contract_sql import (
    CHECK_CALLS,
    CHECK_MESSAGES,
    CHECK_SEQ,
    CHECK_SEQ_DETAIL,
    COUNT_CHECKS,
    ORPHAN_ATTEMPT_CALLS,
    ORPHAN_ATTEMPTS,
    engine_sql,
    ranged_sql,
)
from fsm.store.audit.findings import call_violations, message_violations
from fsm.store.audit.read import (
    Bind,
    as_text,
    connect,
)
from fsm.store.audit.row_rules import (
    CHECKED_TABLES,
    TABLE_BY_NAME,
    Shape,
    duplicate_violations,
    duplicates_sql,
    read_shape,
    row_check_sql,
    row_violations,
    shown,
)
from fsm.store.audit.violations import VIOLATION_KINDS as VIOLATION_KINDS
from fsm.store.audit.violations import Violation as Violation
from fsm.store.errors import (
    DatabaseCorruptError,
    DatabaseFileError,
    InvalidFilterError,
    StoreError,
)
from fsm.store.migrate import head_revision, revision_of

#: ``progress(done, total)``, in conversations.
Progress: TypeAlias = Callable[[int, int], None]
#: ``note(text)``: what the check could not do (amcheck missing, say), for the user.
Note: TypeAlias = Callable[[str], None]

# the row rules' tables, as tests read them here
_STRUCTURAL_CHECKS: Final = row_rules.STRUCTURAL_CHECKS
_CHECK_KINDS: Final = row_rules.CHECK_KINDS
_model_rules = row_rules.model_rules
_sqlite_type_terms = row_rules.sqlite_type_terms


# -- running the check ---------------------------------------------------------------------------
def check(
    bind: Bind,
    *,
    progress: Progress | None = None,
    batch_size: int = 10_000,
    workers: int | None = None,
    deep: bool = False,
    note: Note | None = None,
) -> Iterator[Violation]:
    """Re-verify the history contract over the whole store; yield every violation found.

    First the engine's own integrity (:func:`engine_check`: SQLite ``PRAGMA quick_check``, with
    ``deep`` ``integrity_check``; PostgreSQL ``amcheck`` over fsm's indexes when the extension
    is installed, else ``note`` is told so): damage there yields ``corrupt`` violations and
    stops the check, since rows read from a damaged file cannot be trusted.

    The rules of ``spec/store.md`` ("The contract" 1-5), and every rule the database enforces:
    seq dense from 0, every assistant message with N calls followed by exactly its N results
    each in its slot, each result's ``tool_call_id`` equal to its call's id, only finished calls
    (with a name, and arguments blank or valid JSON), nothing between an assistant message and
    its results, content where the OpenAI format needs it, the enforcement columns consistent,
    every foreign key, unique key and check of the schema, and the types of every column (on
    SQLite, whose type affinity lets ``'5x'``, ``0.5`` or ``1e300`` into an INTEGER column when
    its types check is ignored). Each kind is in :data:`VIOLATION_KINDS`.

    A store written through fsm has none: they come only from writes made with the database's
    enforcement switched off, which are *not* checked when they happen: SQLite ``PRAGMA
    foreign_keys=OFF`` (every foreign key) or ``PRAGMA ignore_check_constraints=ON`` (every check,
    types included), PostgreSQL ``SET session_replication_role = replica`` or ``ALTER TABLE ...
    DISABLE TRIGGER ALL`` (foreign keys), constraints dropped or added back ``NOT VALID``, a
    broken migration. Any value such a session stored is read without an error: the check
    reports it, never crashes on it and never calls such a store clean.

    The work is set-based: per batch of ``batch_size`` conversations (a range of ids), a scan of
    each table for its row checks, a grouped scan of the seq numbers, one scan of the messages
    and one of the calls, joined to each other through indexes (no query per conversation). On
    PostgreSQL a check the database holds (present and validated) is not read again: no session
    can bypass it. Each batch runs in one read transaction, so it sees one snapshot; every rule
    is about one conversation, and a conversation is checked whole within one batch, so writers
    committing meanwhile cannot cause false violations.

    Given an engine, ``workers`` batches run at once on their own connections (default 2: the
    database does the work, in parallel); given a connection, the batches run one after the
    other on it, inside the caller's transaction. Violations come in batch order, sorted by
    conversation and seq within a batch; ``progress(done, total)`` is called after each batch,
    in conversations.
    """
    if batch_size < 1:
        raise InvalidFilterError("batch_size must be at least 1")
    if workers is not None and workers < 1:
        raise InvalidFilterError("workers must be at least 1")
    damaged = engine_check(bind, deep=deep, note=note)
    if damaged:
        yield from damaged
        return
    with connect(bind, snapshot=True) as conn:
        total = int(conn.execute(sa.text("SELECT count(*) FROM fsm_conversations")).scalar_one())
        # batches are ranges of text ids (an id of another type, which only raw SQL on SQLite
        # can store, sorts after every text: it falls in the last batch)
        text_ids = "typeof(id) = 'text'" if conn.dialect.name == "sqlite" else "1 = 1"
        bounds = [
            str(b)
            for b in conn.execute(
                sa.text(
                    "SELECT id FROM (SELECT id, row_number() OVER (ORDER BY id) AS n "
                    f"FROM fsm_conversations WHERE {text_ids}) x "
                    "WHERE n > 1 AND (n - 1) % :size = 0 ORDER BY id"
                ),
                {"size": batch_size},
            ).scalars()
        ]
        shape = read_shape(conn)
        edges: list[str | None] = [None, *bounds, None]
        ranges = list(itertools.pairwise(edges))
        if progress is not None:
            progress(0, total)
        tables = [t for t in CHECKED_TABLES if shape.rules[t]]
        if isinstance(bind, Connection) or (workers or 2) == 1 or len(ranges) + len(tables) == 1:
            batches: Iterator[list[Violation]] = (
                _check_batch(conn, lo, hi, shape, own=False) for lo, hi in ranges
            )
            yield from _with_progress(batches, progress, batch_size, total)
            for table in tables:
                yield from _row_checks(conn, shape, table)
        else:
            engine = bind

            def run(bounds: tuple[str | None, str | None]) -> list[Violation]:
                with connect(engine, snapshot=True) as worker:
                    return _check_batch(worker, *bounds, shape, own=True)

            def rows(table: str) -> list[Violation]:
                with connect(engine) as worker:
                    return _row_checks(worker, shape, table)

            with ThreadPoolExecutor(workers or 2, thread_name_prefix="fsm-check") as pool:
                try:
                    # the whole-table row checks first: the biggest one runs beside the batches
                    row_results = [pool.submit(rows, table) for table in tables]
                    yield from _with_progress(pool.map(run, ranges), progress, batch_size, total)
                    for result in row_results:
                        yield from result.result()
                finally:
                    pool.shutdown(cancel_futures=True)
        yield from _check_global(conn, shape)


#: SQLite result codes of a damaged file: SQLITE_CORRUPT, SQLITE_NOTADB
_SQLITE_DAMAGED: Final = (11, 26)
#: PostgreSQL SQLSTATEs of damaged storage: data_corrupted, index_corrupted
_POSTGRES_DAMAGED: Final = ("XX001", "XX002")
#: at most this many problems are listed by SQLite's checks
_SQLITE_MAX_ERRORS: Final = 100


def engine_check(bind: Bind, *, deep: bool = False, note: Note | None = None) -> list[Violation]:
    """The database engine's own integrity check; a ``corrupt`` violation per problem found.

    SQLite: ``PRAGMA quick_check`` (b-trees, pages, record formats, ``NOT NULL``; linear in the
    file), or with ``deep`` ``PRAGMA integrity_check`` (also that every index matches its
    table), at most 100 problems; a file SQLite cannot read at all (not a database, a damaged
    header or schema) is one violation. PostgreSQL: ``bt_index_check`` of the ``amcheck``
    extension on every b-tree index of fsm's tables (with ``deep``, ``heapallindexed``: every
    row is found in each index), when the extension is installed and may be run; otherwise
    ``note`` is told why it was skipped (the audit is read-only: it never creates the
    extension) and nothing is reported. Other engines: nothing.
    """
    found: list[Violation] = []
    try:
        with connect(bind) as conn:
            if conn.dialect.name == "sqlite":
                pragma = "integrity_check" if deep else "quick_check"
                lines = conn.exec_driver_sql(f"PRAGMA {pragma}({_SQLITE_MAX_ERRORS})").scalars()
                # one row may hold several lines ("*** in database main ***\nPage 3: ...")
                found = [
                    Violation(None, None, "corrupt", f"SQLite {pragma}: {line}")
                    for row in lines
                    if str(row) != "ok"
                    for line in str(row).splitlines()
                    if line.strip()
                    and not line.startswith("*** in database")
                    # a row that breaks a check (a connection that checks them runs them in
                    # quick_check): a contract violation the row checks report by its kind,
                    # not damage to the file
                    and not line.startswith("CHECK constraint failed")
                ]
            elif conn.dialect.name == "postgresql":
                found = _amcheck(conn, deep, note)
    except (sa.exc.DBAPIError, DatabaseCorruptError, DatabaseFileError) as exc:
        if _damage_code(exc) is None:
            raise
        found = [Violation(None, None, "corrupt", f"the database cannot be read: {_reason(exc)}")]
    return found


def _driver(exc: BaseException) -> BaseException:
    """The driver's exception behind ``exc`` (a SQLAlchemy error's ``orig``, or the cause of a
    typed store error), or ``exc`` itself."""
    error: BaseException | None = exc
    for _ in range(6):
        if error is None:
            break
        if getattr(error, "sqlite_errorcode", None) is not None or getattr(error, "sqlstate", None):
            return error
        error = getattr(error, "orig", None) or error.__cause__
    return exc


def _reason(exc: BaseException) -> str:
    """The driver's message of ``exc``, on one line."""
    return " ".join(str(_driver(exc)).split())


def _damage_code(exc: BaseException) -> int | str | None:
    """The engine's code of a damaged-storage error, or ``None`` for any other error."""
    driver = _driver(exc)
    code = getattr(driver, "sqlite_errorcode", None)
    if isinstance(code, int) and code & 0xFF in _SQLITE_DAMAGED:
        return code
    sqlstate = getattr(driver, "sqlstate", None)
    return sqlstate if sqlstate in _POSTGRES_DAMAGED else None


def _amcheck(conn: Connection, deep: bool, note: Note | None) -> list[Violation]:
    """``bt_index_check`` on each b-tree index of fsm's tables (see :func:`engine_check`)."""
    installed = conn.execute(
        sa.text(
            "SELECT n.nspname FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace "
            "WHERE e.extname = 'amcheck'"
        )
    ).scalar()
    if installed is None:
        if note is not None:
            note(
                "PostgreSQL's index check was skipped: the amcheck extension is not installed "
                "in this database (a superuser can run: CREATE EXTENSION amcheck)"
            )
        return []
    indexes = conn.execute(
        sa.text(
            "SELECT c.oid::regclass::text FROM pg_index i "
            "JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_am am ON am.oid = c.relam "
            "WHERE i.indrelid = ANY(CAST(:tables AS regclass[])) AND am.amname = 'btree' "
            "ORDER BY 1"
        ),
        {"tables": list(CHECKED_TABLES)},
    ).scalars()
    function = f"{_quote_ident(str(installed))}.bt_index_check"
    found: list[Violation] = []
    for index in list(indexes):
        try:
            with conn.begin_nested():
                conn.execute(
                    sa.text(f"SELECT {function}(CAST(:index AS regclass), :deep)"),
                    {"index": index, "deep": deep},
                )
        except (sa.exc.DBAPIError, StoreError) as exc:
            if _damage_code(exc) is not None:
                found.append(
                    Violation(None, None, "corrupt", f"amcheck of {index}: {_reason(exc)}")
                )
                continue
            if getattr(_driver(exc), "sqlstate", None) == "42501":  # insufficient_privilege
                if note is not None:
                    note(
                        "PostgreSQL's index check was skipped: this role may not run amcheck "
                        "(GRANT EXECUTE ON FUNCTION bt_index_check(regclass, boolean) to it)"
                    )
                return found
            raise
    return found


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _row_checks(conn: Connection, shape: Shape, table: str) -> list[Violation]:
    """The row checks of ``table``, over the whole table (each is about one row), sorted.

    (Not ``PRAGMA quick_check``, although it evaluates the checks faster: it skips them, and
    says "ok", on a connection that ignores checks and on a read-only one, as audits are.)
    """
    rules = shape.rules[table]
    if not rules:
        return []
    sql = row_check_sql(table, rules, shape, ranged=False)
    rows = conn.execute(sa.text(sql)).all()
    found = [v for row in rows for v in row_violations(table, rules, row)]
    found.sort(key=lambda v: (v.conversation_id or "", -1 if v.seq is None else v.seq))
    return found


def _check_global(conn: Connection, shape: Shape) -> Iterator[Violation]:
    """The checks that are not ranged by conversation: the calls of attempts (they have no
    conversation id of their own), keys that span conversations, and the schema's enforcement
    itself."""
    found: list[Violation] = list(_unenforced(conn))
    for attempt_id, n in conn.execute(sa.text(ORPHAN_ATTEMPT_CALLS)):
        found.append(
            Violation(
                None,
                None,
                "orphan_row",
                f"{n} fsm_attempt_calls row(s) of attempt {shown(attempt_id)}, which does not exist",
            )
        )
    for table, columns, condition in shape.lost_keys:
        if table in ("fsm_attempts", "fsm_attempt_calls"):
            sql = duplicates_sql(table, columns, condition, ranged=False)
            for row in conn.execute(sa.text(sql)):
                found.append(duplicate_violations(table, columns, row))
    yield from found


_CONSTRAINT_KINDS: Final = (
    (sa.PrimaryKeyConstraint, "primary key"),
    (sa.ForeignKeyConstraint, "foreign key"),
    (sa.UniqueConstraint, "unique key"),
    (sa.CheckConstraint, "check"),
)


def _unenforced(conn: Connection) -> Iterator[Violation]:
    """What the database no longer enforces of the models' schema: a key, foreign key, check or
    unique index missing (dropped, or a table rebuilt without it), NOT VALID, or with its
    triggers disabled (PostgreSQL). Only at head: an older revision lacks newer rules by design
    (``fsm db upgrade`` adds them)."""
    if revision_of(conn) != head_revision():
        return
    dialect = conn.dialect.name
    expected: dict[str, tuple[str, str]] = {}
    for table in CHECKED_TABLES:
        for constraint in TABLE_BY_NAME[table].constraints:
            only = getattr(getattr(constraint, "_ddl_if", None), "dialect", None)
            if not isinstance(constraint.name, str) or (only is not None and only != dialect):
                continue
            what = next(w for cls, w in _CONSTRAINT_KINDS if isinstance(constraint, cls))
            expected[str(constraint.name)] = (table, what)
        for index in TABLE_BY_NAME[table].indexes:
            if index.unique and isinstance(index.name, str):
                expected[str(index.name)] = (table, "unique index")
    present: dict[str, bool] = {}  # name -> validated
    disabled: list[tuple[str, int]] = []
    if dialect == "postgresql":
        tables = {"tables": list(CHECKED_TABLES)}
        present = dict(
            conn.execute(
                sa.text(
                    "SELECT conname, convalidated FROM pg_constraint "
                    "WHERE conrelid = ANY(CAST(:tables AS regclass[])) "
                    "UNION ALL SELECT c.relname, i.indisvalid FROM pg_index i "
                    "JOIN pg_class c ON c.oid = i.indexrelid "
                    "WHERE i.indrelid = ANY(CAST(:tables AS regclass[])) AND i.indisunique"
                ),
                tables,
            ).all()
        )
        disabled = [
            (str(t), int(n))
            for t, n in conn.execute(
                sa.text(
                    "SELECT tgrelid::regclass::text, count(*) FROM pg_trigger "
                    "WHERE tgrelid = ANY(CAST(:tables AS regclass[])) AND tgenabled = 'D' "
                    "GROUP BY 1 ORDER BY 1"
                ),
                tables,
            )
        ]
    else:
        for kind, name, sql in conn.exec_driver_sql(
            "SELECT type, name, sql FROM sqlite_master WHERE type IN ('table', 'index')"
        ):
            present[str(name)] = True
            if kind == "table":
                for found in re.findall(r'CONSTRAINT\s+"?(\w+)"?', str(sql or "")):
                    present[found] = True
    for name, (table, what) in expected.items():
        if name not in present:
            yield Violation(
                None,
                None,
                "unenforced",
                f"the {what} {name} of {table} is missing: the database does not refuse what "
                "it rules out",
            )
        elif not present[name]:
            yield Violation(
                None,
                None,
                "unenforced",
                f"the {what} {name} of {table} is NOT VALID: rows written before it was added "
                "back were never checked against it (VALIDATE CONSTRAINT once they are fixed)",
            )
    for table, n in disabled:
        yield Violation(
            None,
            None,
            "unenforced",
            f"{n} trigger(s) of {table} are disabled (its foreign keys are not checked): "
            f"ALTER TABLE {table} ENABLE TRIGGER ALL",
        )


def _with_progress(
    batches: Iterator[list[Violation]], progress: Progress | None, size: int, total: int
) -> Iterator[Violation]:
    for i, found in enumerate(batches):
        yield from found
        if progress is not None:
            progress(min(total, (i + 1) * size), total)


def _check_batch(
    conn: Connection, lo: str | None, hi: str | None, shape: Shape, *, own: bool
) -> list[Violation]:
    """The violations of the conversations in [lo, hi), sorted by conversation and seq."""
    if own and conn.dialect.name == "postgresql":
        conn.execute(sa.text("SET LOCAL work_mem = '64MB'"))
    found = list(_check_range(conn, lo, hi, shape))
    found.sort(key=lambda v: (v.conversation_id or "", -1 if v.seq is None else v.seq))
    return found


def _check_range(
    conn: Connection, lo: str | None, hi: str | None, shape: Shape
) -> Iterator[Violation]:
    params = {k: v for k, v in (("lo", lo), ("hi", hi)) if v is not None}
    # two rows with one seq need the primary key gone: count distinct values only then
    distinct = "count(*)" if shape.unique_seq else "count(DISTINCT seq)"
    dialect = shape.dialect
    join, count_check = COUNT_CHECKS.get(dialect, COUNT_CHECKS["postgresql"])

    def run(sql: str) -> Iterable[Any]:
        sql = sql.replace("COUNT_JOIN", join).replace("COUNT_CHECK(m)", f"({count_check})")
        sql = engine_sql(sql.replace("{distinct}", distinct), dialect)
        return conn.execute(sa.text(ranged_sql(sql, lo, hi)), params)

    unordered: list[str] = []
    for cid, n, n_distinct, first, last, orphan in run(CHECK_SEQ):
        if orphan:
            yield Violation(
                as_text(cid),
                None,
                "orphan_row",
                f"{n} message(s) of conversation {as_text(cid)!r}, which does not exist",
            )
        if n != last + 1 or first != 0 or n_distinct != n:
            unordered.append(cid)
    for start in range(0, len(unordered), 500):
        ids = unordered[start : start + 500]
        detail = sa.text(engine_sql(CHECK_SEQ_DETAIL, dialect)).bindparams(
            sa.bindparam("ids", expanding=True)
        )
        for cid, seq, p_seq in conn.execute(detail, {"ids": ids}):
            cid = as_text(cid)
            if p_seq is None:
                yield Violation(cid, seq, "seq_start", f"the first message has seq {seq}, not 0")
            elif seq == p_seq:
                yield Violation(cid, seq, "seq_duplicate", f"two messages have seq {seq}")
            else:
                missing = f"{p_seq + 1}" if seq == p_seq + 2 else f"{p_seq + 1}..{seq - 1}"
                yield Violation(
                    cid,
                    seq,
                    "seq_gap",
                    f"seq {missing} missing (the message before is at seq {p_seq})",
                )
    for row in run(CHECK_MESSAGES):
        yield from message_violations(row)
    for row in run(CHECK_CALLS):
        yield from call_violations(row)
    for cid, n in run(ORPHAN_ATTEMPTS):
        yield Violation(
            as_text(cid),
            None,
            "orphan_row",
            f"{n} attempt(s) of conversation {as_text(cid)!r}, which does not exist",
        )
    for table, columns, condition in shape.lost_keys:
        if table not in ("fsm_attempts", "fsm_attempt_calls"):
            for row in run(duplicates_sql(table, columns, condition, ranged=True)):
                yield duplicate_violations(table, columns, row)
