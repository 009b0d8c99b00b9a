"""The hetero-jax console script."""

import os
import re
import subprocess
import sys

import pytest

from hetero_jax.cli import main


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("generate", "serve", "models"):
        assert cmd in out


def test_generate_prints_answer_then_stats(tiny_checkpoint, capsys):
    _, ours = tiny_checkpoint("llama")
    assert main(["generate", "--model", ours, "--prompt", "the quick brown fox", "--max-new-tokens", "5",
                 "--no-chat", "--no-stream"]) == 0
    lines = capsys.readouterr().out.rstrip("\n").split("\n")
    assert lines[-1].startswith("[stats] prompt ") and "ms/tok" in lines[-1] and "KV device" in lines[-1]


def test_generate_with_policy_options(tiny_checkpoint, capsys):
    """--option passes a policy's own options: offloaded Quest reports the pages it recalled between steps."""
    _, ours = tiny_checkpoint("llama")
    assert main(["generate", "--model", ours, "--prompt", "the quick brown fox jumps over the lazy dog " * 8,
                 "--max-new-tokens", "3", "--no-chat", "--no-stream", "--policy", "quest", "--budget", "0.9",
                 "--option", "offload=true", "--option", "page-size=4", "--option", "full_layers=1"]) == 0
    stats = capsys.readouterr().out.rstrip("\n").split("\n")[-1]
    assert re.search(r"recalled \d+ pages \([0-9.]+ MiB\) between steps", stats), stats


def test_generate_prompt_file_and_errors(tiny_checkpoint, tmp_path, capsys):
    _, ours = tiny_checkpoint("llama")
    f = tmp_path / "p.txt"
    f.write_text("the lazy dog")
    assert main(["generate", "--model", ours, "--prompt-file", str(f), "--max-new-tokens", "3", "--no-chat"]) == 0
    capsys.readouterr()
    assert main(["generate", "--model", ours, "--prompt", "", "--no-chat"]) == 2
    assert "error: empty prompt" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"]) == 2
    assert "unknown model" in capsys.readouterr().err
    # a missing file is the project's error (exit 2, message names the file), not a bare SystemExit
    assert main(["generate", "--model", ours, "--prompt-file", str(tmp_path / "missing.txt")]) == 2
    assert f"prompt file not found: {str(tmp_path / 'missing.txt')!r}" in capsys.readouterr().err


def test_console_script_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "hetero_jax.cli", "models"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "smollm2-135m" in out.stdout


def test_heterocache_flags_are_refused_for_other_policies(capsys):
    for flag in (["--window", "3"], ["--tau-drift", "0.3"], ["--select-window", "1"]):
        assert main(["generate", "--policy", "snapkv", "--prompt", "hi", *flag]) == 2
        assert (f"error: {flag[0]} applies to --policy heterocache; give --policy snapkv's options as --option "
                "KEY=VALUE") in capsys.readouterr().err
    assert main(["generate", "--policy", "quest", "--prompt", "hi", "--profile", "p.json"]) == 2
    assert ("error: --profile applies to --policy heterocache, synckv and profiledsnapkv; give --policy quest's "
            "options as --option KEY=VALUE") in capsys.readouterr().err


@pytest.mark.parametrize("argv, noted", [(["--policy", "snapkv"], True), (["--policy", "streamingllm:sinks=8"], True),
                                          (["--policy", "snapkv", "--budget", "1"], False),
                                          (["--policy", "heterocache"], False), (["--policy", "full"], False)])
