"""Open a dump's ``report.html`` in headless Chromium, type into its search box, screenshot it.

Dependency-free: it speaks the Chrome DevTools Protocol over ``--remote-debugging-pipe``
(JSON messages separated by NUL bytes on file descriptors 3 and 4), so it needs only a
Chromium binary (Debian: ``apt-get install -y chromium``) and no websocket client,
Selenium or Playwright. ``tests/test_dump.py`` drives it; run it by hand to look:

    .venv/bin/python tools/check_report_in_browser.py DUMP/report.html --type deny --screenshot report.png
    .venv/bin/python tools/check_report_in_browser.py --smoke   # a page of its own, in a temporary directory

Exit status 2 on bad input; 77 (the test suites' "skipped") where no Chromium is installed.
"""
from __future__ import annotations

import argparse
import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
LAUNCH_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--remote-debugging-pipe",
)
TIMEOUT_S = 30.0
NO_BROWSER = 77  # exit status: this machine cannot run the tool (tests/test_tools.py skips, naming why)
# --smoke's page: the report's search box and decision table, three rows.
SMOKE_PAGE = """<!doctype html><html><body><input id="search"><section id="decisions"><table id="nodes"><tbody>
<tr><td>allow1</td></tr><tr><td>deny1</td></tr><tr><td>clr1</td></tr></tbody></table></section></body></html>"""
SMOKE_ROWS = 3
# Rows of the report's decision table that are laid out (not hidden by a filter).
VISIBLE_ROWS_JS = (
    "Array.prototype.filter.call(document.querySelectorAll('#nodes tbody tr'),"
    " function (row) { return row.offsetParent !== null; }).length"
)


_TRAMPOLINE = (
    "import os, sys; r, w = int(sys.argv[1]), int(sys.argv[2]); os.dup2(r, 3); os.dup2(w, 4);"
    " os.close(r); os.close(w); os.execv(sys.argv[3], sys.argv[3:])"
)


class BrowserError(RuntimeError):
    """Chromium did not start, answered with an error, or did not answer in time."""


def find_chromium() -> str | None:
    """The first Chromium-like binary on PATH, or None."""
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


class Chromium:
    """A headless Chromium driven over the DevTools pipe; use as a context manager."""

    def __init__(self, executable: str, *, width: int = 1280, height: int = 900) -> None:
        self._profile = tempfile.TemporaryDirectory(prefix="amp_rewrite_chromium_")
        self._log = open(Path(self._profile.name) / "stderr.log", "w+b")
        to_browser_read, self._to_browser = os.pipe()
        self._from_browser, from_browser_write = os.pipe()
        # Chromium reads commands from fd 3 and writes replies to fd 4. Lift our ends above
        # 9, then let a tiny exec trampoline move them to 3 and 4 (no clash with each other
        # or with subprocess's own pipe, which a preexec_fn could overwrite).
        child_read = fcntl.fcntl(to_browser_read, fcntl.F_DUPFD_CLOEXEC, 10)
        child_write = fcntl.fcntl(from_browser_write, fcntl.F_DUPFD_CLOEXEC, 10)
        for fd in (to_browser_read, from_browser_write):
            os.close(fd)
        flags = [*LAUNCH_FLAGS, f"--user-data-dir={self._profile.name}", f"--window-size={width},{height}"]
        self._process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _TRAMPOLINE, str(child_read), str(child_write), executable, *flags,
             "about:blank"],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log, pass_fds=(child_read, child_write),
        )
        os.close(child_read)
        os.close(child_write)
        self._buffer = b""
        self._next_id = 0
        self._events: list[dict[str, Any]] = []

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._process.poll() is None:
            try:
                self.send("Browser.close", timeout=5)
            except (BrowserError, OSError):
                pass  # killed below
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        for fd in (self._to_browser, self._from_browser):
            try:
                os.close(fd)
            except OSError:
                pass
        self._log.close()
        self._profile.cleanup()

    def _stderr_tail(self) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode("utf-8", "replace")[-2000:]

    def send(self, method: str, params: dict[str, Any] | None = None, *, session: str | None = None,
             timeout: float = TIMEOUT_S) -> dict[str, Any]:
        """Send one command and return its result; events that arrive meanwhile are kept."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        try:
            os.write(self._to_browser, json.dumps(message).encode("utf-8") + b"\0")
        except BrokenPipeError as error:
            raise BrowserError(f"Chromium exited; its log ends with:\n{self._stderr_tail()}") from error
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline, method)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method} failed: {reply['error']}")
                return reply.get("result", {})
            self._events.append(reply)

    def _read(self, deadline: float, waiting_for: str) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_browser], [], [], left)[0]:
                raise BrowserError(f"no answer to {waiting_for} from Chromium; its log:\n{self._stderr_tail()}")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise BrowserError(f"Chromium closed the pipe; its log ends with:\n{self._stderr_tail()}")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def open(self, url: str) -> Page:
        """A new tab showing ``url``, loaded."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session)
        self.send("Page.navigate", {"url": url}, session=session)
        page.wait_for(f"location.href === {json.dumps(url)} && document.readyState === 'complete'")
        return page


