"""A headless Chromium driven through the Chrome DevTools protocol over a pipe (no websocket, no package).

`ember explain --html` pages are checked in a real browser with it (tests/tools/test_explain_html.py) and
screenshotted: `python -m ember.tools.browser PAGE.html SHOT.png`. Chromium comes from the system's
packages (`apt-get install chromium` on Debian); `find_chromium` says where, or None.

The protocol: Chromium started with `--remote-debugging-pipe` reads commands from its fd 3 and writes
replies and events to its fd 4, each a JSON object ended by a NUL byte. Network requests other than
file: and data: URLs are recorded (`requests`): a self-contained page makes none.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _above_9(fd: int) -> int:
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return high


class BrowserError(RuntimeError):
    pass


class Chromium:
    """One headless browser with one page. Use as a context manager."""

    def __init__(self, executable: str | None = None, width: int = 1280, height: int = 900, timeout: float = 60):
        exe = executable or find_chromium()
        if exe is None:
            raise BrowserError("no Chromium found (apt-get install chromium)")
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="ember-chromium-")
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        # The child's ends above 9, so `3<&N 4>&M` never overwrites one with the other.
        to_child_r, from_child_w = (_above_9(fd) for fd in (to_child_r, from_child_w))

        # Chromium's fd 3 reads our commands and its fd 4 writes its replies: the shell wires them.
        args = [
            "bash",  # dash's redirections take one-digit descriptors only
            "-c",
            f'exec "$0" "$@" 3<&{to_child_r} 4>&{from_child_w}',
            exe,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--disable-extensions",
            "--disable-background-networking",
            "--host-resolver-rules=MAP * ~NOTFOUND",
            "--remote-debugging-pipe",
            f"--user-data-dir={self.profile}",
            f"--window-size={width},{height}",
            "about:blank",
        ]
        self.proc = subprocess.Popen(
            args, pass_fds=(to_child_r, from_child_w), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict] = []
        self.session = None
        targets = self.send("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        self.session = self.send("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable")

    # -- the protocol --------------------------------------------------------------------------
    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline:
                raise BrowserError("Chromium did not answer in time")
            if self.proc.poll() is not None:
                raise BrowserError(f"Chromium exited with {self.proc.returncode}")
            import select

            ready, _, _ = select.select([self._from_child], [], [], 0.2)
            if ready:
                chunk = os.read(self._from_child, 1 << 20)
                if not chunk:
                    raise BrowserError("Chromium closed its pipe")
                self._buffer += chunk
        raw, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(raw)

    def send(self, method: str, **params) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if self.session is not None:
            message["sessionId"] = self.session
        os.write(self._to_child, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self.events.append(reply)

    def wait_for(self, method: str) -> dict:
        deadline = time.monotonic() + self.timeout
        for i, event in enumerate(self.events):
            if event["method"] == method:
                return self.events.pop(i)
        while True:
            event = self._read_message(deadline)
            if event.get("method") == method:
                return event
            if "method" in event:
                self.events.append(event)

    # -- what tests and tools use ----------------------------------------------------------------
    def open(self, path: str | Path) -> None:
        """Load a local file and wait for its load event."""
        self.events.clear()
        self.send("Page.navigate", url=Path(path).resolve().as_uri())
        self.events.append(self.wait_for("Page.loadEventFired"))

    def evaluate(self, expression: str):
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression[:80]}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def console_errors(self) -> list[str]:
        """Uncaught exceptions, console.error calls and error log entries seen since the page opened."""
        self.send("Runtime.evaluate", expression="0")  # drain what arrived
        errors = []
        for ev in self.events:
            p = ev.get("params", {})
            if ev["method"] == "Runtime.exceptionThrown":
                errors.append(p["exceptionDetails"].get("text", "exception"))
            elif ev["method"] == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                errors.append(" ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", [])))
            elif ev["method"] == "Log.entryAdded" and p["entry"].get("level") == "error":
                errors.append(p["entry"].get("text", ""))
        return errors

    def requests(self) -> list[str]:
        """URLs the page asked the network for (file: and data: excluded)."""
        urls = [ev["params"]["request"]["url"] for ev in self.events if ev["method"] == "Network.requestWillBeSent"]
        return [u for u in urls if not u.startswith(("file:", "data:", "about:"))]

    def screenshot(self, path: str | Path | None = None, selector: str | None = None, full: bool = False) -> bytes:
        """A PNG of the page (or of one element's box), written to `path` if given."""
        params: dict = {"format": "png"}
        if selector is not None:
            box = self.evaluate(
                f"(() => {{ const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect();"
                " return [r.x + window.scrollX, r.y + window.scrollY, r.width, r.height]; })()"
            )
            params["clip"] = {"x": box[0], "y": box[1], "width": box[2], "height": box[3], "scale": 1}
            params["captureBeyondViewport"] = True
        elif full:
            params["captureBeyondViewport"] = True
        png = base64.b64decode(self.send("Page.captureScreenshot", **params)["data"])
        if path is not None:
            Path(path).write_bytes(png)
        return png

    def close(self) -> None:
        try:
            self.session = None
            self.send("Browser.close")
        except BrowserError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._to_child, self._from_child):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m ember.tools.browser PAGE.html SHOT.png", file=sys.stderr)
        return 2
    with Chromium() as browser:
        browser.open(argv[0])
        browser.screenshot(argv[1])
        errors = browser.console_errors()
    print(f"wrote {argv[1]}" + (f"; console errors: {errors}" if errors else ""))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
