"""Runs tests/mesh_cases.py on 6 simulated CPU devices in a fresh process (XLA_FLAGS only acts before JAX
starts, and this process already runs on one device)."""

import os

import pytest

from case_files import run_case_file


# Two halves of about the same CPU time, each its own process, so that two pytest-xdist workers share them;
# the second is the first's complement, so every case runs once.
FIRST_HALF = "greedy_and_logits or heterocache_rows or host_fetching"
HALVES = {"greedy, recalls and turns": FIRST_HALF, "peers, placement and loading": f"not ({FIRST_HALF})"}


@pytest.mark.slow
@pytest.mark.parametrize("half", list(HALVES))
def test_mesh_cases_on_six_simulated_devices(half):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=6").strip()
    run_case_file("mesh_cases.py", "-k", HALVES[half], env=env)
