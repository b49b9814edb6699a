"""Real faults for the fault tests (no mocks): a private PostgreSQL cluster the test starts,
crashes and restarts itself, a TCP proxy that forwards, black-holes and resets connections on
command, a disk that fills, and bytes flipped in a copy of a SQLite database.

Everything here is a real process, socket or file:

* :class:`PrivatePostgres`: ``initdb`` in a temporary directory, run as the ``postgres`` user
  when the test runs as root (``initdb`` refuses root), ``pg_ctl start`` on a free port,
  :meth:`~PrivatePostgres.crash` sends SIGKILL to the postmaster and every backend (a machine
  or OOM-killer crash: no shutdown, no checkpoint), :meth:`~PrivatePostgres.start` restarts it
  (crash recovery from the WAL);
* :class:`Proxy`: a thread with sockets between the client and the server; ``blackhole()``
  stops forwarding without closing anything (a dead route: packets vanish, no RST), ``reset()``
  closes every connection with an RST, ``forward()`` restores service for new connections;
* :func:`small_disk`: a tmpfs of a few hundred KiB where mounting is allowed (else ``None``:
  the tests then use ``RLIMIT_FSIZE`` in a subprocess, with SIGXFSZ ignored so the write fails
  with EFBIG);
* :func:`flip_bytes`: XOR bytes of a file in place (on a copy of a database).

:func:`postgres_unavailable` says why a private cluster cannot run here (tests skip with that
reason, and only then).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "PrivatePostgres",
    "Proxy",
    "flip_bytes",
    "free_port",
    "pg_tool",
    "postgres_unavailable",
    "small_disk",
]


def free_port() -> int:
    """A TCP port of 127.0.0.1 nobody listens on (at the time of the call)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def pg_tool(tool: str) -> str | None:
    """The path of a PostgreSQL server program: on ``PATH``, else in Debian's
    ``/usr/lib/postgresql/<version>/bin`` (the newest), else ``None``."""
    found = shutil.which(tool)
    if found is not None:
        return found
    candidates = sorted(
        Path("/usr/lib/postgresql").glob(f"*/bin/{tool}"),
        key=lambda p: int(p.parts[-3]) if p.parts[-3].isdigit() else 0,
    )
    return str(candidates[-1]) if candidates else None


def postgres_unavailable() -> str | None:
    """Why a private PostgreSQL cluster cannot run on this machine, or ``None`` if it can."""
    for tool in ("initdb", "pg_ctl", "postgres"):
        if pg_tool(tool) is None:
            return (
                f"{tool} is neither on PATH nor in /usr/lib/postgresql/*/bin (install the "
                "PostgreSQL server binaries)"
            )
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no 'postgres' user to run initdb as"
        if shutil.which("runuser") is None:
            return "running as root and runuser is missing (initdb refuses root)"
    return None


