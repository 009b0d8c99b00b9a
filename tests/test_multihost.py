"""Two processes joined by jax.distributed on CPU run one tensor-parallel model: same greedy tokens and
logits (1e-4) as one process alone; a policy with host copies is refused with the fix named."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hetero_jax.launch import free_port as _free_port, process_env
from hetero_jax.policies import make_policy
from multihost_model import POLICIES, PROMPTS, two_head_model
from tiny_model import greedy_with_logits

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.slow
def test_two_processes_equal_one():
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE,
                                                       os.environ.get("PYTHONPATH", "")]))
    env.pop("XLA_FLAGS", None)  # one CPU device per process: the mesh spans both processes
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "multihost_worker.py")],
                              env=process_env(env, 2, i, port, None),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, text[-4000:]
        outs.append(json.loads([line for line in text.splitlines() if line.startswith("RESULT ")][-1][7:]))
    model = two_head_model()
    for out in outs:
        assert out["process_count"] == 2 and out["device_count"] == 2
        for spec in POLICIES:
            toks, logits, _ = greedy_with_logits(model, make_policy(*spec), PROMPTS, steps=4)
            run = out["runs"][spec[0]]
            np.testing.assert_array_equal(np.array(run["tokens"]), toks)
            np.testing.assert_allclose(np.array(run["logits"]), logits, atol=1e-4, rtol=0)
            assert len(run["k_proj_shards"]) == 1  # each process holds one of the two KV-head shards
        assert "keeps host copies" in out["host_policy_error"] and "one process with several devices" in \
            out["host_policy_error"]
    assert outs[0]["runs"]["full"]["k_proj_shards"] != outs[1]["runs"]["full"]["k_proj_shards"]
