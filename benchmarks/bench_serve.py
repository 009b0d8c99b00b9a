#!/usr/bin/env python
"""The server's resumed turns: time to first token of a turn that resumes a held conversation against a fresh
prefill of the same conversation, through the HTTP API.

SmolLM2-135M, float32, one ``hetero-jax serve`` app (uvicorn in this process, 127.0.0.1, a free port), greedy.
For each history length H and policy, a conversation whose first user message is the first pydoc-corpus tokens
(sized so that the rendered first turn is about H tokens) and a question gets its answer; then a second question
is sent, with the streaming API, and compared:

- **resumed**: the same ``user`` and the first turn's messages + the answer + the new question: the server
  continues the held ``Session`` (the turn appended in chunks and, for HeteroCache, re-selected over);
- **first turn**: the conversation's own first request, a new conversation whose prefill is the history alone
  (fewer tokens than history + turn: a conservative yardstick);
- **fresh** (``--exact-fresh``): the resumed turn's messages under another ``user``, so no held conversation
  matches and the server prefills the whole conversation again.

TTFT is measured by the client: from sending the request to the first streamed text. Compile time is kept out by
running every step once untimed on its own conversation (another ``user``) before the timed ones; the timed
numbers are medians of ``--repeats`` conversations.

    .venv/bin/python benchmarks/bench_serve.py --preset cpu --write-results
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (benchmarks/common.py)
import haystack  # noqa: E402  (benchmarks/haystack.py)

SECTION = "serve"
MODEL = "smollm2-135m"
FIRST_QUESTION = "What is this text about? Answer in one sentence."
SECOND_QUESTION = "Name one Python keyword the text explains."
PRESETS = {
    "cpu": dict(lengths=[2048, 7900], policies=["full", "heterocache"], repeats=1, max_tokens=8, exact_fresh=False),
    "full": dict(lengths=[2048, 7900], policies=["full", "snapkv", "heterocache"], repeats=3, max_tokens=16,
                 exact_fresh=True),
}


def stream_chat(base: str, body: dict) -> dict:
    """One streamed chat request: time to the first text, total time, the text and the usage."""
    import httpx

    t0 = time.perf_counter()
    ttft, parts, usage = None, [], None
    with httpx.stream("POST", base + "/v1/chat/completions", json={**body, "stream": True,
                                                                    "stream_options": {"include_usage": True}},
                      timeout=1800) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.read().decode()[:500]}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices", []):
                text = ch["delta"].get("content") or ""
                if text and ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(text)
    return {"ttft_s": ttft, "total_s": time.perf_counter() - t0, "text": "".join(parts), "usage": usage}


def first_message(tok, corpus_ids: list[int], history: int) -> str:
    """The corpus' first tokens and the first question, sized so that the rendered first turn is ~``history``
    tokens."""
    def rendered_len(n):
        text = tok.decode(corpus_ids[:n]) + "\n\n" + FIRST_QUESTION
        return len(tok.encode(tok.apply_chat_template([{"role": "user", "content": text}])))

    n = history - (rendered_len(1) - 1)
    while n > 1 and rendered_len(n) > history:
        n -= max(1, rendered_len(n) - history)
    return tok.decode(corpus_ids[:n]) + "\n\n" + FIRST_QUESTION


def conversation(base: str, policy: dict, first: str, user: str, max_tokens: int, exact_fresh: bool) -> dict:
    """Turn 1 (a new conversation: the history prefilled), then turn 2 resumed, then with ``exact_fresh`` turn 2
    again under another user (history and turn prefilled). ``policy``: the request's policy fields ({}: the
    server's, full KV)."""
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, **policy}
    msgs = [{"role": "user", "content": first}]
    t1 = stream_chat(base, {**body, "messages": msgs, "user": user})
    msgs = msgs + [{"role": "assistant", "content": t1["text"]}, {"role": "user", "content": SECOND_QUESTION}]
    resumed = stream_chat(base, {**body, "messages": msgs, "user": user})
    fresh = stream_chat(base, {**body, "messages": msgs, "user": user + "-fresh"}) if exact_fresh else None
    return {"turn1": t1, "resumed": resumed, "fresh": fresh}


