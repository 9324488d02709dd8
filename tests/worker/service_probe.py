"""``python -m tests.worker.service_probe CODE [SLEEP_S]``: prints, as one JSON line, what a process can
tell of how it was started, sleeps ``SLEEP_S``, and exits with ``CODE`` after a non-daemon thread and an
``atexit`` handler have each printed a line (tests/worker/test_service_parent.py)."""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time


def disposition(sig: signal.Signals) -> str:
    handler = signal.getsignal(sig)
    names = {signal.SIG_IGN: "ignored", signal.SIG_DFL: "default", signal.default_int_handler: "KeyboardInterrupt"}
    return names.get(handler, "other") if handler is not None else "none"


def main() -> int:
    code = int(sys.argv[1])
    seen = {
        "argv": sys.argv,
        "name": __name__,
        "probe": os.environ.get("TRAINJOBS_PROBE"),
        "session_leader": os.getsid(0) == os.getpid(),
        "path0": sys.path[0],
        "cwd": os.getcwd(),
        "sigint": disposition(signal.SIGINT),
        "sigterm": disposition(signal.SIGTERM),
        "line_buffering": sys.stdout.line_buffering,
        "write_through": sys.stdout.write_through,
        "stdout_is_stderr": os.path.samestat(os.fstat(1), os.fstat(2)),
    }
    print(json.dumps(seen), flush=True)
    atexit.register(lambda: print("atexit ran", flush=True))
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread ended", flush=True))).start()
    if len(sys.argv) > 2:
        time.sleep(float(sys.argv[2]))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
