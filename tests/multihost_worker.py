"""One process of tests/test_multihost.py: joins a 2-process jax.distributed job on CPU (gloo), places
a tiny 2-KV-head model tensor-parallel over both processes' devices and prints its greedy run as JSON."""

import json
import sys

import jax

process_id, port = int(sys.argv[1]), sys.argv[2]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id)

import hetero_jax  # noqa: E402
from hetero_jax.policies import HeteroCache, make_policy  # noqa: E402
from multihost_model import POLICIES, PROMPTS, two_head_model  # noqa: E402
from tiny_model import greedy_with_logits  # noqa: E402

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
