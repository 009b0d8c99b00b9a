"""The pipelined decode loop (``decode_loop(pipelined=True)``, what ``generate`` runs): each step dispatched
before the previous step's tokens are read back gives the tokens, texts and stop reasons of one step at a
time, for policies with decode-time state (HeteroCache's checks and recalls, Quest's and FreeKV's page
recalls) and with a stop that ends the answer before its budget."""

import pytest

from hetero_jax.runtime import Engine
from hetero_jax.runtime.engine import decode_loop
from tiny_model import random_prompts
from test_batch_property import MODEL, VARIANTS

CASES = {"full": VARIANTS["full"][0], "heterocache": VARIANTS["heterocache"][2],  # checks every 3 steps, recalls
         "quest-offload": VARIANTS["quest"][3], "freekv": VARIANTS["freekv"][0]}


def _answer(policy, prompts, budget, stops, pipelined):
    eng = Engine(MODEL, prompts, policy, tail_capacity=budget + 2, is_batch=len(prompts) > 1)
    out = decode_loop(eng, eng.first_tokens(0.0, 1.0), budget, temperature=0.0, top_p=1.0, stops=stops,
                      on_token=None, pipelined=pipelined)
    return out, eng


@pytest.mark.parametrize("name", sorted(CASES))
def test_pipelined_decode_equals_one_step_at_a_time(name):
    prompts = random_prompts([130], seed=4)
    policy = CASES[name]([len(p) for p in prompts])
    (ids, texts, reasons, secs), eng = _answer(policy, prompts, 12, [], pipelined=False)
    (ids_p, texts_p, reasons_p, secs_p), eng_p = _answer(policy, prompts, 12, [], pipelined=True)
    assert ids_p == ids and texts_p == texts and reasons_p == reasons == ["max_new_tokens"]
    if name == "heterocache":
        assert eng_p.state.counters.recalls > 0  # the recalls happened inside the pipelined steps
    assert len(secs_p) == len(secs) == 11 and eng_p.steps == eng.steps == 11  # nothing dispatched past the budget
    # a stop string ends the answer early: the pipelined loop has dispatched one step past its end
    stop = texts[0].split(" ")[5]
    (ids, texts, reasons, secs), eng = _answer(policy, prompts, 12, [stop], pipelined=False)
    (ids_p, texts_p, reasons_p, secs_p), eng_p = _answer(policy, prompts, 12, [stop], pipelined=True)
    assert ids_p == ids and texts_p == texts and reasons_p == reasons == ["stop"]
    assert len(secs_p) == len(secs) < 11 and eng_p.steps == eng.steps + 1
