"""The benchmark scripts' defects of the measurement-flow review, each fixed: bad counts and needle lengths refused
before any work, HeteroCache's targets found under a spec with options, the roofline described as computed, an
unknown tree state never called clean, bench_offload's explicit sizes, results file and start-of-run header, each
latency preset's own files, and a merge's figure and untimed rounds told per run and row. No benchmark runs, except
one bench_offload --small of a few milliseconds."""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_latency  # noqa: E402
import bench_needle  # noqa: E402
import bench_offload  # noqa: E402
import haystack  # noqa: E402
from harness import latency_report as lr  # noqa: E402
from harness import machine as hm  # noqa: E402
from harness.needles import make_needle  # noqa: E402
from harness.results import OUT_DIR, RESULTS_MD  # noqa: E402
from harness.roofline import add_ratios, target_check  # noqa: E402
from bench_cases import MACHINE, usage_error  # noqa: E402


def _boom(what):
    def boom(*a, **k):
        raise AssertionError(f"{what} for input that should have been refused")
    return boom


# ------------------------------------------------------------------ 1. --decode-block
@pytest.mark.parametrize("block", ["0", "-1"])
def test_latency_decode_block_below_one_is_refused_before_the_model_loads(capsys, monkeypatch, block):
    import hetero_jax

    monkeypatch.setattr(hetero_jax, "load", _boom("the model loaded"))
    monkeypatch.setattr(bench_latency, "run", _boom("the run started"))  # the old loop never ended with 0
    usage_error(capsys, bench_latency.main, ["--real-lengths", "64", "--synthetic-lengths", "--policies", "full",
                                            "--decode-block", block], "--decode-block", "must be >= 1")


# ------------------------------------------------------------------ 2. targets under a spec with options
def _row(policy, rho, length, ratio=0.6, roof=0.59, ttft_ratio=1.02, tail=1.2):
    label = "full" if policy == "full" else f"{policy}@{rho:g}"
    return {"label": label, "policy": policy, "rho": rho, "length": length, "weights": "synthetic",
            "decode_ratio_p50": ratio, "roofline_ratio": roof, "measured_over_roofline": ratio / roof,
            "within_10pct": abs(ratio / roof - 1) <= 0.1, "ttft_ratio": ttft_ratio, "decode": {"p99_over_p50": tail}}


def test_targets_are_checked_on_heterocache_with_options():
    # the latency-long-copy-window preset's rows: full KV and HeteroCache with its copy window, 16K and 32K
    runs = [_row("full", 1.0, 16384), _row("heterocache:copy_window=16", 0.3, 16384, tail=3.0),
            _row("full", 1.0, 32768), _row("heterocache:copy_window=16", 0.3, 32768, 0.62, 0.59, 0.94, 1.74)]
    t = target_check(runs)
    assert t["measured"] and t["length"] == 32768 and t["policy"] == "heterocache:copy_window=16"
    assert t["decode_ratio_p50"] == 0.62 and t["ttft_ratio"] == 0.94 and t["p99_over_p50"] == 1.74
    assert t["decode_within_10pct_of_roofline"] and t["ttft_at_most_5pct_above_full"]  # 0.62 / 0.59 = 1.051
    assert not t["p99_over_p50_at_most_1_5"] and not t["all_met"]
    text = lr.targets_text(t)
    assert text.startswith("Targets for HeteroCache (`heterocache:copy_window=16`) rho 0.3 at the longest context "
                           "measured (32,768 (synthetic) tokens):")
    # the name as make_policy reads it (case, '-', '_'); the plain spec first where both ran at the longest length
    assert target_check([_row("Hetero-Cache", 0.3, 4096)])["length"] == 4096
    both = target_check([_row("heterocache:copy_window=16", 0.3, 4096, ratio=0.9),
                         _row("heterocache", 0.3, 4096, ratio=0.7)])
    assert both["policy"] == "heterocache" and both["decode_ratio_p50"] == 0.7
    assert lr.targets_text(both).startswith("Targets for HeteroCache rho 0.3 at")
    assert target_check([_row("snapkv", 0.3, 4096), _row("heterocache:copy_window=16", 0.5, 4096)]) == \
        {"measured": False}


