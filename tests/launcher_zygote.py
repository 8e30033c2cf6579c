"""The launcher started from a process that has imported it already, for the multi-process tests.

Every ``python -m titan_recover.launch`` spends about 6 s of one core importing TorchTitan's trainer before it can
check a config (its config classes live there), while the machine's other core waits: across the suite's ~50
launches that is minutes. So the tests start one **server** per session that imports the launcher once, and each
launch is a **client**, a small Python process without torch, which the test starts as it would start the launcher
(``subprocess.Popen``) and which behaves as the launcher for the test:

- the server forks a child per client: the child takes the client's standard streams, working directory,
  environment and arguments, and runs ``titan_recover.launch.main`` and ``process_exit.leave`` as
  ``python -m titan_recover.launch`` does;
- the client forwards SIGINT, SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2 to that child, and ends as the child ended (its
  exit code, or the same signal, so ``Popen.returncode`` is what the launcher's would be);
- a client that dies (SIGKILL on a test's timeout) takes its child with it: the server SIGKILLs it, and the child's
  own children follow by their death signal as under a real launcher.

The server is single-threaded (a fork copies only the calling thread): it imports, then serves from one loop. Tests
that signal or kill the launcher itself start ``python -m titan_recover.launch`` directly, as does ``run_train.sh``
in tests/test_end_to_end.py; ``TITAN_RECOVER_TEST_ZYGOTE=0`` starts every launch that way.
"""

from __future__ import annotations

import array
import json
import os
import select
import signal
import socket
import sys

SOCKET_ENV = "TITAN_RECOVER_TEST_ZYGOTE_SOCKET"
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _send_fds(sock: socket.socket, payload: bytes, fds: list[int]) -> None:
    sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])


def _read_line(reader) -> str:
    """One line from the server (buffered: its two lines may arrive in one read)."""
    line = reader.readline()
    if not line.endswith(b"\n"):
        raise ConnectionError("the launcher server closed the connection")
    return line.decode()


# ---- client: started by the test in the launcher's place ----------------------------------------------------------
def client(path: str, argv: list[str]) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as e:
        print(f"launcher_zygote: the tests' launcher server at {path} cannot be reached ({e}): it ended; its log "
              "is server.log next to it", file=sys.stderr)
        os._exit(1)
    request = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}).encode() + b"\n"
    _send_fds(sock, request, [0, 1, 2])
    reader = sock.makefile("rb")
    pid = int(_read_line(reader))
    for sig in FORWARDED:
        signal.signal(sig, lambda s, _frame: os.kill(pid, s))
    kind, value = _read_line(reader).split()
    if kind == "signal":
        signal.signal(int(value), signal.SIG_DFL)
        os.kill(os.getpid(), int(value))
    os._exit(int(value))


# ---- server: imports the launcher once, forks a launcher per client -----------------------------------------------
def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    data = b""
    while not data.endswith(b"\n"):
        chunk, ancillary, _flags, _addr = conn.recvmsg(1 << 20, socket.CMSG_SPACE(3 * fds.itemsize))
        if not chunk:
            raise ConnectionError("client closed before its request")
        for level, kind, raw in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(raw[: len(raw) - len(raw) % fds.itemsize])
        data += chunk
    return json.loads(data), list(fds)


def _run_launcher(request: dict, fds: list[int]) -> None:
    """In the forked child: become the launcher the client stands for; never returns."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [sys.argv[0], *request["argv"]]
    from titan_recover.launch import main
    from titan_recover.process_exit import leave

    code = 1
    try:
        code = main(request["argv"])
    except SystemExit as e:  # argparse's --help, or a usage error
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    leave(code)


def serve(path: str) -> None:
    # as ``python -m titan_recover.launch`` run from the checkout: the checkout first on the path, not tests/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    import titan_recover.launch  # noqa: F401  the imports every launcher would make
    import titan_recover.trainer  # noqa: F401  (its config classes: TorchTitan's trainer)

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # the path appears once the imports are done
    listener.listen(64)
    clients: dict[int, socket.socket] = {}  # launcher pid -> its client's connection
    while True:
        for pid, status in _ended(clients):
            conn = clients.pop(pid)
            verdict = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else \
                f"exit {os.WEXITSTATUS(status)}"
            try:
                conn.sendall(verdict.encode() + b"\n")
            except OSError:
                pass
            conn.close()
        ready, _, _ = select.select([listener, *clients.values()], [], [], 0.05)
        for sock in ready:
            if sock is listener:
                conn, _ = listener.accept()
                try:
                    request, fds = _receive(conn)
                except (OSError, ValueError):  # a client that died before its request was whole
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for other in clients.values():
                        other.close()
                    conn.close()
                    _run_launcher(request, fds)
                for fd in fds:
                    os.close(fd)
                clients[pid] = conn
                try:
                    conn.sendall(f"{pid}\n".encode())
                except OSError:  # the client died meanwhile: its launcher is ended below
                    _kill(pid)
            elif not _still_there(sock):  # the client died: so does its launcher (it ends its own children)
                _kill(next(p for p, c in clients.items() if c is sock))


def _still_there(sock: socket.socket) -> bool:
    """A client's connection was readable: it sends nothing after its request, so that is its end."""
    try:
        return bool(sock.recv(1))
    except OSError:
        return False


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _ended(clients: dict[int, socket.socket]) -> list[tuple[int, int]]:
    ended = []
    for pid in list(clients):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            ended.append((pid, status))
    return ended


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        client(os.environ[SOCKET_ENV], sys.argv[2:])
