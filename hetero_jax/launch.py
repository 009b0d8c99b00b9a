"""``hetero-jax launch -n N [--devices-per-process K] -- generate ...``: N processes of one command on this
machine, joined into one JAX job through the variables :mod:`hetero_jax.runtime.distributed` reads.

Each process gets ``JAX_COORDINATOR_ADDRESS`` (127.0.0.1 and a free port), ``JAX_NUM_PROCESSES``, its
``JAX_PROCESS_ID`` and ``JAX_LOCAL_DEVICE_IDS``: on a GPU host process i takes GPUs iK..iK+K-1, or GPU i
without K (else every process would take every GPU it sees, as jax does); CPU devices ignore the ids. With K
also ``XLA_FLAGS=--xla_force_host_platform_device_count=K`` (K CPU devices each). Process 0's output is
forwarded; the others' stdout is dropped (they print nothing) and their stderr shared. No process reads stdin:
a ``--prompt-file -`` or ``--turns -`` is read once by the launcher and handed to each as a temporary file.
When a process fails, the others are stopped (SIGTERM, then SIGKILL after ``grace_s``) and the launcher exits
with the first failure's code: a peer blocked in a collective would otherwise wait for jax's heartbeat timeout
(100 s) or forever. Ctrl-C, SIGTERM and SIGHUP to the launcher stop every process the same way.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from typing import Mapping, Sequence

from hetero_jax.runtime.distributed import ADDRESS, COUNT, RANK, LaunchError

LAUNCHABLE = ("generate",)
STDIN_FLAGS = ("--prompt-file", "--turns")  # generate's flags whose '-' reads stdin
MAX_PROCESSES = 64  # on one machine: -n past this (and past its CPU count) is a typo, not a job
_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


def free_port() -> int:
    """A TCP port free on this machine now (the OS's pick; the coordinator binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(base: Mapping[str, str], n: int, rank: int, port: int, devices_per_process: int | None) -> dict:
    """The environment of process ``rank`` of ``n``: ``base`` plus the job's variables."""
    env = dict(base)
    env.update({ADDRESS: f"127.0.0.1:{port}", COUNT: str(n), RANK: str(rank)})
    k = 1 if devices_per_process is None else devices_per_process
    if devices_per_process is not None:
        flags = _COUNT_FLAG.sub("", env.get("XLA_FLAGS", "")).strip()
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={k}".strip()
    # always: without it each process of a GPU host would take every GPU (twice-claimed devices, and jax's
    # memory preallocation in each process); jax applies the ids to GPUs only
    env["JAX_LOCAL_DEVICE_IDS"] = ",".join(str(rank * k + j) for j in range(k))
    return env


def check_command(command: Sequence[str]) -> list[str]:
    """The hetero-jax command to launch (a leading ``--`` dropped); LaunchError unless it is launchable."""
    command = list(command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command or command[0] not in LAUNCHABLE:
        got = f"got {command[0]!r}" if command else "got nothing"
        raise LaunchError(f"hetero-jax launch runs {' or '.join(LAUNCHABLE)} in every process ({got}); write "
                          "hetero-jax launch -n 2 -- generate --model ... --prompt ...")
    return command


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc  # killed by signal s: the shell's 128 + s


def run_processes(commands: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]], *, grace_s: float = 5.0,
                  poll_s: float = 0.05, log=sys.stderr) -> int:
    """Run one process per command (process i with ``envs[i]``) until all exit; 0 when all exit 0.

    When one exits non-zero the others get SIGTERM, then SIGKILL after ``grace_s``; the return value is the
    first failure's exit code (a signal s as 128 + s). Process 0 writes to this process's stdout and stderr,
    the others to its stderr only."""
    procs: list[subprocess.Popen] = []
    restore = _stop_on_signals()
    try:
        for i, (cmd, env) in enumerate(zip(commands, envs)):
            procs.append(subprocess.Popen(list(cmd), env=dict(env), stdin=subprocess.DEVNULL,
                                          stdout=None if i == 0 else subprocess.DEVNULL))
        first = None
        while first is None and any(p.returncode is None for p in procs):
            time.sleep(poll_s)
            for i, p in enumerate(procs):
                if p.poll() is not None and p.returncode != 0:
                    first = (i, p.returncode)
                    break
        if first is None:
            return 0
        i, rc = first
        alive = [j for j, p in enumerate(procs) if p.poll() is None]
        how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
        print(f"error: process {i} of {len(procs)} {how}" + (
            f"; stopping process{'es' if len(alive) > 1 else ''} {', '.join(map(str, alive))}" if alive else ""),
            file=log, flush=True)
        _stop([procs[j] for j in alive], grace_s)
        return _exit_code(rc)
    except KeyboardInterrupt:
        _stop([p for p in procs if p.poll() is None], grace_s)
        return 130
    except _Terminated as e:  # a kill, a timeout or a scheduler's cancel: the workers go with the launcher
        print(f"error: hetero-jax launch got signal {e.signum} ({signal.Signals(e.signum).name}); stopping its "
              f"{len(procs)} process(es)", file=log, flush=True)
        _stop([p for p in procs if p.poll() is None], grace_s)
        return 128 + e.signum
    finally:
        _stop([p for p in procs if p.poll() is None], grace_s)
        restore()