# ------------------------------------------------------------------ latency results by hand
def _lat_run(length, label, p50, weights="real", read=None):
    policy, _, rho = label.partition("@")
    return {"length": length, "weights": weights, "label": label, "policy": policy, "rho": float(rho or 1),
            "achieved_rho": 1.0 if policy == "full" else 0.3, "ttft_median_seconds": 1.0, "ttft_ratio": 1.0,
            "decode": {"mean_ms": p50, "p50_ms": p50, "p95_ms": p50, "p99_ms": p50, "p99_over_p50": 1.0},
            "kv_bytes_device": 2**20, "kv_bytes_host": 0,
            "kv_bytes_read_per_step": length * 1000 if read is None else read,
            "decode_ratio_p50": 1.0, "roofline_ratio": 1.0, "measured_over_roofline": 1.0, "within_10pct": True}


def _lat_part(tmp_path, name, length, *, weights="real", ttft_warmup=0, commit="aaaaaaa", machine=MACHINE,
              preset=None):
    config = {"model": "smollm2-135m", "dtype": "float32",
              "real_lengths": [length] if weights == "real" else [],
              "synthetic_lengths": [length] if weights == "synthetic" else [],
              "policies": ["full", "snapkv"], "budgets": [0.3], "decode_steps": 4, "warmup_steps": 0,
              "ttft_warmup": ttft_warmup, "ttft_repeats": 1, "decode_block": 2, "seed": 0, "preset": preset,
              "out": f"{name}.json", "plot": f"{name}.png"}
    payload = {"benchmark": "latency", "timestamp": f"time-{name}", "command": f"python bench_latency.py --run {name}",
               "config": config, "machine": machine, "git": {"commit": commit, "dirty": False, "changed_files": []},
               "load_seconds": 1.0, "refused": {},
               "lengths": [{"length": length, "weights": weights, "max_position_embeddings": 8192,
                            "weight_bytes_per_token": 2**20, "tail_capacity": 128}],
               "runs": [_lat_run(length, "full", 10.0, weights), _lat_run(length, "snapkv@0.3", 9.0, weights)],
               "targets": {"measured": False}, "total_seconds": 30.0, "peak_rss_bytes": 2**20}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(payload))
    return path


def _merge_ns(tmp_path, *files):
    return argparse.Namespace(merge=list(files), out=tmp_path / "m.json", plot=tmp_path / "m.png", preset=None)


# ------------------------------------------------------------------ 3. the roofline as computed
def test_roofline_text_describes_the_bytes_read_per_step_the_ratio_divides():
    # device KV equal (Quest keeps the pool), bytes read not: the ratio follows the bytes read, by hand
    W = 513 * 2**20
    rows = [_lat_run(2048, "full", 10.0, read=95 * 2**20), _lat_run(2048, "quest@0.3", 9.0, read=40 * 2**20)]
    add_ratios(rows, W)
    assert rows[1]["roofline_ratio"] == pytest.approx((513 + 40) / (513 + 95), rel=1e-12)
    assert rows[1]["kv_bytes_device"] == rows[0]["kv_bytes_device"]  # the device KV would give 1.0
    payload = {"config": {"model": "smollm2-135m", "dtype": "float32", "real_lengths": [2048], "synthetic_lengths": [],
                          "seed": 0, "ttft_warmup": 1, "ttft_repeats": 1, "decode_block": 10, "warmup_steps": 6,
                          "decode_steps": 32, "preset": "issue17", "plot": "p.png"},
               "lengths": [{"length": 2048, "weights": "real", "weight_bytes_per_token": W,
                            "max_position_embeddings": 8192, "tail_capacity": 128}],
               "runs": rows, "targets": {"measured": False}, "refused": {}, "git": {"commit": "c", "dirty": False},
               "machine": MACHINE, "command": "c", "timestamp": "t", "total_seconds": 1.0, "peak_rss_bytes": 1}
    text = lr.results_section(payload, None)
    assert "device KV bytes" not in text and "device KV = " not in text
    assert ("Roofline ratio = (weight bytes + the KV bytes one decode step of the policy reads) / (weight bytes + "
            "full KV's)") in text
    assert ("KV bytes read (`kv_bytes_read_per_step` in the JSON, not the 'KV device MiB' column) = the row pool as "
            "allocated (every head's kept prompt rows + its rows for added tokens, 128 per head) + the policy's index "
            "arrays + the rows it fetches from host memory per step, counted twice") in text
    assert "| 0.91 |" in text  # (513 + 40) / (513 + 95) = 0.9095, the column the text describes