def test_a_compressing_policy_at_its_default_budget_of_one_says_so(monkeypatch, capsys, argv, noted):
    """--policy snapkv without --budget ran at 1.0 (no compression) without a word, where heterocache's default
    is 0.3; --policy list gives each default."""
    import hetero_jax
    from hetero_jax.profile import ProfileError

    def stop(*a, **k):
        raise ProfileError("reached the model load")
    monkeypatch.setattr(hetero_jax, "load", stop)
    assert main(["generate", *argv, "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert ("without --budget keeps the whole prompt (its default budget is 1); give --budget RHO" in err) is noted
    assert main(["generate", "--policy", "list"]) == 0
    listed = capsys.readouterr().out
    assert "[default budget 1]" in listed and "[default budget 0.3]" in listed


@pytest.mark.parametrize("argv, note", [
    (["--top-p", "0.01"], "note: --top-p has no effect at --temperature 0 (greedy); give --temperature > 0 to sample"),
    (["--top-p", "0.5", "--seed", "3"], "note: --top-p and --seed have no effect at --temperature 0 (greedy)"),
    (["--seed", "0"], "note: --seed has no effect"),
    (["--top-p", "0.5", "--seed", "3", "--temperature", "0.7"], None), ([], None)])
def test_sampling_flags_that_greedy_decoding_ignores_say_so(monkeypatch, capsys, argv, note):
    """--top-p 0.01 --seed 123 gave the greedy answer without a word (the default temperature is 0)."""
    import hetero_jax
    from hetero_jax.profile import ProfileError

    def stop(*a, **k):
        raise ProfileError("reached the model load")
    monkeypatch.setattr(hetero_jax, "load", stop)
    assert main(["generate", "--prompt", "hi", *argv]) == 2
    err = capsys.readouterr().err
    assert (note in err) if note else ("note:" not in err), err


def test_profile_flag_reaches_profiledsnapkv(monkeypatch, capsys):
    """--profile was refused for profiledsnapkv (whose profile option it is), naming flags not given."""
    import hetero_jax
    from hetero_jax.profile import ProfileError

    def stop(*a, **k):
        raise ProfileError("reached the model load")
    monkeypatch.setattr(hetero_jax, "load", stop)
    profile = os.path.join(os.path.dirname(hetero_jax.__file__), "data", "smollm2-135m.profile.json")
    assert main(["generate", "--policy", "profiledsnapkv", "--profile", profile, "--prompt", "hi"]) == 2
    assert "error: reached the model load" in capsys.readouterr().err


# ------------------------------------------------------------------ bad input (issue 20)
@pytest.fixture
def no_load(monkeypatch):
    """Fail if a model is loaded: bad flags and files must be refused before."""
    import hetero_jax

    def boom(*a, **k):
        raise AssertionError("model loaded for input that should have been refused")
    monkeypatch.setattr(hetero_jax, "load", boom)


def _refused(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: "), err
    for n in needles:
        assert n in err, f"{n!r} not in {err!r}"


@pytest.mark.parametrize("flags, needles", [
    (["--temperature", "nan"], ["temperature must be a finite number >= 0", "got nan"]),
    (["--temperature", "-1"], ["temperature must be a finite number >= 0", "got -1.0"]),
    (["--top-p", "nan"], ["top_p must be a number in (0, 1], got nan"]),
    (["--top-p", "0"], ["top_p must be in (0, 1], got 0.0"]),
    (["--max-new-tokens", "-3"], ["--max-new-tokens must be >= 1 (the answer's length limit in tokens), got -3"]),
    (["--seed", str(2**70)], ["seed must be an integer in [-2**63, 2**63)", str(2**70)]),
    (["--stop", ""], ["stop strings must be non-empty"]),
    (["--policy", "nope"], ["unknown policy 'nope'; known policies: full"]),
    (["--policy", "snapkv", "--budget", "nan"], ["budget rho=nan is out of range", "(0, 1]"]),
    (["--policy", "heterocache", "--window", "0"], ["HeteroCache: window must be an integer >= 1", "got 0"]),
    (["--policy", "heterocache", "--tau-drift", "nan"], ["HeteroCache: tau_drift must be a finite number"]),
    (["--policy", "quest", "--option", "offload"], ["a policy option is KEY=VALUE", "'offload'"]),
    (["--policy", "quest", "--option", "pages=3"], ["Quest has no option 'pages'", "page_size"]),
    (["--policy", "quest", "--option", "page_size=0"], ["Quest: page_size must be an integer >= 1"]),
    (["--policy", "snapkv", "--option", "budget=0.3"], ["the budget is not an option (got budget=0.3)",
                                                        "--budget on the command line"]),
    (["--policy", "snapkv:window=4", "--option", "window=2"], ["the policy option 'window' is given twice"]),
    (["--policy", "heterocache", "--option", "window=3", "--window", "7"],
     ["--window 7 and --option window=3 set one option twice; give it once"]),
    # was "profile must be a HeadProfile (load_profile(...))": the option now loads a path as --profile does
    (["--policy", "heterocache", "--option", "profile=/nonexistent/p.json"],
     ["profile file not found: '/nonexistent/p.json'"]),
])
def test_bad_generate_flags_are_refused_before_loading(capsys, no_load, flags, needles):
    _refused(capsys, ["generate", "--prompt", "hi", *flags], *needles)


def test_non_integer_max_new_tokens_is_a_usage_error(capsys, no_load):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "hi", "--max-new-tokens", "2.5"])
    assert e.value.code == 2 and "invalid int value: '2.5'" in capsys.readouterr().err


@pytest.mark.parametrize("flag, kind", [(f, k) for f in ("--prompt-file", "--turns")
                                         for k in ("directory", "latin1", "missing")] + [("--turns", "empty"),
                                                                                        ("--prompt-file", "empty")])
def test_unreadable_prompt_and_turns_files(tmp_path, capsys, no_load, flag, kind):
    path = tmp_path / "x.txt"
    if kind == "directory":
        path.mkdir()
        needle = "is a directory; " + flag + " takes a UTF-8 text file"
    elif kind == "latin1":
        path.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
        needle = "is not UTF-8 text (invalid continuation byte at byte 3); " + flag
    elif kind == "missing":
        needle = f"not found: {str(path)!r}"
    else:
        path.write_text("\n  \n")
        needle = "holds no questions (one per line)" if flag == "--turns" else "empty prompt"
    before = sorted(os.listdir(tmp_path))
    argv = ["generate", flag, str(path)] if flag == "--prompt-file" else ["generate", "--prompt", "hi", flag, str(path)]
    _refused(capsys, argv, needle, *([str(path)] if kind != "empty" or flag == "--turns" else []))
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("flags, needle", [
    (["--dp", "2"], "--dp 2 splits a batch over devices, but generate runs one prompt: each of the 2 data-parallel "
                    "devices would repeat the whole run"),
    (["--tp", "99999999999999"], "--tp 99999999999999 x --dp 1 = 99999999999999 devices, more than one process "
                                 "holds (at most 64)"),
    (["--tp", "3", "--dp", "99999999999"], "= 299999999997 devices, more than one process holds"),
])
def test_mesh_flags_are_refused_before_jax_starts(capsys, monkeypatch, no_load, flags, needle):
    """XLA aborted with its flag list on a device count it cannot read, and ran out of memory simulating
    hundreds of devices; one prompt has no batch for --dp to split."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    _refused(capsys, ["generate", "--prompt", "hi", *flags], needle)
    assert "XLA_FLAGS" not in os.environ  # refused before any device was simulated


def test_a_job_whose_default_tp_misses_the_heads_names_the_flags(capsys, monkeypatch):
    """`hetero-jax launch -n 2 -- generate` of a 3-KV-head model: neither --tp nor --dp, so tp=2; the error
    says how to choose (the mesh check's own text only offered 'choose tp in [1, 3]')."""
    import types

    import hetero_jax
    from hetero_jax import cli
    from hetero_jax.model.sharding import MeshError
    from hetero_jax.runtime import distributed
    from hetero_jax.runtime.distributed import ProcessSetup

    job = ProcessSetup(2, 0, "127.0.0.1:1", "jax")
    monkeypatch.setattr(distributed, "process_setup", lambda *a, **k: job)
    monkeypatch.setattr(distributed, "initialize_distributed", lambda *a, **k: job)
    monkeypatch.setattr(distributed, "end_process", lambda code: None)  # a job's process would end here: go on
    monkeypatch.setattr(cli, "_generate_mesh", lambda args, setup: types.SimpleNamespace(
        devices=types.SimpleNamespace(size=2)))
    monkeypatch.setattr(cli, "enable_compilation_cache", lambda: False)

    def load(*a, **k):
        raise MeshError("tensor parallelism tp=2 does not divide the model's 3 KV heads; choose tp in [1, 3]")
    monkeypatch.setattr(hetero_jax, "load", load)
    assert main(["generate", "--prompt", "hi"]) == 2
    assert capsys.readouterr().err.startswith(
        "error (process 0 of 2): tensor parallelism tp=2 does not divide the model's 3 KV heads; choose tp in [1, 3]. "
        "With neither --tp nor --dp, this job's 2 devices make tp=2: give --tp T --dp 2/T with T from that list and "
        "dividing 2 (e.g. --tp 1 --dp 2,")


@pytest.mark.parametrize("source", ["stdin", "--prompt", "--stop"])
def test_text_that_is_not_utf8_is_refused_before_loading(capsys, monkeypatch, no_load, source):
    """A Latin-1 'café' piped in, or typed on a command line (Python reads its byte 0xe9 as U+DCE9)."""
    import io

    latin1 = "caf\xe9 au lait\n".encode("latin-1")
    argv_text = latin1.decode("utf-8", "surrogateescape")
    if source == "stdin":
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(latin1)))
        argv, needle = ["generate", "--prompt-file", "-"], ("the prompt read from stdin is not UTF-8 text (invalid "
                                                            "continuation byte at byte 3); --prompt-file - takes")
    else:
        argv = ["generate", "--prompt", argv_text] if source == "--prompt" else [
            "generate", "--prompt", "hi", "--stop", argv_text]
        what = "--prompt" if source == "--prompt" else f"the stop string {argv_text!r}"
        needle = f"{what} is not valid text: character 3 is the lone surrogate U+DCE9 (the byte 0xe9)"
    _refused(capsys, argv, needle)


