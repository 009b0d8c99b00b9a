"""One process of tests/test_multihost.py: joins an N-process jax.distributed job on CPU (gloo) from the
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID the test sets (hetero_jax.initialize_distributed),
with K simulated CPU devices, places the tiny model on a mesh that is tensor parallel over the processes and
data parallel within each, runs every policy named in HETERO_JAX_TEST_POLICIES greedy (and a session's turns
for those in HETERO_JAX_TEST_SESSIONS) and writes what it saw as JSON to HETERO_JAX_TEST_OUT (a file per process: a
record this size on a pipe the test reads one process at a time would block the others at shutdown).

With HETERO_JAX_TEST_DIE_AT=k, process 1 dies (os._exit) before decode step k of a HeteroCache run inside
``hetero_jax.exit_on_failure``, and the others report how they ended."""

import json
import os

import jax
import numpy as np
from jax.sharding import Mesh

import hetero_jax
from hetero_jax.model.sharding import per_device_bytes
from multihost_model import POLICIES, PROMPTS, STEPS, counters, session_answers, tiny_model
from tiny_model import greedy_with_logits

setup = hetero_jax.initialize_distributed()
assert setup.distributed and setup.process_id == jax.process_index()

# devices [data, model]: model axis = the processes, data axis = each process's own devices
by_process = [[d for d in jax.devices() if d.process_index == p] for p in range(jax.process_count())]
model = hetero_jax.place(tiny_model(), Mesh(np.array(by_process).T, ("data", "model")))
if os.environ.get("HETERO_JAX_TEST_DIE_AT"):
    from hetero_jax.runtime import Engine

    die_at = int(os.environ["HETERO_JAX_TEST_DIE_AT"])
    with hetero_jax.exit_on_failure(setup):
        eng = Engine(model, PROMPTS, POLICIES["heterocache"], tail_capacity=40, is_batch=True)
        tok = eng.first_tokens(0.0, 1.0)
        for step in range(32):
            if step == die_at and jax.process_index() == 1:
                os._exit(7)
            tok, _ = eng.step_with_logits(tok)
    raise SystemExit("decoded every step although a process died")
out = {"process_count": jax.process_count(), "device_count": jax.device_count(), "runs": {}}
for name in os.environ["HETERO_JAX_TEST_POLICIES"].split(","):
    toks, logits, eng = greedy_with_logits(model, POLICIES[name], PROMPTS, steps=STEPS)
    host = eng.state.host_arrays()
    run = {"tokens": toks.tolist(), "logits": logits.tolist(), "counters": counters(eng),
           "host_bytes_here": sum(sh.data.nbytes for a in host for sh in a.addressable_shards),
           "host_bytes": sum(a.nbytes for a in host), "host_bytes_per_device": per_device_bytes(host),
           "k_proj_shards": [str(s.index) for s in model.params["layers"][0]["k_proj"].addressable_shards]}
    if name == "heterocache":
        run["recall_steps"] = list(eng.state.recall_steps)
    if name in os.environ.get("HETERO_JAX_TEST_SESSIONS", "").split(","):
        run["answers"] = session_answers(model, name)
    out["runs"][name] = run
with open(os.environ["HETERO_JAX_TEST_OUT"].format(rank=jax.process_index()), "w") as f:
    json.dump(out, f)
