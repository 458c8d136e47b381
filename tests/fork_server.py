"""A fork server for the tests' subprocesses: one process imports torch once, and each subprocess a test asks
for is a fork of it that runs its code as `python -c CODE` would, in a fresh `__main__`, with its own
environment, working directory and output files.

Importing torch (and torch._dynamo, which the first optimizer imports) costs seconds per interpreter; forked,
a subprocess starts in milliseconds. The server imports neither toma nor anything of the tests, so each child
imports toma afresh; it never touches CUDA, so a child may initialise it; and it starts no thread, so forking is
safe. The objects alive after its imports are frozen out of the garbage collector (`gc.freeze`), so that the
collection toma runs after each out-of-memory error scans what the child made, not torch's modules.

Run as a script by `ForkServer`; requests and answers are JSON lines on its stdin and stdout.
"""

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional


def _preload() -> None:
    import gc

    import psutil  # noqa: F401
    import torch
    import torch.distributed  # noqa: F401
    import torch.nn.functional  # noqa: F401
    import torch.utils.data  # noqa: F401

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # imports torch._dynamo
    gc.collect()
    gc.freeze()


def _run_child(request: dict) -> None:
    """In the forked child: become `python -c CODE` with the request's environment, then exit as it would
    (atexit handlers run, output flushed; an uncaught exception prints its traceback and exits 1)."""
    import types

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    if "OMP_NUM_THREADS" in request["env"]:  # read by torch at import: here, the import was before the fork
        import torch

        torch.set_num_threads(int(request["env"]["OMP_NUM_THREADS"]))
    sys.argv = ["-c"]
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    try:
        exec(compile(request["code"], "<string>", "exec"), main.__dict__)
    except SystemExit:
        raise
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.exit(1)
    sys.exit(0)


def serve() -> None:
    """The server's loop: fork a child per request, kill one on request, report each child's exit."""
    sys.path[0] = ""  # as under `python -c`: the working directory, not this script's folder
    _preload()
    out = sys.stdout

    def say(**message) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    say(ready=os.getpid())
    children, pending = set(), b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.02 if children else None)
        if readable:
            data = os.read(0, 1 << 16)
            if not data:
                break
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                if "kill" in request:
                    if request["kill"] in children:
                        os.kill(request["kill"], signal.SIGKILL)
                    continue
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _run_child(request)  # never returns: SystemExit ends the child here
                children.add(pid)
                say(started=pid, id=request["id"])
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            say(exited=pid, returncode=os.waitstatus_to_exitcode(status))
    for pid in children:
        os.kill(pid, signal.SIGKILL)


class ForkServer:
    """The client: starts the server once and runs code in forks of it, one test at a time."""

    def __init__(self, env: Dict[str, str], cwd: str) -> None:
        self.folder = tempfile.TemporaryDirectory(prefix="toma-fork-server-")
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=cwd,
        )
        self.exited: Dict[int, int] = {}
        self.requests = 0
        self.pending = b""
        ready = self._read(time.monotonic() + 300)
        assert ready is not None and "ready" in ready, "the fork server did not start"

    def _read(self, deadline: float) -> Optional[dict]:
        """The server's next message, or None at the deadline; exits are recorded as they come."""
        while b"\n" not in self.pending:
            ready, _, _ = select.select([self.process.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            data = os.read(self.process.stdout.fileno(), 1 << 16)
            assert data, f"the fork server died ({self.process.poll()})"
            self.pending += data
        line, self.pending = self.pending.split(b"\n", 1)
        message = json.loads(line)
        if "exited" in message:
            self.exited[message["exited"]] = message["returncode"]
        return message

    def start(self, code: str, env: Dict[str, str], cwd: str) -> "Child":
        self.requests += 1
        stdout, stderr = (os.path.join(self.folder.name, f"{self.requests}.{name}") for name in ("out", "err"))
        request = dict(id=self.requests, code=code, env=env, cwd=cwd, stdout=stdout, stderr=stderr)
        self.process.stdin.write((json.dumps(request) + "\n").encode())
        self.process.stdin.flush()
        while True:
            message = self._read(time.monotonic() + 60)
            assert message is not None, "the fork server does not answer"
            if message.get("id") == self.requests:
                return Child(self, message["started"], stdout, stderr)

    def wait(self, pids: List[int], deadline: float) -> bool:
        """Whether all of `pids` exited by the deadline."""
        while not all(pid in self.exited for pid in pids):
            if self._read(deadline) is None:
                return False
        return True

    def kill(self, pid: int) -> None:
        self.process.stdin.write((json.dumps(dict(kill=pid)) + "\n").encode())
        self.process.stdin.flush()
        self.wait([pid], time.monotonic() + 30)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)
        self.folder.cleanup()


class Child:
    """A forked subprocess: its pid, and its output once it exited."""

    def __init__(self, server: ForkServer, pid: int, stdout: str, stderr: str) -> None:
        self.server, self.pid, self.stdout_path, self.stderr_path = server, pid, stdout, stderr

    @property
    def returncode(self) -> Optional[int]:
        return self.server.exited.get(self.pid)

    def output(self) -> "tuple[str, str]":
        outputs = []
        for path in (self.stdout_path, self.stderr_path):
            with open(path, encoding="utf-8", errors="replace") as file:
                outputs.append(file.read())
            os.remove(path)
        return outputs[0], outputs[1]


if __name__ == "__main__":
    serve()