class Page:
    """One tab: evaluate JavaScript, type, click, take screenshots."""

    def __init__(self, browser: Chromium, session: str) -> None:
        self._browser = browser
        self._session = session

    def _send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._browser.send(method, params, session=self._session)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression (JSON-serialisable values only)."""
        result = self._send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise BrowserError(f"JavaScript error in {expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = TIMEOUT_S) -> Any:
        """Poll until ``expression`` is truthy; return its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"timed out after {timeout:.0f} s waiting for {expression!r}")
            time.sleep(0.05)

    def click(self, selector: str) -> None:
        """A real mouse click at the centre of the element."""
        box = self.evaluate(
            f"(function () {{ var e = document.querySelector({json.dumps(selector)}); e.scrollIntoView();"
            " var r = e.getBoundingClientRect(); return [r.left + r.width / 2, r.top + r.height / 2]; })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            self._send("Input.dispatchMouseEvent",
                       {"type": kind, "x": box[0], "y": box[1], "button": "left", "clickCount": 1})

    def type(self, selector: str, text: str) -> None:
        """Focus the element and type ``text`` key by key, as a person would."""
        self.evaluate(f"document.querySelector({json.dumps(selector)}).focus()")
        for char in text:
            self._send("Input.dispatchKeyEvent", {"type": "keyDown", "key": char, "text": char})
            self._send("Input.dispatchKeyEvent", {"type": "keyUp", "key": char})

    def clear(self, selector: str) -> None:
        """Select the element's text and delete it with Backspace."""
        self.evaluate(f"document.querySelector({json.dumps(selector)}).select()")
        backspace = {"key": "Backspace", "code": "Backspace", "windowsVirtualKeyCode": 8}
        self._send("Input.dispatchKeyEvent", {"type": "rawKeyDown", **backspace})
        self._send("Input.dispatchKeyEvent", {"type": "keyUp", **backspace})

    def screenshot(self, path: str | os.PathLike[str], *, full_page: bool = False) -> Path:
        """A PNG of the viewport, or of the whole page (up to 4000 px high)."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            width, height = self.evaluate(
                "[document.documentElement.scrollWidth, Math.min(document.documentElement.scrollHeight, 4000)]"
            )
            params.update(captureBeyondViewport=True, clip={"x": 0, "y": 0, "width": width, "height": height, "scale": 1})
        data = self._send("Page.captureScreenshot", params)["data"]
        out = Path(path)
        out.write_bytes(base64.b64decode(data))
        return out


def smoke(executable: str) -> int:
    """Open a page of its own, count its rows, type into its search box, screenshot it."""
    with tempfile.TemporaryDirectory(prefix="amp-browser-smoke-") as directory:
        page_path = Path(directory) / "report.html"
        page_path.write_text(SMOKE_PAGE, encoding="utf-8")
        with Chromium(executable) as browser:
            page = browser.open(page_path.as_uri())
            rows = page.evaluate(VISIBLE_ROWS_JS)
            page.type("#search", "deny")
            typed = page.evaluate("document.getElementById('search').value")
            png = page.screenshot(Path(directory) / "page.png", full_page=False).read_bytes()
    print(f"rows visible: {rows}; typed: {typed!r}; screenshot: {len(png)} bytes")
    return 0 if (rows, typed, png[:8]) == (SMOKE_ROWS, "deny", b"\x89PNG\r\n\x1a\n") else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, nargs="?", help="a dump's report.html")
    parser.add_argument("--type", default="", help="text to type into the search box")
    parser.add_argument("--screenshot", type=Path, help="write a PNG of the page here")
    parser.add_argument("--full-page", action="store_true", help="screenshot the whole page, not the viewport")
    parser.add_argument("--smoke", action="store_true", help="check this tool on a page of its own")
    args = parser.parse_args(argv)
    if (args.report is None) == (not args.smoke):
        parser.error("pass a dump's report.html, or --smoke")
    executable = find_chromium()
    if executable is None:
        print(f"no Chromium on PATH (looked for {', '.join(CHROMIUM_NAMES)}); "
              "install it: apt-get install -y chromium", file=sys.stderr)
        return NO_BROWSER
    if args.smoke:
        return smoke(executable)
    if not args.report.is_file():
        print(f"{args.report}: no such file; pass a dump's report.html", file=sys.stderr)
        return 2
    with Chromium(executable) as browser:
        page = browser.open(args.report.resolve().as_uri())
        print(f"rows visible: {page.evaluate(VISIBLE_ROWS_JS)}")
        if args.type:
            page.type("#search", args.type)
            time.sleep(0.3)  # the report filters large tables after a short pause in typing
            print(f"rows visible after typing {args.type!r}: {page.evaluate(VISIBLE_ROWS_JS)}")
            page.evaluate("document.getElementById('decisions').scrollIntoView()")  # show the rows
        if args.screenshot:
            print(f"screenshot: {page.screenshot(args.screenshot, full_page=args.full_page)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
