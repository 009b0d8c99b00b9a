"""Two and three processes joined by jax.distributed on CPU, each with two simulated devices, run one model
tensor parallel over the processes and data parallel within each: every policy, those with host copies
included, gives one process's greedy tokens, logits (1e-4) and counters; each process holds in its host memory
only its own heads' share of the host copy; HeteroCache's forced recalls fire at the same steps in every
process; sessions answer as on one device."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from hetero_jax.launch import free_port, process_env
from multihost_model import EXERCISED, POLICIES, PROMPTS, STEPS, counters, session_answers, tiny_model
from tiny_model import greedy_with_logits

HERE = os.path.dirname(os.path.abspath(__file__))
_ONE: dict = {}


def one_process(name, session: bool):
    """(tokens, logits, counters, recall steps, session answers or None) of ``name`` on one device."""
    key = (name, session)
    if key not in _ONE:
        model = tiny_model()
        toks, logits, eng = greedy_with_logits(model, POLICIES[name], PROMPTS, steps=STEPS)
        _ONE[key] = (toks, logits, counters(eng), list(getattr(eng.state, "recall_steps", [])),
                     session_answers(model, name) if session else None)
    return _ONE[key]


def start_workers(tmp_path, n: int, devices_per_process: int, **variables) -> tuple[list, list]:
    """``n`` worker processes of ``devices_per_process`` CPU devices each, with ``variables`` in their
    environment: (processes, their log files). Output goes to files: a process blocked on a full pipe would
    hold the others at the job's shutdown barrier."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE, os.environ.get("PYTHONPATH", "")]),
               **variables)
    logs = [tmp_path / f"log-{i}.txt" for i in range(n)]
    procs = []
    for i, log in enumerate(logs):
        with open(log, "w") as f:  # the child keeps its own copy of the descriptor
            procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "multihost_worker.py")],
                                          env=process_env(env, n, i, port, devices_per_process), stdout=f,
                                          stderr=subprocess.STDOUT))
    return procs, logs


def run_job(tmp_path, n: int, devices_per_process: int, policies, sessions) -> list[dict]:
    """Run ``policies`` over ``n`` worker processes (``sessions``: those that also run a session), compute the
    one-process runs while they work, and return the workers' records."""
    procs, logs = start_workers(tmp_path, n, devices_per_process, HETERO_JAX_TEST_POLICIES=",".join(policies),
                                HETERO_JAX_TEST_SESSIONS=",".join(sessions),
                                HETERO_JAX_TEST_OUT=str(tmp_path / "run-{rank}.json"))
    try:
        for name in policies:
            one_process(name, name in sessions)
        for p, log in zip(procs, logs):
            assert p.wait(timeout=600) == 0, log.read_text()[-4000:]
    finally:
        for p in procs:
            p.kill()
    return [json.loads((tmp_path / f"run-{i}.json").read_text()) for i in range(n)]


def check_job(outs, n: int, policies, sessions) -> None:
    for out in outs:
        assert out["process_count"] == n and out["device_count"] == 2 * n
    for name in policies:
        toks, logits, want_counters, recall_steps, answers = one_process(name, name in sessions)
        for rank, out in enumerate(outs):
            run = out["runs"][name]
            np.testing.assert_array_equal(np.array(run["tokens"]), toks, err_msg=f"{name}, process {rank}")
            np.testing.assert_allclose(np.array(run["logits"]), logits, atol=1e-4, rtol=0, err_msg=name)
            assert run["counters"] == want_counters, (name, rank)
            assert len(run["k_proj_shards"]) == 2  # the process's two devices hold one shard of the heads
            # each process's host memory holds its own heads' share of the host copy, never the whole
            assert run["host_bytes_here"] * n == run["host_bytes"], (name, rank, run["host_bytes_here"])
            # and every process sees where all of it lies: each of the job's devices, other processes' included
            per_device = run["host_bytes_per_device"]
            assert not run["host_bytes"] or (len(per_device) == 2 * n and sum(per_device.values()) ==
                                             run["host_bytes"]), (name, rank, per_device)
            if name == "heterocache":
                assert run["recall_steps"] == recall_steps  # the same recalls, at the same steps, everywhere
            if answers is not None:
                assert run["answers"] == answers, (name, rank)
        for key in EXERCISED.get(name, ()):
            assert want_counters[key] > 0, (name, key, want_counters)
        assert bool(outs[0]["runs"][name]["host_bytes"]) == (name in EXERCISED), name
    assert len({tuple(out["runs"][policies[0]]["k_proj_shards"]) for out in outs}) == n


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path):
    """Every policy over two processes (tp 2 over the processes x dp 2 within each); HeteroCache and FreeKV also
    answer a session's two turns."""
    policies, sessions = list(POLICIES), ("heterocache", "freekv")
    check_job(run_job(tmp_path, 2, 2, policies, sessions), 2, policies, sessions)


@pytest.mark.slow
def test_three_processes_equal_one(tmp_path):
    """The policies with host copies of rows over three processes (tp 3 x dp 2: two heads a process), HeteroCache
    with a session's two turns (HCAttention's in-step sums are the per-device callbacks FreeKV's turns use)."""
    policies, sessions = ["heterocache", "synckv", "freekv", "quest-offload"], ("heterocache",)
    check_job(run_job(tmp_path, 3, 2, policies, sessions), 3, policies, sessions)


@pytest.mark.slow
def test_a_dying_process_ends_the_others_with_a_clear_error(tmp_path):
    """Process 1 of two dies mid-decode (HeteroCache, recalls in flight): process 0's next collective fails and
    ``exit_on_failure`` ends it at once with an error naming it, well before jax's 100 s heartbeat timeout,
    where a plain exit would wait at the shutdown barrier for the dead process."""
    procs, logs = start_workers(tmp_path, 2, 2, HETERO_JAX_TEST_DIE_AT="3")
    try:
        assert procs[1].wait(timeout=300) == 7
        died = time.monotonic()
        assert procs[0].wait(timeout=60) == 1, logs[0].read_text()[-3000:]
        assert time.monotonic() - died < 30
    finally:
        for p in procs:
            p.kill()
    assert "error (process 0 of 2): JaxRuntimeError" in logs[0].read_text()
    assert "another process of the job has most likely stopped" in logs[0].read_text()