class _Terminated(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop_on_signals():
    """Turn SIGTERM and SIGHUP into :class:`_Terminated` while the workers run (the default action would end the
    launcher alone, and JAX's workers catch SIGTERM, so they would run on); returns what restores the old
    handlers. Nothing is changed off the main thread, where Python cannot set handlers."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def raise_terminated(signum, _frame):
        raise _Terminated(signum)
    old = {s: signal.signal(s, raise_terminated) for s in (signal.SIGTERM, signal.SIGHUP)}
    return lambda: [signal.signal(s, h) for s, h in old.items()]


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    for p in procs:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch(n: int, command: Sequence[str], *, devices_per_process: int | None = None, grace_s: float = 5.0,
           python: str = sys.executable, options: Sequence[str] = STDIN_FLAGS) -> int:
    """``hetero-jax COMMAND...`` in ``n`` processes on this machine, joined into one job (module docstring)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise LaunchError(f"-n {n!r}: give the number of processes, an integer >= 1")
    most = max(MAX_PROCESSES, os.cpu_count() or 1)
    if n > most:  # one machine's job: a process per accelerator or a few per core, never thousands
        raise LaunchError(f"-n {n}: more processes than one machine runs (at most {most} here: {MAX_PROCESSES} or "
                          "its CPU count); give a process per accelerator (or per group of simulated devices)")
    if devices_per_process is not None and (isinstance(devices_per_process, bool) or
                                            not isinstance(devices_per_process, int) or devices_per_process < 1):
        raise LaunchError(f"--devices-per-process {devices_per_process!r}: give an integer >= 1")
    command = check_command(command)
    command, stdin_file = stdin_to_file(command, options=options)  # options: generate's, for abbreviated flags
    try:
        port = free_port()
        argv = [python, "-m", "hetero_jax.cli", *command]
        # the children import the hetero_jax this launcher runs, wherever they start
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        base = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        envs = [process_env(base, n, i, port, devices_per_process) for i in range(n)]
        return run_processes([argv] * n, envs, grace_s=grace_s)
    finally:
        if stdin_file is not None:
            os.unlink(stdin_file)


def _option(arg: str, options: Sequence[str]) -> str | None:
    """The option ``arg`` names as argparse reads it among ``options`` (the whole name, or a prefix of exactly
    one: ``--prompt-f`` is ``--prompt-file``), None for none."""
    name = arg.partition("=")[0]
    if name in options:
        return name
    matches = [o for o in options if o.startswith(name)]
    return matches[0] if len(matches) == 1 else None


def stdin_to_file(command: list[str], stdin=None, options: Sequence[str] = STDIN_FLAGS) -> tuple[list[str], str | None]:
    """``command`` with the ``-`` (stdin) value of a ``STDIN_FLAGS`` flag replaced by a temporary file that holds
    this process's stdin, read once: every process is started with no stdin, so each would otherwise read an
    empty prompt. ``options``: the command's long options, to read abbreviated flags as argparse does; a flag
    given more than once counts by its last value, as argparse takes it. Returns (command, the file to remove
    afterwards or None). Two different flags reading stdin are left to generate, which refuses them."""
    import tempfile

    last = {}  # flag -> (index, whether its value is in the same argument, the value)
    for i, a in enumerate(command):
        if not a.startswith("--") or a == "--":
            continue
        flag = _option(a, options)
        if flag in STDIN_FLAGS:
            joined = "=" in a
            value = a.partition("=")[2] if joined else (command[i + 1] if i + 1 < len(command) else None)
            last[flag] = (i, joined, value)
    reading = [(flag, i, joined) for flag, (i, joined, value) in last.items() if value == "-"]
    if len(reading) != 1:
        return command, None
    data = (stdin or sys.stdin.buffer).read()
    fd, path = tempfile.mkstemp(prefix="hetero-jax-launch-stdin-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    out = list(command)
    flag, i, joined = reading[0]
    if joined:
        out[i] = f"{flag}={path}"
    else:
        out[i + 1] = path
    return out, path
