"""One process of tests/test_multihost.py: joins a 2-process jax.distributed job on CPU (gloo) from the
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID the test sets (hetero_jax.initialize_distributed),
places a tiny 2-KV-head model tensor-parallel over both processes' devices and prints its greedy run as JSON."""

import json

import jax

import hetero_jax
from hetero_jax.policies import HeteroCache, make_policy
from multihost_model import POLICIES, PROMPTS, two_head_model
from tiny_model import greedy_with_logits

setup = hetero_jax.initialize_distributed()
assert setup.distributed and setup.process_id == jax.process_index()

model = hetero_jax.place(two_head_model(), hetero_jax.make_mesh(tp=2, dp=1))
out = {"process_count": jax.process_count(), "device_count": jax.device_count(), "runs": {}}
for spec in POLICIES:
    toks, logits, eng = greedy_with_logits(model, make_policy(*spec), PROMPTS, steps=4)
    out["runs"][spec[0]] = {"tokens": toks.tolist(), "logits": logits.tolist(),
                            "k_proj_shards": [str(s.index) for s in model.params["layers"][0]["k_proj"].addressable_shards]}
try:
    greedy_with_logits(model, HeteroCache(budget=0.8, profile=__import__("multihost_model").PROFILE), PROMPTS)
    out["host_policy_error"] = None
except hetero_jax.HeteroJaxError as e:
    out["host_policy_error"] = str(e)
print("RESULT " + json.dumps(out), flush=True)
