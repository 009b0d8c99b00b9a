"""Joining a multi-process JAX job from the environment the launcher set, the way the ecosystem launches.

:func:`initialize_distributed` reads where this process stands (:func:`process_setup`, a pure function of the
environment) and, when the job has more than one process, calls ``jax.distributed.initialize`` before anything
touches a JAX backend; in a single process it does nothing. Sources, first match wins:

- JAX's own variables: ``JAX_COORDINATOR_ADDRESS`` (host:port of process 0's coordinator),
  ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` (jax 0.10.2 reads only the address itself; the count and the id
  are read here). ``hetero-jax launch`` sets these three.
- SLURM (``srun``): jax's own detection (``SLURM_JOB_ID``, ``SLURM_STEP_NODELIST``, ``SLURM_NTASKS``,
  ``SLURM_PROCID``, ``SLURM_LOCALID``), the coordinator on the step's first node.
- Open MPI (``mpirun``, versions that set ``OMPI_MCA_orte_hnp_uri``): ``OMPI_COMM_WORLD_SIZE`` /
  ``OMPI_COMM_WORLD_RANK`` / ``OMPI_COMM_WORLD_LOCAL_RANK``, the coordinator on the launcher's host.
- Kubernetes: an Indexed Job (``KUBERNETES_SERVICE_HOST`` and ``JOB_COMPLETION_INDEX``), read through the
  Kubernetes API by jax (needs the ``kubernetes`` package: ``pip install 'jax[k8s]'``).

``JAX_COORDINATOR_ADDRESS`` may also override a cluster's coordinator, and ``JAX_COORDINATOR_PORT`` its port,
as in jax. A variable that is malformed or set without its partners is a :class:`LaunchError` naming it and
the fix, raised before JAX starts. ``HETERO_JAX_HEARTBEAT_S`` (seconds, default jax's 100) bounds how long the
job waits for a process that stopped answering before every process is stopped.

A process that dies leaves the others in a collective: on a CPU the collective fails at once (the peer's
connection closes), on a GPU it waits until the heartbeat timeout. :func:`exit_on_failure` then ends the
process at once with an error naming it, instead of waiting again at jax's shutdown barrier for the dead peer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
from typing import Mapping

from hetero_jax.errors import ConfigError, HeteroJaxError

ADDRESS, COUNT, RANK = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"
JAX_VARIABLES = (ADDRESS, COUNT, RANK)
SLURM_VARIABLES = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
OMPI_URI = "OMPI_MCA_orte_hnp_uri"
OMPI_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")
K8S_VARIABLES = ("KUBERNETES_SERVICE_HOST", "JOB_COMPLETION_INDEX")
HEARTBEAT = "HETERO_JAX_HEARTBEAT_S"

_FIX = (f"set all three of {ADDRESS}=HOST:PORT (process 0's host and a free port), {COUNT}=N and "
        f"{RANK}=0..N-1 in every process, or unset them to run in one process (hetero-jax launch sets them "
        "on one machine)")


class LaunchError(ConfigError):
    """Environment variables that do not describe a multi-process job (malformed, partial or contradictory)."""


@dataclasses.dataclass(frozen=True)
class ProcessSetup:
    """Where this process stands in its job.

    ``num_processes``: processes in the job (None: a Kubernetes Job, whose size jax reads from the API);
    ``process_id``: this one's rank (0 prints); ``coordinator``: host:port, None when jax's cluster detection
    finds it; ``source``: "single", "jax", "slurm", "ompi" or "k8s" (the ``cluster_detection_method``).
    """

    num_processes: int | None
    process_id: int
    coordinator: str | None
    source: str

    @property
    def distributed(self) -> bool:
        return self.num_processes is None or self.num_processes > 1


SINGLE = ProcessSetup(num_processes=1, process_id=0, coordinator=None, source="single")


def _digits(text: str) -> bool:
    """Plain decimal digits: ``int`` also takes ``1_0``, ``+3`` and non-ASCII digits, which are typos here."""
    return bool(re.fullmatch(r"[0-9]+", text))


# a hostname or IPv4 address, or a bracketed IPv6 one: no scheme, path, user or whitespace, which the
# coordinator's client would only reject after jax's 5-minute connection timeout
_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+(%[A-Za-z0-9._-]+)?\]")


def _int(env: Mapping[str, str], name: str, lo: int, hi: int | None, fix: str) -> int:
    raw = env[name]
    value = int(raw.strip()) if _digits(raw.strip()) else None
    if value is None or value < lo or (hi is not None and value > hi):
        allowed = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
        raise LaunchError(f"environment variable {name}={raw!r} is not {allowed}; {fix}")
    return value


def _address(env: Mapping[str, str], name: str) -> str:
    raw = env[name].strip()
    host, sep, port = raw.rpartition(":")
    ok = bool(sep and _HOST.fullmatch(host) and _digits(port) and 0 < int(port) < 65536)
    if not ok:
        raise LaunchError(f"environment variable {name}={env[name]!r} is not HOST:PORT (e.g. 10.0.0.1:1234, the "
                          "host of process 0 (a hostname, an IPv4 address or a bracketed IPv6 one, no scheme or "
                          "path) and a free port in [1, 65535]); " + _FIX)
    return raw


def _check_jax_extras(env: Mapping[str, str]) -> None:
    """The other variables jax reads itself: checked here so that their error names them."""
    if env.get("JAX_COORDINATOR_PORT", "").strip():
        _int(env, "JAX_COORDINATOR_PORT", 1, 65535, "give the coordinator's port, or unset it")
    ids = env.get("JAX_LOCAL_DEVICE_IDS", "").strip()
    if ids and not all(_digits(p.strip()) for p in ids.split(",")):
        raise LaunchError(f"environment variable JAX_LOCAL_DEVICE_IDS={env['JAX_LOCAL_DEVICE_IDS']!r} is not a "
                          "comma-separated list of device ids (e.g. 0,1); fix it or unset it (every local "
                          "device is used)")


def _from_jax(env: Mapping[str, str]) -> ProcessSetup | None:
    given = [v for v in JAX_VARIABLES if env.get(v, "").strip()]
    if not given or given == [ADDRESS]:  # no JAX variables, or only a cluster's coordinator override
        return None
    missing = [v for v in (COUNT, RANK) if v not in given]
    if missing:
        raise LaunchError(f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} set but "
                          f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not; " + _FIX)
    n = _int(env, COUNT, 1, None, _FIX)
    rank = _int(env, RANK, 0, n - 1, f"{RANK} must be below {COUNT}={n}; " + _FIX)
    if n == 1:
        return SINGLE
    if ADDRESS not in given:
        raise LaunchError(f"{COUNT}={n} and {RANK}={rank} are set but {ADDRESS} is not; " + _FIX)
    return ProcessSetup(num_processes=n, process_id=rank, coordinator=_address(env, ADDRESS), source="jax")


def _from_cluster(env: Mapping[str, str], address: str | None) -> ProcessSetup | None:
    if all(v in env for v in SLURM_VARIABLES):
        fix = "these are set by srun; run the command under srun, or unset the SLURM_* variables"
        n = _int(env, "SLURM_NTASKS", 1, None, fix)
        rank = _int(env, "SLURM_PROCID", 0, n - 1, fix)
        _int(env, "SLURM_LOCALID", 0, None, fix)
        if address is None:
            _int(env, "SLURM_JOB_ID", 0, None, fix)  # jax derives the coordinator's port from it
            if not env["SLURM_STEP_NODELIST"].strip():
                raise LaunchError("environment variable SLURM_STEP_NODELIST is empty (jax puts the coordinator "
                                  f"on its first node); {fix}, or set {ADDRESS}")
        return ProcessSetup(n, rank, address, "slurm") if n > 1 else SINGLE
    if OMPI_URI in env:
        fix = "these are set by Open MPI's mpirun; run the command under mpirun, or unset the OMPI_* variables"
        missing = [v for v in OMPI_VARIABLES if v not in env]
        if missing:
            raise LaunchError(f"{OMPI_URI} is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                              f"not; {fix}")
        n = _int(env, "OMPI_COMM_WORLD_SIZE", 1, None, fix)
        rank = _int(env, "OMPI_COMM_WORLD_RANK", 0, n - 1, fix)
        _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0, None, fix)
        return ProcessSetup(n, rank, address, "ompi") if n > 1 else SINGLE
    if env.get("OMPI_COMM_WORLD_SIZE", "").strip() not in ("", "1"):
        # Open MPI 5 (PRRTE) no longer sets the URI jax reads: without this refusal every rank would run alone
        raise LaunchError(f"OMPI_COMM_WORLD_SIZE={env['OMPI_COMM_WORLD_SIZE']!r} says this is one of several Open "
                          f"MPI processes, but {OMPI_URI} (where jax finds the coordinator) is not set, as under "
                          f"Open MPI 5; set {ADDRESS}=HOST:PORT, {COUNT}=$OMPI_COMM_WORLD_SIZE and "
                          f"{RANK}=$OMPI_COMM_WORLD_RANK")
    if all(env.get(v, "").strip() for v in K8S_VARIABLES):
        _int(env, "JOB_COMPLETION_INDEX", 0, None, "it is set by an Indexed Kubernetes Job; unset it")
        import importlib.util

        if importlib.util.find_spec("kubernetes") is None:
            raise LaunchError("this looks like an Indexed Kubernetes Job (KUBERNETES_SERVICE_HOST and "
                              "JOB_COMPLETION_INDEX are set), whose size and coordinator jax reads from the "
                              "Kubernetes API with the kubernetes package, which is not installed: pip install "
                              f"'jax[k8s]'; for a pod that runs alone (a one-pod job, or pods that each run their "
                              f"own work) set {COUNT}=1 and {RANK}=0; or {_FIX}")
        return ProcessSetup(None, int(env["JOB_COMPLETION_INDEX"].strip()), address, "k8s")
    return None


def process_setup(environ: Mapping[str, str] | None = None) -> ProcessSetup:
    """Where this process stands, read from ``environ`` (default ``os.environ``); pure, starts nothing.

    Raises :class:`LaunchError` for a malformed or partial set of variables (module docstring)."""
    env = os.environ if environ is None else environ
    _check_jax_extras(env)
    setup = _from_jax(env)
    if setup is not None:
        return setup
    address = _address(env, ADDRESS) if env.get(ADDRESS, "").strip() else None
    setup = _from_cluster(env, address)
    if setup is not None:
        return setup
    if address is not None:
        raise LaunchError(f"{ADDRESS} is set but {COUNT} and {RANK} are not (and no SLURM, Open MPI or "
                          "Kubernetes job supplies them); " + _FIX)
    return SINGLE


# jaxlib takes the timeout as a C int (2**31 or more is a TypeError inside jax.distributed.initialize); a wait
# longer than a day for a silent process is a typo, not a setting
MAX_HEARTBEAT_S = 86400


def heartbeat_options(environ: Mapping[str, str] | None = None) -> dict:
    """``jax.distributed.initialize``'s heartbeat timeout from ``HETERO_JAX_HEARTBEAT_S`` (none: jax's default).
    Raises :class:`LaunchError` unless it is a whole number of seconds in [1, ``MAX_HEARTBEAT_S``]."""
    raw = (os.environ if environ is None else environ).get(HEARTBEAT, "").strip()
    if not raw:
        return {}
    if not _digits(raw) or not 1 <= int(raw) <= MAX_HEARTBEAT_S:
        raise LaunchError(f"{HEARTBEAT}={raw!r} is not a whole number of seconds >= 1 (at most "
                          f"{MAX_HEARTBEAT_S}, a day); set it to how long the job may wait for a process that "
                          "stopped answering (e.g. 30), or unset it for jax's 100")
    return {"heartbeat_timeout_seconds": int(raw)}


def end_process(code: int) -> None:
    """End this process at once with exit ``code``, stdout flushed (``os._exit``: no shutdown barrier, no atexit)."""
    sys.stdout.flush()
    os._exit(code)


@contextlib.contextmanager
def exit_on_failure(setup: "ProcessSetup"):
    """In a job of several processes, an error escaping the block ends this process at once after printing which
    process failed and why: the project's own errors (``HeteroJaxError``, about the input) with ``os._exit(2)``,
    any other with ``os._exit(1)``. A collective's failure most likely means another process died, and the
    project's errors may be this process's alone (a file missing on one host) while its peers wait for it in a
    collective: a normal exit would wait at jax's shutdown barrier for the others until its timeout (300 s), then
    abort every process. In one process: nothing."""
    if not setup.distributed:
        yield
        return
    try:
        yield
    except (HeteroJaxError, NotImplementedError) as e:
        print(f"error (process {setup.process_id} of {setup.num_processes}): {e}", file=sys.stderr, flush=True)
        end_process(2)
        raise  # reached only where end_process was replaced (a test running a job's command in its own process)
    except BaseException as e:  # noqa: B036 (KeyboardInterrupt too: the peers would wait for this process)
        first = (str(e).strip().splitlines() or [""])[0][:500]
        import jax

        hint = ("another process of the job has most likely stopped: see its log"
                if isinstance(e, jax.errors.JaxRuntimeError)
                else "the other processes stop when they next need this one")
        print(f"error (process {setup.process_id} of {setup.num_processes}): {type(e).__name__}: {first}; "
              f"{hint}. This process exits now.", file=sys.stderr, flush=True)
        end_process(1)
        raise


def initialize_distributed(environ: Mapping[str, str] | None = None) -> ProcessSetup:
    """Join the job ``environ`` describes (:func:`process_setup`): ``jax.distributed.initialize`` when it has
    more than one process, nothing in a single process. Call it first, before any JAX computation; calling it
    again (or after ``jax.distributed.initialize``) returns the setup without re-joining."""
    setup = process_setup(environ)
    if not setup.distributed:
        return setup
    import jax
    from jax._src import xla_bridge

    if jax.distributed.is_initialized():
        return dataclasses.replace(setup, num_processes=jax.process_count(), process_id=jax.process_index())
    if xla_bridge.backends_are_initialized():
        raise LaunchError(f"this process is one of a multi-process job ({setup.source} variables) but JAX already "
                          "started its devices here; call hetero_jax.initialize_distributed() first, before "
                          "any JAX computation or jax.devices()")
    jax.distributed.initialize(coordinator_address=setup.coordinator, num_processes=setup.num_processes,
                               process_id=setup.process_id,
                               cluster_detection_method="deactivate" if setup.source == "jax" else setup.source,
                               **heartbeat_options(environ))
    return dataclasses.replace(setup, num_processes=jax.process_count(), process_id=jax.process_index())
