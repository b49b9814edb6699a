"""Write one benchmark's section of BENCHMARKS.md: each script owns one ``## `` section and
replaces only it (``--write-md``), so the others stay byte-identical."""

from __future__ import annotations

import re
from pathlib import Path


def replace_section(path: Path, heading: str, section: str) -> None:
    """Replace the section of ``path`` that starts at the line ``heading`` (up to the next
    ``## `` heading) with ``section``, or append ``section`` when there is none."""
    text = path.read_bytes().decode("utf-8") if path.exists() else ""
    found = re.search(rf"^{re.escape(heading)}[ \t]*\r?$", text, re.MULTILINE)
    if found:
        after = re.search(r"^## ", text[found.end() :], re.MULTILINE)
        end = found.end() + after.start() if after else len(text)
        rest = text[end:]
        new = text[: found.start()] + section + ("\n" + rest if rest else "")
    else:
        new = text + ("" if not text or text.endswith("\n") else "\n") + ("\n" if text else "")
        new += section
    path.write_bytes(new.encode("utf-8"))