# ------------------------------------------------------------------ 4. an unknown tree state
def test_an_unknown_tree_state_is_not_called_clean(monkeypatch):
    assert hm.git_summary({"commit": "a7c95bc", "dirty": None, "changed_files": []}) == "a7c95bc (tree state unknown)"
    assert hm.git_summary({"commit": "a7c95bc"}) == "a7c95bc (tree state unknown)"  # an older file without it
    assert hm.git_summary({"commit": "a7c95bc", "dirty": False, "changed_files": []}) == "a7c95bc (clean)"
    assert hm.git_summary({"commit": "a7c95bc", "dirty": True, "changed_files": ["x"]}) == \
        "a7c95bc (dirty: 1 changed/untracked paths)"
    monkeypatch.setenv("HETERO_JAX_COMMIT", "a7c95bc")  # what gpu_session.sh sets on a lent machine
    g = hm.git_info()
    assert g["commit"] == "a7c95bc" and g["dirty"] is None
    assert hm.git_summary(g) == "a7c95bc (from HETERO_JAX_COMMIT; tree state unknown)"


# ------------------------------------------------------------------ 5, 7. bench_offload's arguments
class _Ran(Exception):
    pass


def _offload_args(monkeypatch, argv) -> argparse.Namespace:
    """The arguments bench_offload.main runs with (its run replaced by one that stops there)."""
    def run(args):
        raise _Ran(args)
    monkeypatch.setattr(bench_offload, "run", run)
    monkeypatch.setattr(hm, "machine_info", lambda: MACHINE)
    with pytest.raises(_Ran) as e:
        bench_offload.main(argv)
    return e.value.args[0]


def test_offload_small_keeps_explicit_rows_and_d2h_tokens(monkeypatch, tmp_path):
    out = ["--out", str(tmp_path / "o.json")]
    a = _offload_args(monkeypatch, ["--small", "--rows", "8", "--d2h-tokens", "128", *out])
    assert (a.prompt, a.rows, a.d2h_tokens) == (1024, [8], [128])
    a = _offload_args(monkeypatch, ["--small", "--prompt", "131072", *out])  # the full size, asked for
    assert (a.prompt, a.rows, a.d2h_tokens) == (131072, [16, 64], [256])
    a = _offload_args(monkeypatch, ["--small", "--d2h-tokens", *out])  # none: no prefill offload timing
    assert (a.prompt, a.rows, a.d2h_tokens) == (1024, [16, 64], [])
    a = _offload_args(monkeypatch, out)
    assert (a.prompt, a.rows, a.d2h_tokens) == (131072, [256, 1024, 4096], [8192, 16384, 32768])


@pytest.mark.parametrize("argv", [["--rows", "0", "--prompt", "4096"], ["--small", "--recall-layers", "0"],
                                  ["--small", "--iters", "0"], ["--small", "--warmup", "-1", "--iters", "1"],
                                  ["--small", "--rows", "-3"], ["--small", "--prompt", "0"],
                                  ["--small", "--d2h-tokens", "0"]])
def test_offload_bad_counts_are_usage_errors_before_any_work(capsys, monkeypatch, tmp_path, argv):
    monkeypatch.setattr(bench_offload, "run", _boom("the run started"))
    flag = next(a for a in argv[::-1] if a.startswith("--") and a != "--small")
    line = usage_error(capsys, bench_offload.main, [*argv, "--out", str(tmp_path / "o.json")], flag)
    assert "must be >= 1" in line


# ------------------------------------------------------------------ 6. bench_offload's results file and section
def test_offload_writes_the_results_file_and_section_given(tmp_path, capsys, monkeypatch):
    before = RESULTS_MD.read_bytes()
    results = tmp_path / "R.md"
    results.write_text("# r\n\n<!-- BEGIN offload -->\nthe measured table\n<!-- END offload -->\n")
    tiny = ["--small", "--rows", "8", "--d2h-tokens", "64", "--iters", "1", "--warmup", "0", "--dtype", "float32"]
    assert bench_offload.main([*tiny, "--out", str(tmp_path / "o.json"), "--write-results", "--results-file",
                               str(results), "--section", "offload-smoke"]) == 0
    text = results.read_text()
    assert "the measured table" in text and "<!-- BEGIN offload-smoke -->" in text
    assert "## Host offload" in text.split("<!-- BEGIN offload-smoke -->")[1]
    assert f"updated section 'offload-smoke' of {results}" in capsys.readouterr().out
    # a smoke test never replaces the measured section of the repo's RESULTS.md without --section
    monkeypatch.setattr(bench_offload, "run", _boom("the run started"))
    usage_error(capsys, bench_offload.main, [*tiny, "--out", str(tmp_path / "o2.json"), "--write-results"],
                 "--small numbers mean nothing", "--section offload-NAME")
    usage_error(capsys, bench_offload.main, [*tiny, "--out", str(tmp_path / "o2.json"), "--section", "offload-x"],
                 "add --write-results")
    usage_error(capsys, bench_offload.main, [*tiny, "--out", str(tmp_path / "o2.json"), "--write-results",
                                             "--section", "latency"], "give 'offload' or 'offload-'")
    assert RESULTS_MD.read_bytes() == before


