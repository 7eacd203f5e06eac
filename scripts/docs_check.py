"""Open every page of the built docs site in headless Chromium; fail on a page that does not render or that logs a
console error; save screenshots of the home page and one API page.

    python scripts/docs_check.py [--site build/site] [--out build/screenshots]

Serves the site on a local port (127.0.0.1 only). Needs Debian's ``chromium`` (``make docs-check`` installs it).
"""
from __future__ import annotations

import argparse
import functools
import http.server
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

BROWSER = ("chromium", "chromium-browser", "google-chrome")
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
         "--no-first-run", "--disable-extensions", "--enable-logging=stderr", "--v=0", "--virtual-time-budget=4000"]
CONSOLE = re.compile(r"CONSOLE\(\d+\)\]\s+\"(.*?)\",\s+source:\s+(\S+)")


def browser() -> str:
    for name in BROWSER:
        path = shutil.which(name)
        if path:
            return path
    sys.exit(f"docs-check: no headless browser found (tried {', '.join(BROWSER)}); apt-get install chromium")


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def visit(chrome: str, url: str, screenshot: Path | None = None) -> tuple[str, list[str]]:
    """The page's DOM after it ran, and the console errors it logged."""
    args = [chrome, *FLAGS]
    if screenshot is not None:
        args += [f"--screenshot={screenshot}", "--window-size=1280,900"]
    else:
        args += ["--dump-dom"]
    out = subprocess.run([*args, url], capture_output=True, text=True, timeout=120)
    errors = [f"{m.group(1)} ({m.group(2)})" for m in CONSOLE.finditer(out.stderr)
              if re.search(r"error|uncaught|failed", m.group(1), re.I)]
    if out.returncode != 0:
        errors.append(f"chromium exited {out.returncode}: {out.stderr[-500:]}")
    return out.stdout, errors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--site", default="build/site")
    p.add_argument("--out", default="build/screenshots")
    args = p.parse_args(argv)
    site, out = Path(args.site), Path(args.out)
    pages = sorted(p.relative_to(site).parent for p in site.rglob("index.html")
                   if not {"assets", "search"} & set(p.relative_to(site).parts))
    if not pages:
        sys.exit(f"docs-check: no pages under {site}: run make docs first")
    out.mkdir(parents=True, exist_ok=True)
    chrome, (server, base) = browser(), serve(site)
    failed = []
    try:
        for page in pages:
            url = f"{base}/{page.as_posix()}/" if str(page) != "." else f"{base}/"
            dom, errors = visit(chrome, url)
            if "<article" not in dom or "md-content" not in dom:
                errors.append("the page did not render (no article in its DOM)")
            print(f"{'ok  ' if not errors else 'FAIL'} {url}" + "".join(f"\n     {e}" for e in errors))
            if errors:
                failed.append(url)
        for name, page in (("home.png", ""), ("api-buffer.png", "api/buffer/")):
            visit(chrome, f"{base}/{page}", screenshot=(out / name).resolve())
            print(f"screenshot {out / name}")
    finally:
        server.shutdown()
    print(f"{len(pages) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
