"""Regenerate the viewer's screenshots in docs/ (the README shows them).

Builds a store in a temporary directory (a month of realistic traffic from ``bench/seed.py``,
then ``fsm demo``'s conversations, with the turn the model cuts off mid-call), serves it with
``fsm.web.serve`` on a free local port, and photographs each page with headless Chromium
(Debian's ``chromium`` through Playwright's ``executable_path``)::

    python docs/screenshots.py              # writes docs/viewer-*.png
    python docs/screenshots.py --calls 8000 # a bigger store
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from click.testing import CliRunner  # noqa: E402

from fsm.cli.main import cli  # noqa: E402
from fsm.store import audit  # noqa: E402
from fsm.web import serve  # noqa: E402
from fsm.web.html import path_of  # noqa: E402


def _seed_module() -> Any:
    spec = importlib.util.spec_from_file_location("_bench_seed", ROOT / "bench" / "seed.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def build(directory: Path, calls: int) -> tuple[str, str]:
    """The store: seeded traffic, then the demo; returns its URL and the demo's conversation."""
    url = f"sqlite:///{directory / 'viewer.db'}"
    _seed_module().seed(url, calls)
    result = CliRunner().invoke(cli, ["demo", "--db", url, "--delay", "0"])
    if result.exit_code != 0:
        raise SystemExit(f"fsm demo failed:\n{result.output}")
    done = [line for line in result.output.splitlines() if line.startswith("done: ")]
    return url, done[-1].rsplit(" ", 1)[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=4000, help="tool calls to seed")
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument(
        "--chromium", default=os.environ.get("FSM_CHROMIUM") or shutil.which("chromium")
    )
    args = parser.parse_args(argv)
    if not args.chromium:
        raise SystemExit("no chromium: apt-get install -y chromium (or pass --chromium PATH)")
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="fsm-screenshots-") as tmp:
        url, demo = build(Path(tmp), args.calls)
        engine = audit.open_readonly(url)
        serving = serve(engine, label="sqlite:///demo.db", port=0)
        thread = threading.Thread(target=serving.serve_forever, daemon=True)
        thread.start()
        base = serving.url.rstrip("/")
        shots = [
            ("viewer-conversations.png", "/", False),
            ("viewer-timeline.png", path_of("c", demo), True),
            ("viewer-truncated.png", path_of("c", f"{demo}-cut"), True),
            ("viewer-calls.png", "/calls?limit=25", False),
            ("viewer-failures.png", "/failures?limit=25", False),
            ("viewer-stats.png", "/stats", True),
            ("viewer-check.png", "/check", False),
        ]
        try:
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=args.chromium)
                page = browser.new_page(viewport={"width": 1280, "height": 860})
                for name, target, full in shots:
                    page.goto(base + target)
                    while page.locator(".computing").count():  # a whole-store scan still running
                        page.wait_for_timeout(500)
                        page.goto(base + target)
                    page.screenshot(path=str(args.out / name), full_page=full)
                    print(f"wrote {args.out / name}")
                browser.close()
        finally:
            serving.shutdown()
            thread.join(5)
            engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