# ------------------------------------------------------------------ 12. bench_offload's header at the start
def test_offload_records_the_commit_and_time_its_run_started_at(tmp_path, monkeypatch):
    state = {"ran": False}
    monkeypatch.setattr(hm, "git_info", lambda: {"commit": "end" if state["ran"] else "start", "dirty": False,
                                                 "changed_files": []})
    monkeypatch.setattr(hm, "now_iso", lambda: "end-time" if state["ran"] else "start-time")
    monkeypatch.setattr(hm, "machine_info", lambda: MACHINE)

    def run(args):
        state["ran"] = True  # the tree moved on while the run ran
        return dict(shapes=bench_offload.SMALL, prompt_tokens=1024, recall_layers=4, dtype="float32", device="cpu",
                    host_store_bytes=1, staging_pinned=False, pinned_memory_kind="device", rows=[], d2h=[],
                    overlap=None)
    monkeypatch.setattr(bench_offload, "run", run)
    out = tmp_path / "o.json"
    assert bench_offload.main(["--small", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert state["ran"] and payload["git"]["commit"] == "start" and payload["timestamp"] == "start-time"
    assert "- Commit: start (clean)" in payload["markdown"] and "- Date: start-time" in payload["markdown"]


# ------------------------------------------------------------------ 8. needle lengths below the prompt
@pytest.fixture(scope="module")
def smollm2_checkpoint(request) -> str:
    """SmolLM2's converted checkpoint (the cache's, or the suite's conversion): its tokenizer is read alone."""
    from hetero_jax.io import hub
    from hetero_jax.io.checkpoint import is_checkpoint

    path = os.path.join(hub.cache_dir(), "smollm2-135m")
    return path if is_checkpoint(path) else request.getfixturevalue("smollm2_dir")


def _needle_argv(tmp_path, *lengths, extra=()):
    return ["--lengths", *map(str, lengths), "--depths", "0.5", "--policies", "full", "--haystacks", "pydoc",
            "--seeds", "0", "1", "--out", str(tmp_path / "n.json"), *extra]


@pytest.mark.parametrize("kind", ["magic-number", "passkey"])
def test_needle_length_below_the_prompt_is_refused_before_the_load(tmp_path, capsys, monkeypatch, smollm2_checkpoint,
                                                                   tokenizer, kind):
    import hetero_jax

    monkeypatch.setattr(hetero_jax, "load", _boom("the model loaded"))
    line = usage_error(capsys, bench_needle.main,
                        _needle_argv(tmp_path, 20, 4000, extra=["--needle", kind, "--model", smollm2_checkpoint]),
                        f"--lengths 20: a {kind} needle prompt (needle and question in the chat template) takes ")
    least = int(line.rsplit("give lengths of at least ", 1)[1])
    # the independent reference: haystack.build_needle_prompt builds the smallest length named and refuses one less
    for seed in (0, 1):
        n = make_needle(kind, seed)
        assert haystack.build_needle_prompt(tokenizer, least, [(0.5, n.sentence)], n.question, n.answer,
                                            seed=seed).n_tokens == least
        with pytest.raises(ValueError, match="smaller than the prompt without haystack"):
            haystack.build_needle_prompt(tokenizer, least - 1, [(0.5, n.sentence)], n.question, n.answer, seed=seed)
    bench_needle.parse_args(_needle_argv(tmp_path, least, extra=["--needle", kind, "--model", smollm2_checkpoint]))


def test_needle_length_below_the_prompt_is_refused_right_after_a_load_that_converts(tmp_path, monkeypatch,
                                                                                    tokenizer):
    # no checkpoint on disk yet (the load converts it): refused as soon as the tokenizer is there, before any prompt
    monkeypatch.setattr(bench_needle, "saved_tokenizer", lambda model: None, raising=False)
    model = types.SimpleNamespace(tokenizer=tokenizer, config=types.SimpleNamespace(max_position_embeddings=8192,
                                                                                    eos_token_ids=()))
    combos = types.SimpleNamespace(refused={}, runnable_somewhere=lambda lengths: combos)
    monkeypatch.setattr(bench_needle.grid, "load", lambda args, lengths: (model, combos, 1.0))
    monkeypatch.setattr(bench_needle.haystack, "build_needle_prompt", _boom("a prompt was built"))
    with pytest.raises(SystemExit, match=r"--lengths 20: a magic-number needle prompt .* takes 55 tokens before "
                                         r"any haystack; give lengths of at least 55"):
        bench_needle.main(_needle_argv(tmp_path, 20, 4000))


# ------------------------------------------------------------------ 9. each latency preset its own files
def test_latency_default_outputs_are_per_preset(tmp_path):
    def outs(*argv):
        a = bench_latency.parse_args(list(argv))
        return a.out, a.plot
    assert outs("--preset", "cpu") == (OUT_DIR / "latency.json", OUT_DIR / "latency.png")  # what make bench cites
    assert outs() == (OUT_DIR / "latency-full.json", OUT_DIR / "latency-full.png")
    assert outs("--preset", "long") == (OUT_DIR / "latency-long.json", OUT_DIR / "latency-long.png")
    assert outs("--preset", "long", "--plot", str(tmp_path / "p.png")) == (OUT_DIR / "latency-long.json",
                                                                           tmp_path / "p.png")
    assert outs("--preset", "long", "--out", str(tmp_path / "l.json")) == (tmp_path / "l.json", tmp_path / "l.png")
    # a merge: its runs' preset, '-merged' (never the file of a run of that preset, which may be one of its inputs)
    a, b = _lat_part(tmp_path, "a", 256, preset="long"), _lat_part(tmp_path, "b", 512, preset="long")
    assert outs("--merge", str(a), str(b)) == (OUT_DIR / "latency-long-merged.json",
                                               OUT_DIR / "latency-long-merged.png")
    c = _lat_part(tmp_path, "c", 256, preset="cpu")
    assert outs("--merge", str(c)) == (OUT_DIR / "latency-merged.json", OUT_DIR / "latency-merged.png")


# ------------------------------------------------------------------ 10. a merge's figure
def _merged_title(tmp_path, monkeypatch, *parts) -> str:
    monkeypatch.setattr(hm, "git_info", lambda: {"commit": "ccccccc", "dirty": False, "changed_files": []})
    titles = []

    def save_figure(fig, path, title, **kw):
        import matplotlib.pyplot as plt

        plt.close(fig)
        titles.append(title)
        return path
    monkeypatch.setattr(lr, "save_figure", save_figure)
    payload = lr.merge(_merge_ns(tmp_path, *parts))
    assert payload["git"]["commit"] == "ccccccc"  # the merge's own, in its header
    lr.make_plot(payload, tmp_path / "m.png")
    return titles[0]


def test_merge_figure_names_its_runs_commits_and_machines(tmp_path, monkeypatch):
    other = {**MACHINE, "cpu_model": "Other CPU"}
    title = _merged_title(tmp_path, monkeypatch, _lat_part(tmp_path, "a", 256, commit="aaaaaaa"),
                          _lat_part(tmp_path, "b", 512, commit="bbbbbbb", machine=other))
    assert title == ("Latency per policy — smollm2-135m float32, runs at 2 commits (aaaaaaa (clean); bbbbbbb "
                     "(clean)), 2 different machines")
    title = _merged_title(tmp_path, monkeypatch, _lat_part(tmp_path, "c", 256), _lat_part(tmp_path, "d", 512))
    assert title == "Latency per policy — smollm2-135m float32, aaaaaaa (clean), Test CPU"
    title = _merged_title(tmp_path, monkeypatch, _lat_part(tmp_path, "e", 256),
                          _lat_part(tmp_path, "f", 4096, weights="synthetic"))
    assert title.startswith("Latency per policy (hollow markers, dashed: synthetic random weights) — ")


# ------------------------------------------------------------------ 11. a merge's untimed rounds per row kind
def test_merge_untimed_rounds_are_per_length_and_weights(tmp_path):
    real = _lat_part(tmp_path, "real", 256, ttft_warmup=1)
    synth = _lat_part(tmp_path, "synth", 256, weights="synthetic", ttft_warmup=0)
    cfg = lr.merge(_merge_ns(tmp_path, real, synth))["config"]
    assert cfg["ttft_warmup_per_length"] == {"256": 1, "256 (synthetic)": 0}
    assert lr.warmup_text(cfg) == "untimed round(s) 256: 1, 256 (synthetic): 0"
    merged = tmp_path / "merged.json"  # a merge of that merge keeps each row kind's own count
    merged.write_text(json.dumps(lr.merge(_merge_ns(tmp_path, real, synth)) | {"benchmark": "latency"}))
    again = lr.merge(_merge_ns(tmp_path, merged, _lat_part(tmp_path, "more", 512, ttft_warmup=1)))["config"]
    assert again["ttft_warmup_per_length"] == {"256": 1, "256 (synthetic)": 0, "512": 1}
