#!/usr/bin/env python3
"""Fuzz the SSE framer (``fsm.sse.SSEFramer``) with atheris, or with a plain random loop.

    python fuzz/fuzz_sse.py -atheris_runs=10000           # atheris / libFuzzer
    python fuzz/fuzz_sse.py --plain -atheris_runs=10000   # no atheris: seeded random mutations

The first two bytes of an input choose how the rest is fed (a seed for the split points and an
event-size limit); the rest is the byte stream. Checks, for every input:

* only ``EventTooLargeError`` may escape ``feed()``; ``close()`` never raises;
* the events (type, data, offset) and the limit outcome do not depend on how the bytes are split
  (whole vs. random pieces vs. one byte at a time);
* no dispatched event's data exceeds ``max_event_bytes``; offsets never go backwards;
* lines starting with ``data`` are the only source of data: a stream without the bytes
  ``data`` dispatches nothing but ``event: error`` events.

See ``fuzz/README.md``.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import random
import sys
from collections.abc import Callable
from typing import Any

atheris: Any = None
if "--plain" in sys.argv:
    sys.argv.remove("--plain")
else:
    try:
        import atheris  # type: ignore[import-untyped,no-redef]
    except ImportError:  # pragma: no cover - depends on the environment
        atheris = None

if atheris is not None:
    with atheris.instrument_imports():
        from fsm.sse import EventTooLargeError, SSEFramer
else:
    from fsm.sse import EventTooLargeError, SSEFramer

Events = list[tuple[str, bytes, int]]

# fragments that make structure likely (the plain loop splices them in, as a libFuzzer dict)
TOKENS = [
    b"data:",
    b"data: ",
    b"event: error\n",
    b"event: message\n",
    b"id: 1\n",
    b"retry: 10\n",
    b": ping\n",
    b"\n",
    b"\r",
    b"\r\n",
    b"\n\n",
    b"\xef\xbb\xbf",
    b"[DONE]",
    b'{"choices":[]}',
]


def split_points(rng: random.Random, length: int) -> list[int]:
    count = rng.randint(0, min(length, 12))
    return sorted(rng.randint(0, length) for _ in range(count))


def frame(body: bytes, limit: int, points: list[int]) -> tuple[Events, tuple[int, int] | None]:
    """Feed ``body`` cut at ``points``; return every event and the limit error, if any."""
    framer = SSEFramer(max_event_bytes=limit)
    events: Events = []
    bounds = [0, *points, len(body)]
    for a, b in itertools.pairwise(bounds):
        try:
            events.extend(framer.feed(body[a:b]))
        except EventTooLargeError as exc:
            events.extend(exc.events)
            framer.close()
            return events, (exc.limit, exc.offset)
    framer.close()
    return events, None


def check(data: bytes) -> None:
    if len(data) < 2:
        return
    rng = random.Random(data[0])
    limit = 1 + data[1] * 4 if data[1] < 0xF0 else 16 * 1024 * 1024
    body = data[2:]

    whole = frame(body, limit, [])
    pieces = frame(body, limit, split_points(rng, len(body)))
    assert pieces == whole, (pieces, whole)
    if len(body) <= 512:
        bytewise = frame(body, limit, list(range(1, len(body))))
        assert bytewise == whole, (bytewise, whole)

    events, too_large = whole
    last = -1
    for name, payload, offset in events:
        assert isinstance(name, str)
        assert len(payload) <= limit, (len(payload), limit)
        assert offset >= last, (offset, last)
        assert 0 <= offset <= len(body)
        last = offset
    if too_large is not None:
        assert too_large[0] == limit
        assert 0 <= too_large[1] <= len(body)
    if b"data" not in body:
        assert all(name == "error" and payload == b"" for name, payload, _ in events), events


def TestOneInput(data: bytes) -> None:  # the name atheris expects
    check(data)


# -- the plain loop (no atheris) ---------------------------------------------------------------


def seeds() -> list[bytes]:
    out = [
        b"\x00\x00data: {}\n\n",
        b"\x01\xf0: ping\n\ndata: a\ndata: b\n\nevent: error\n\n",
        b"\x02\x10\xef\xbb\xbfdata:x\r\rdata: y\r\n\r\ndata: [DONE]\n\n",
        b"\x03\x02data: 0123456789\n\n",
    ]
    for path in seed_files():
        with open(path, "rb") as f:
            out.append(b"\x07\xf0" + f.read(4096))
    return out


def seed_files() -> list[str]:
    """Files and the files of directories named on the command line (libFuzzer's corpus dirs)."""
    found = []
    for arg in sys.argv[1:]:
        if arg.startswith("-"):
            continue
        if os.path.isdir(arg):
            for root, _dirs, files in os.walk(arg):
                found += [os.path.join(root, f) for f in sorted(files)]
        elif os.path.isfile(arg):
            found.append(arg)
    return found


def mutate(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        op = rng.randrange(6)
        at = rng.randint(0, len(buf))
        if op == 0 and buf:
            buf[min(at, len(buf) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1:
            buf[at:at] = rng.choice(TOKENS)
        elif op == 2:
            del buf[at : at + rng.randint(1, 32)]
        elif op == 3:
            buf[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 4 and buf:
            a = rng.randint(0, len(buf))
            buf[at:at] = buf[a : a + rng.randint(1, 64)]
        else:
            buf[at:at] = rng.choice(TOKENS) * rng.randint(1, 200)
    return bytes(buf[:65536])


def flag(name: str, default: int) -> int:
    for arg in sys.argv[1:]:
        if arg.startswith(f"-{name}="):
            return int(arg.split("=", 1)[1])
    return default


def plain_loop(test: Callable[[bytes], None], seed_inputs: list[bytes]) -> None:
    runs = flag("atheris_runs", flag("runs", 10_000))
    rng = random.Random(flag("seed", 0))
    pool = list(seed_inputs)
    for n in range(runs):
        if rng.random() < 0.1:
            data = bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
        else:
            data = mutate(rng, rng.choice(pool))
        try:
            test(data)
        except BaseException:
            name = "crash-" + hashlib.sha1(data).hexdigest()
            with open(name, "wb") as f:
                f.write(data)
            print(f"input {n} failed; written to {name}", file=sys.stderr)
            raise
        if rng.random() < 0.05 and len(pool) < 512:
            pool.append(data)
    print(f"plain loop: {runs} inputs, no failure")


def main() -> None:
    if atheris is not None:
        atheris.Setup(sys.argv, TestOneInput)
        atheris.Fuzz()
    else:
        plain_loop(TestOneInput, seeds())


if __name__ == "__main__":
    main()
