"""Headless Chromium driven through the DevTools protocol over a pipe.

`--remote-debugging-pipe` makes Chromium read commands from its fd 3 and write
replies and events to its fd 4, each a JSON object ended by a NUL byte: no
extra dependency and no network port, and the page's real layout to query.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


def find_chromium() -> str | None:
    """Debian's `chromium`, if it is on the PATH."""
    return shutil.which("chromium")


class Chromium:
    """One headless Chromium with one page; use it as a context manager."""

    def __init__(self, executable: str, profile: Path, size: tuple[int, int], timeout_s: float):
        commands_r, commands_w = os.pipe()
        replies_r, replies_w = os.pipe()
        # bash puts our pipe ends on the fds 3 and 4 that Chromium expects (dash cannot: fd > 9)
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$0" "$@" 3<&{commands_r} 4>&{replies_w}', executable, *FLAGS,
             f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}",
             "--remote-debugging-pipe", "about:blank"],
            pass_fds=(commands_r, replies_w),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        os.close(commands_r)
        os.close(replies_w)
        self._out, self._in = commands_w, replies_r
        self._buffer = b""
        self._events: list[dict] = []
        self._id = 0
        self.timeout_s = timeout_s
        self.session: str | None = None

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.call("Browser.close", browser=True)
            self.proc.wait(timeout=10)
        except (OSError, TimeoutError, EOFError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            os.close(self._out)
            os.close(self._in)

    def call(self, method: str, params: dict | None = None, browser: bool = False) -> dict:
        """Send one command (to the page unless `browser`) and return its result."""
        self._id += 1
        message: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if not browser and self.session:
            message["sessionId"] = self.session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._receive()
            if reply.get("id") != self._id:
                self._events.append(reply)
            elif "error" in reply:
                raise RuntimeError(f"{method}: {reply['error']}")
            else:
                return reply["result"]

    def open(self, url: str) -> None:
        """Open `url` in a new page and wait for its load event."""
        target = self.call("Target.createTarget", {"url": "about:blank"}, browser=True)
        attached = self.call(
            "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True},
            browser=True,
        )
        self.session = attached["sessionId"]
        self.call("Page.enable")
        self._events.clear()
        self.call("Page.navigate", {"url": url})
        while not any(e.get("method") == "Page.loadEventFired" for e in self._events):
            self._events.append(self._receive())

    def evaluate(self, expression: str) -> Any:
        """The JSON value of a JavaScript expression in the page."""
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"JavaScript failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path) -> Path:
        """Save the whole page, not only the window, as a PNG."""
        size = self.call("Page.getLayoutMetrics")["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        shot = self.call(
            "Page.captureScreenshot",
            {"format": "png", "captureBeyondViewport": True, "clip": clip},
        )
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def _receive(self) -> dict:
        deadline = time.monotonic() + self.timeout_s
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._in], [], [], left)[0]:
                raise TimeoutError(f"Chromium did not answer within {self.timeout_s} s")
            chunk = os.read(self._in, 1 << 16)
            if not chunk:
                raise EOFError(f"Chromium exited (status {self.proc.poll()})")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)
