"""`specdec serve` in a process of its own, started with `--port 0`: the kernel picks a free port that
the server holds from the moment it binds (before the model loads), so there is no window in which
another process can take it, as there was when a test bound port 0, closed it and passed that number
on. The server says where it listens in uvicorn's "Uvicorn running on ..." line (an INFO line of the
uvicorn.error logger: not with --uvicorn-log-level warning)."""
import re
import time
from pathlib import Path

import httpx

LISTENING = re.compile(r"Uvicorn running on (https?)://(127\.0\.0\.1|localhost):(\d+) ")


def wait_listening(proc, log: Path, timeout: float = 120) -> str:
    """The base URL (http://127.0.0.1:PORT) of the server `proc`, whose stdout/stderr go to the file
    `log`, once it has said where it listens and its /health answers 200; fails (with the log's tail)
    if it exits first or takes longer than `timeout` seconds."""
    def text() -> str:
        try:
            return Path(log).read_text(errors="replace")
        except FileNotFoundError:        # a --log-config-file's handler creates it once it logs
            return ""

    deadline = time.monotonic() + timeout
    while not (m := LISTENING.search(text())):
        assert proc.poll() is None and time.monotonic() < deadline, text()[-2000:]
        time.sleep(0.1)
    url = f"{m.group(1)}://127.0.0.1:{m.group(3)}"
    while True:
        try:
            if httpx.get(url + "/health", timeout=2, verify=False).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, text()[-2000:]
        time.sleep(0.1)
