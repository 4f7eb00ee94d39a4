"""The resident process of a Docker sandbox: it runs each command the host sends and answers with its result,
so a tool call costs a process spawn inside the container instead of a ``runc exec`` (about 60 ms of the
90 ms a warm exec took).

It is the container's main process (``python3 -c SOURCE LIFETIME``), standard library only, talking over its
attached stdin and stdout: one JSON request per line in, one JSON answer per line out. A command runs in a
session of its own; at its deadline the whole group is killed. Processes that escaped the group and still
hold its output after a grace period are reported, and the host then removes the sandbox. When the
sandbox's lifetime is up the agent exits and the engine removes the container.

``SOURCE`` is this file's text: the image has no Loom installed, only Python.
"""

import base64
import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time

GRACE_S = 2.0


def _kill(pid):
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def run(req):
    cap = int(req["cap"])
    env = dict(os.environ)
    env.update(req.get("env") or {})
    t0 = time.monotonic()
    deadline = t0 + float(req["timeout"])
    try:
        p = subprocess.Popen(
            req["cmd"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=req.get("cwd") or None,
            env=env,
            start_new_session=True,
        )
    except OSError as e:
        return {
            "code": 126 if isinstance(e, PermissionError) else 127,
            "out": "",
            "err": _b64(str(e).encode()),
            "truncated": False,
            "timed_out": False,
            "escaped": False,
            "dt": time.monotonic() - t0,
        }
    assert p.stdout is not None and p.stderr is not None
    pipes = (p.stdout, p.stderr)
    out_fd, err_fd = p.stdout.fileno(), p.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray()}
    truncated = False
    timed_out = False
    sel = selectors.DefaultSelector()
    for fd in (out_fd, err_fd):
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    end = deadline
    while sel.get_map():
        left = end - time.monotonic()
        if left <= 0:
            if timed_out:
                break  # still held open after the kill: something escaped the group
            timed_out = True
            _kill(p.pid)
            end = time.monotonic() + GRACE_S
            continue
        for key, _ in sel.select(left):
            try:
                data = os.read(key.fd, 65536)
            except BlockingIOError:
                continue
            if not data:
                sel.unregister(key.fd)
                continue
            buf = bufs[key.fd]
            room = cap - len(buf)
            if len(data) > room:
                truncated = True
            if room > 0:
                buf += data[:room]
    escaped = bool(sel.get_map()) and timed_out
    sel.close()
    try:
        code = p.wait(timeout=max(0.0, deadline - time.monotonic()) if not timed_out else GRACE_S)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill(p.pid)
        try:
            code = p.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            code, escaped = -9, True
    for f in pipes:
        f.close()
    return {
        "code": 128 - code if code < 0 else code,
        "out": _b64(bytes(bufs[out_fd])),
        "err": _b64(bytes(bufs[err_fd])),
        "truncated": truncated,
        "timed_out": timed_out,
        "escaped": escaped,
        "dt": time.monotonic() - t0,
    }


def _b64(b):
    return base64.b64encode(b).decode()


def main():
    signal.alarm(max(1, int(float(sys.argv[1]))))  # the sandbox's lifetime: the default action ends us
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        try:
            answer = run(json.loads(line))
        except Exception as e:  # a bad request answers as an error; the agent keeps serving
            answer = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(answer).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    main()
