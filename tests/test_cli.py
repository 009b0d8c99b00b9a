"""The hetero-jax console script."""

import subprocess
import sys

import pytest

from hetero_jax.cli import main


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("generate", "models"):
        assert cmd in out


def test_generate_prints_answer_then_stats(tiny_checkpoint, capsys):
    _, ours = tiny_checkpoint("llama")
    assert main(["generate", "--model", ours, "--prompt", "the quick brown fox", "--max-new-tokens", "5",
                 "--no-chat", "--no-stream"]) == 0
    lines = capsys.readouterr().out.rstrip("\n").split("\n")
    assert lines[-1].startswith("[stats] prompt ") and "ms/tok" in lines[-1] and "KV device" in lines[-1]


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
    with pytest.raises(SystemExit):
        main(["generate", "--model", ours, "--prompt-file", str(tmp_path / "missing.txt")])


def test_console_script_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "hetero_jax.cli", "models"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "smollm2-135m" in out.stdout


def test_heterocache_flags_are_refused_for_other_policies(capsys):
    for flag in (["--window", "3"], ["--tau-drift", "0.3"], ["--select-window", "1"]):
        assert main(["generate", "--policy", "snapkv", "--prompt", "hi", *flag]) == 2
        assert "apply to --policy heterocache" in capsys.readouterr().err