def run(args) -> dict:
    import hetero_jax
    from hetero_jax.serve import BackgroundServer, ServeConfig

    t_start = time.perf_counter()
    model = hetero_jax.load(args.model)
    tok = model.tokenizer
    corpus = tok.encode(haystack.pydoc_corpus())
    server = BackgroundServer(model, ServeConfig(model_id=MODEL, max_sessions=4 * len(args.policies) * len(args.lengths)))
    rows = []
    try:
        for H in args.lengths:
            first = first_message(tok, corpus, H)
            for name in args.policies:
                body_policy = {} if name == "full" else {"policy": name, "budget": args.budget}
                conversation(server.base, body_policy, first, f"warm-{name}-{H}", args.max_tokens,
                             args.exact_fresh)  # compiles every shape the timed conversations meet
                runs = [conversation(server.base, body_policy, first, f"t{i}-{name}-{H}", args.max_tokens,
                                     args.exact_fresh) for i in range(args.repeats)]
                last = runs[-1]["resumed"]["usage"]
                row = {"policy": name if name == "full" else f"{name}@{args.budget:g}",
                       "history_tokens": last["prompt_tokens_details"]["cached_tokens"],
                       "turn_tokens": last["prompt_tokens"] - last["prompt_tokens_details"]["cached_tokens"],
                       "first_turn_tokens": runs[-1]["turn1"]["usage"]["prompt_tokens"],
                       "ttft_resumed_s": statistics.median(r["resumed"]["ttft_s"] for r in runs),
                       "ttft_first_turn_s": statistics.median(r["turn1"]["ttft_s"] for r in runs),
                       "ttft_fresh_s": (statistics.median(r["fresh"]["ttft_s"] for r in runs)
                                        if args.exact_fresh else None),
                       "same_answer": (all(r["resumed"]["text"] == r["fresh"]["text"] for r in runs)
                                       if args.exact_fresh else None),
                       "answers": {k: runs[-1][k]["text"] for k in ("turn1", "resumed", "fresh") if runs[-1][k]}}
                rows.append(row)
                print(f"H={row['history_tokens']} {row['policy']}: TTFT resumed {row['ttft_resumed_s']:.3f} s, "
                      f"first turn (history prefilled) {row['ttft_first_turn_s']:.3f} s"
                      + ("" if row["ttft_fresh_s"] is None
                         else f", fresh (history + turn) {row['ttft_fresh_s']:.3f} s"),
                      flush=True)
    finally:
        server.close()
    payload = common.report_header("bench_serve", {k: (str(v) if isinstance(v, Path) else v)
                                                   for k, v in vars(args).items()})
    payload.update(rows=rows, total_seconds=time.perf_counter() - t_start, peak_rss_bytes=common.peak_rss_bytes())
    return payload


def results_table(rows) -> str:
    def num(x, fmt="{:.3f}"):
        return "—" if x is None else fmt.format(x)

    out = [[f"{r['history_tokens']:,}", r["policy"], f"{r['turn_tokens']:,}", f"{r['ttft_resumed_s']:.3f}",
            f"{r['first_turn_tokens']:,}", f"{r['ttft_first_turn_s']:.3f}",
            f"{r['ttft_first_turn_s'] / r['ttft_resumed_s']:.1f}", num(r["ttft_fresh_s"]),
            num(None if r["ttft_fresh_s"] is None else r["ttft_fresh_s"] / r["ttft_resumed_s"], "{:.1f}"),
            {None: "—", True: "yes", False: "no"}[r["same_answer"]]] for r in rows]
    return common.markdown_table(["history tok (cached)", "policy", "turn tok", "TTFT resumed s",
                                  "first turn tok", "TTFT first turn s", "first turn / resumed",
                                  "TTFT fresh s", "fresh / resumed", "same answer"], out, align="rlrrrrrrrc")


def results_section(payload: dict) -> str:
    cfg = payload["config"]
    return "\n".join([
        common.section_header(f"Server: resumed turn vs fresh prefill, {cfg['model']}", payload),
        "",
        "Time to first token through `hetero-jax serve`'s streaming chat API (uvicorn on 127.0.0.1 in the same "
        "process, measured by the client from sending the request to the first streamed text), float32, greedy, "
        f"{cfg['max_tokens']} answer tokens. A conversation's first user message is the first pydoc-corpus tokens "
        "and a question, sized to the history length ('first turn tok': the new conversation's prompt, prefilled: "
        "'TTFT first turn'); after its answer a second question **resumes** it (same `user`: the server continues "
        "the held Session, appending the turn in chunks; HeteroCache re-selects its compressed heads from the "
        "turn). 'history tok' is the resumed turn's `cached_tokens`. The first turn's prefill is of the history "
        "alone, fewer tokens than prefilling history and turn again, so 'first turn / resumed' understates the "
        "gain; 'TTFT fresh' (with `--exact-fresh`) sends the resumed turn's messages under another `user`, so the "
        "whole conversation is prefilled ('same answer': it answers as the resumed turn did). Every step ran once "
        f"untimed on its own conversation first, so compile time is not counted; median of {cfg['repeats']} "
        "conversation(s).",
        "",
        results_table(payload["rows"]),
        "",
        common.wall_and_memory_line(payload),
    ])


def parse_args(argv=None) -> argparse.Namespace:
    p = common.argument_parser(__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="'cpu': 2K and 7.9K histories, full and heterocache, 1 timed conversation each (about 5 min "
                        "on 2 cores); 'full' (used when none is given): snapkv too, 3 each. Explicit flags override it")
    p.add_argument("--lengths", type=int, nargs="+", help="history lengths (tokens of the rendered first turn)")
    common.add_compressed_policy_arguments(p)
    p.add_argument("--repeats", type=int, help="timed conversations per configuration (median)")
    p.add_argument("--max-tokens", type=int, help="answer tokens per turn")
    p.add_argument("--exact-fresh", action=argparse.BooleanOptionalAction,
                   help="also time the resumed turn's messages as a new conversation (the whole history prefilled "
                        "again; two more prefills per configuration)")
    p.add_argument("--model", default=MODEL, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=common.OUT_DIR / "serve.json", help="JSON output")
    common.add_results_arguments(p, SECTION)
    args = common.parse_compressed_policy_args(p, PRESETS, argv)
    if min(args.lengths) < 64 or max(args.lengths) > 8192 - 128 or args.repeats < 1 or args.max_tokens < 1:
        p.error("--lengths must be in [64, 8064] (the turns and answers need room in the 8192-token context), "
                "--repeats and --max-tokens >= 1")
    return args


def main(argv=None) -> int:
    common.run_table_task(parse_args(argv), run, section=SECTION, results_section=results_section,
                          results_table=results_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