@pytest.mark.parametrize("out, needles", [
    ("missing/dir/profile.json", ["the directory", "does not exist; create it first (nothing was written)"]),
    (".", ["is a directory; give the path of a file to write (inside it or elsewhere)"]),
])
def test_profile_out_is_checked_before_calibrating(tmp_path, capsys, monkeypatch, out, needles):
    import importlib

    calibrate = importlib.import_module("hetero_jax.profile.calibrate")
    monkeypatch.setattr(calibrate, "calibrate_tokens", lambda *a, **k: (_ for _ in ()).throw(
        AssertionError("calibrated")))
    from hetero_jax.io import hub  # where the profile command loads from

    monkeypatch.setattr(hub, "load", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    before = sorted(os.listdir(tmp_path))
    _refused(capsys, ["profile", "--data", "pydoc", "--out", str(tmp_path / out)], *needles)
    assert sorted(os.listdir(tmp_path)) == before


def test_an_empty_profile_out_is_refused_before_calibrating(tmp_path, capsys, monkeypatch):
    """--out "" named the current directory once resolved: the calibration ran, then the write failed."""
    from hetero_jax.io import hub

    monkeypatch.setattr(hub, "load", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    monkeypatch.chdir(tmp_path)
    _refused(capsys, ["profile", "--data", "pydoc", "--out", ""], "--out is empty; give the path of a file to write")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("flags, needle", [
    (["--samples", "0"], "--samples must be >= 1, got 0"),
    (["--tau-stable", "nan"], "--tau-stable must be in [0, 1], got nan"),
    (["--top-k", "0"], "--top-k must be >= 1 and below --tokens 1024"),
    (["--tokens", "128", "--top-k", "128"], "--top-k must be >= 1 and below --tokens 128"),  # after the load
    (["--tokens", "1"], "--tokens must be >= 2, got 1"),  # was refused after the load, as tokens= (the API's)
    (["--copy-steps", "-1"], "--copy-steps must be >= 0, got -1"),
    (["--tau-copy", "1.5"], "--tau-copy must be in [0, 1], got 1.5"),
    # flags another method reads were taken and changed nothing (review 76)
    (["--n-r", "2"], "--n-r applies to --method synckv, not heterocache: drop it"),
    (["--method", "synckv", "--copy-steps", "10"], "--copy-steps applies to --method heterocache, not synckv"),
    (["--method", "synckv", "--tau-copy", "0.1"], "--tau-copy applies to --method heterocache, not synckv"),
    (["--method", "contextkeeper", "--top-k", "5"], "--top-k applies to --method heterocache and synckv, not "
                                                   "contextkeeper"),
    (["--method", "contextkeeper", "--decode-steps", "99"], "--decode-steps applies to --method heterocache and "
                                                            "synckv"),
    (["--method", "hcattention", "--sink", "4"], "--sink applies to --method contextkeeper, not hcattention"),
    (["--method", "contextkeeper", "--batch-size", "999"], "--batch-size applies to --method heterocache and "
                                                           "synckv, not contextkeeper"),  # was taken and ignored
    (["--method", "hcattention", "--batch-size", "8"], "--batch-size applies to --method heterocache and synckv"),
    (["--codebook-size", "64"], "--codebook-size applies to --method hcattention, not heterocache"),
    (["--method", "contextkeeper", "--tokens", "512", "--ck-window", "1000"],
     "--ck-window 1000 exceeds --tokens 512"),
])
def test_profile_numbers_are_checked_before_loading(tmp_path, capsys, monkeypatch, flags, needle):
    from hetero_jax.io import hub  # where the profile command loads from

    monkeypatch.setattr(hub, "load", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    _refused(capsys, ["profile", "--data", "pydoc", "--out", str(tmp_path / "p.json"), *flags], needle)
    assert os.listdir(tmp_path) == []


def test_profile_data_that_is_a_directory(tmp_path, capsys, monkeypatch):
    from hetero_jax.io import hub  # where the profile command loads from

    monkeypatch.setattr(hub, "load", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    _refused(capsys, ["profile", "--data", str(tmp_path), "--out", str(tmp_path / "p.json")],
             f"cannot read calibration data file {tmp_path}")
    assert os.listdir(tmp_path) == []


@pytest.fixture
def no_compute(monkeypatch):
    """Fail if any model compute starts: the input must be refused before."""
    from hetero_jax.model import transformer as M

    def boom(*a, **k):
        raise AssertionError("compute started for input that should have been refused")
    for name in ("prefill", "decode_step", "extend"):
        monkeypatch.setattr(M, name, boom)


@pytest.mark.parametrize("chat", [[], ["--no-chat"]])
def test_a_turn_that_cannot_fit_is_refused_before_the_first_is_answered(tiny_checkpoint, tmp_path, capsys,
                                                                       no_compute, chat):
    _, ours = tiny_checkpoint("llama")
    turns = tmp_path / "turns.txt"
    turns.write_text("who jumps?\n" + "tell me about the dog " * 200 + "\n")
    assert main(["generate", "--model", ours, "--prompt", "the quick brown fox", "--turns", str(turns),
                 "--max-new-tokens", "3", *chat]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # turn 1 was not answered
    assert err.startswith("error: turn 2 (") and "does not fit: the context (" in err, err
    assert err.rstrip().endswith("shorten or drop that question (nothing was computed)"), err


def test_a_chat_template_that_does_not_compile_is_refused_before_compute(tiny_checkpoint, tmp_path, capsys,
                                                                        no_compute):
    import json
    import shutil

    _, ours = tiny_checkpoint("llama")
    bad = tmp_path / "bad"
    shutil.copytree(ours, bad)
    cfg = json.loads((bad / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }"
    (bad / "tokenizer_config.json").write_text(json.dumps(cfg))
    _refused(capsys, ["generate", "--model", str(bad), "--prompt", "the quick brown fox"],
             "the checkpoint's chat template is not valid Jinja (line 1: ", "pass chat=False (CLI: --no-chat)",
             "fix chat_template in the checkpoint's tokenizer_config.json")


def test_ctrl_c_is_a_line_and_exit_130(capsys, monkeypatch):
    """A KeyboardInterrupt while loading printed Python's traceback; the CLI's own line and 130 (128 + SIGINT)."""
    import hetero_jax

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(hetero_jax, "load", interrupted)  # where generate loads from (as no_load)
    assert main(["generate", "--prompt", "hi"]) == 130
    assert capsys.readouterr().err.strip() == "error: interrupted"


def test_console_scripts_end_at_once_after_an_interrupt():
    """After Ctrl-C's line the console scripts exit without waiting for worker threads: the checkpoint reader's
    (orbax) threads, still finishing at a normal interpreter exit, printed 'RuntimeError: Event loop is closed'
    tracebacks under 'error: interrupted'. Other exit codes exit normally (threads are joined)."""
    import tomllib
    from pathlib import Path

    scripts = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"hetero-jax": "hetero_jax.cli:console_main", "hetero-jax-convert": "convert.cli:console_main"}
    code = ("import sys, threading, time\n"
            "from hetero_jax.errors import exit_console\n"
            "def late():\n"
            "    time.sleep(0.5)\n"
            "    print('late', file=sys.stderr, flush=True)\n"
            "threading.Thread(target=late).start()\n"
            "exit_console(int(sys.argv[1]))\n")
    interrupted = subprocess.run([sys.executable, "-c", code, "130"], capture_output=True, text=True, timeout=120)
    assert interrupted.returncode == 130 and "late" not in interrupted.stderr
    normal = subprocess.run([sys.executable, "-c", code, "2"], capture_output=True, text=True, timeout=120)
    assert normal.returncode == 2 and "late" in normal.stderr


def test_profile_decode_steps_past_the_context_name_the_fix():
    """--tokens 128 --decode-steps 600 on a 512-token model was told 'use --tokens -88 or fewer'."""
    from types import SimpleNamespace

    from hetero_jax.profile import ProfileError
    from hetero_jax.profile.cli import check_model_args

    config = SimpleNamespace(max_position_embeddings=512, num_kv_heads=3)
    with pytest.raises(ProfileError, match=r"--decode-steps 600 leaves no room .* use --decode-steps 510 or fewer"):
        check_model_args(SimpleNamespace(method="heterocache", tokens=128, decode_steps=600), config)
    with pytest.raises(ProfileError, match=r"--tokens 500 plus --decode-steps 50 exceeds .* use --tokens 462"):
        check_model_args(SimpleNamespace(method="heterocache", tokens=500, decode_steps=50), config)


def test_a_profile_path_that_is_a_directory_says_so(tmp_path, capsys, no_load):
    _refused(capsys, ["generate", "--policy", "heterocache", "--profile", str(tmp_path), "--prompt", "hi"],
             f"{tmp_path} is a directory, not a file")