@dataclass
class PrivatePostgres:
    """A PostgreSQL cluster of the test's own, in a temporary directory, on its own port.

    ``url`` is a SQLAlchemy URL of its ``postgres`` database (trust authentication, user
    ``postgres``). Use as a context manager: the cluster is stopped and removed at exit.
    """

    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="fsm-pg-")))
    port: int = field(default_factory=free_port)

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        command = [pg_tool(args[0]) or args[0], *args[1:]]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        return subprocess.run(command, check=check, capture_output=True, text=True, timeout=120)

    def __enter__(self) -> PrivatePostgres:
        self.init()
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def init(self) -> None:
        """``initdb`` the data directory (owned by the ``postgres`` user under root)."""
        self.root.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.root, user.pw_uid, user.pw_gid)
        self._run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
            "-E",
            "UTF8",
            "--locale=C",
        )
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(
                f"\nport = {self.port}\nlisten_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.root}'\n"
                "fsync = off\nshared_buffers = 16MB\nmax_connections = 40\n"
                "logging_collector = off\n"
            )

    def start(self) -> float:
        """Start (or restart after a crash) the server; the seconds it took to accept."""
        started = time.monotonic()
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.root / "server.log"),
            "-w",
            "-t",
            "60",
            "start",
        )
        return time.monotonic() - started

    def stop(self) -> None:
        """A clean shutdown (``pg_ctl stop -m fast``)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop", check=False)

    def postmaster_pid(self) -> int | None:
        """The running postmaster's pid, or ``None``."""
        try:
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if _alive(pid) else None

    def crash(self) -> int:
        """SIGKILL the postmaster and every process it started (no shutdown of any kind),
        wait until they are gone; returns how many processes were killed."""
        pid = self.postmaster_pid()
        if pid is None:
            return 0
        victims = [pid, *_children(pid)]
        for victim in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(_alive(v) for v in victims):
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {victims} survived SIGKILL")
            time.sleep(0.005)
        # the dead postmaster may linger as a zombie (a container's init does not always reap
        # it), which would make the next start think it still runs: its lock files go, as a
        # reboot would clear them
        for lock in (self.data / "postmaster.pid", self.root / f".s.PGSQL.{self.port}.lock"):
            lock.unlink(missing_ok=True)
        return len(victims)

    def log(self) -> str:
        """The server log so far (for assertion messages)."""
        try:
            return (self.root / "server.log").read_text(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        if self.postmaster_pid() is not None:
            self.stop()
        if self.postmaster_pid() is not None:
            self.crash()
        shutil.rmtree(self.root, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            found.append(int(entry.name))
    return found


# -- the proxy ---------------------------------------------------------------------------------
class Proxy:
    """A TCP proxy on 127.0.0.1 in front of ``(host, port)``, in one thread per direction.

    Modes: ``forward()`` (the default) relays bytes both ways; ``blackhole()`` stops relaying
    without closing anything, for the connections open and the ones that come (the client's
    kernel still gets ACKs from ours, as behind a stateful firewall that silently drops: no
    error ever reaches the client, and the server hears nothing more); ``forward()`` after a
    black hole resets the connections caught in it (their held bytes are never delivered: the
    route came back without their state) and relays new ones; ``reset()`` closes every open
    connection with an RST (``SO_LINGER`` 0) and keeps forwarding new ones. ``url(base)``
    rewrites a URL to go through the proxy.
    """

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._open = threading.Event()  # client -> server
        self._open.set()
        self._open_replies = threading.Event()  # server -> client
        self._open_replies.set()
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="fault-proxy", daemon=True)
        self._thread.start()

    def url(self, base: str) -> str:
        """``base`` (a SQLAlchemy URL) with its host and port replaced by the proxy's."""
        import sqlalchemy as sa

        return (
            sa.make_url(base)
            .set(host="127.0.0.1", port=self.port)
            .render_as_string(hide_password=False)
        )

    def forward(self) -> None:
        if not (self._open.is_set() and self._open_replies.is_set()):
            self.reset()
        self._open.set()
        self._open_replies.set()

    def blackhole(self) -> None:
        self._open.clear()
        self._open_replies.clear()

    def blackhole_replies(self) -> None:
        """Lose only what the server sends: its requests still reach it (a COMMIT is
        committed), its answers never come back (the client cannot know)."""
        self._open_replies.clear()

    def reset(self) -> int:
        """RST every open connection; returns how many were reset."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
        linger_zero = struct.pack("ii", 1, 0)
        for pair in pairs:
            for sock in pair:
                with contextlib.suppress(OSError):
                    # linger 0: the close sends an RST; the shutdown first wakes the pump
                    # threads blocked in recv() (a close alone would not), so the close is the
                    # last reference and really happens now
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger_zero)
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
        return len(pairs)

    def close(self) -> None:
        self._closed = True
        self._open.set()
        self._open_replies.set()
        with contextlib.suppress(OSError):
            # wakes the thread blocked in accept() (close() alone does not, on Linux): it ends
            self._listener.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._listener.close()
        self.reset()

    def __enter__(self) -> Proxy:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=10)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._pairs.append((client, server))
            for src, dst, gate in (
                (client, server, self._open),
                (server, client, self._open_replies),
            ):
                threading.Thread(target=self._pump, args=(src, dst, gate), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, gate: threading.Event) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                # a black hole holds the bytes (and the sockets) until forwarding resumes, or
                # the connection is reset
                while not gate.wait(0.05):
                    if src.fileno() < 0 or dst.fileno() < 0:
                        return
                if dst.fileno() < 0:
                    return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


# -- disks and files ---------------------------------------------------------------------------
@contextlib.contextmanager
def small_disk(size_kib: int) -> Iterator[Path | None]:
    """A tmpfs of ``size_kib`` KiB mounted for the block, or ``None`` when mounting is not
    allowed here (not root, or no ``CAP_SYS_ADMIN`` in a container)."""
    mount = shutil.which("mount")
    if os.geteuid() != 0 or mount is None:
        yield None
        return
    where = Path(tempfile.mkdtemp(prefix="fsm-disk-"))
    done = subprocess.run(
        [mount, "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(where)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        where.rmdir()
        yield None
        return
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)
        with contextlib.suppress(OSError):
            where.rmdir()


def flip_bytes(path: Path, offset: int, length: int) -> None:
    """XOR ``length`` bytes of ``path`` from ``offset`` with 0xFF, in place."""
    with path.open("r+b") as file:
        file.seek(offset)
        data = file.read(length)
        file.seek(offset)
        file.write(bytes(b ^ 0xFF for b in data))
        file.flush()
        os.fsync(file.fileno())
