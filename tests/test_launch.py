"""Launching like the ecosystem launches: the job's variables (JAX's own, SLURM, Open MPI, Kubernetes) read and
checked before JAX starts, ``hetero-jax launch`` starting N processes of ``generate`` on this machine (the text
of one process), and a process that fails stopping the others within a bounded time."""

import os
import signal
import subprocess
import sys
import time

import pytest

from hetero_jax.cli import main
from hetero_jax.launch import check_command, process_env, run_processes
from hetero_jax.errors import PromptError
from hetero_jax.runtime.distributed import (SINGLE, LaunchError, ProcessSetup, exit_on_failure, heartbeat_options,
                                            initialize_distributed, process_setup)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
SLURM = {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "node[001-004]", "SLURM_NTASKS": "4", "SLURM_PROCID": "2",
         "SLURM_LOCALID": "0"}


def test_the_job_is_read_from_jax_slurm_and_open_mpi_variables():
    assert process_setup({}) == SINGLE and not SINGLE.distributed
    assert process_setup(JOB) == ProcessSetup(4, 3, "10.0.0.1:1234", "jax")
    assert process_setup({"JAX_NUM_PROCESSES": "1", "JAX_PROCESS_ID": "0"}) == SINGLE  # no coordinator needed
    # the one-pod way out the Kubernetes refusal names (review 84)
    assert process_setup({"KUBERNETES_SERVICE_HOST": "10.1.0.1", "JOB_COMPLETION_INDEX": "0", "JAX_NUM_PROCESSES": "1",
                          "JAX_PROCESS_ID": "0"}) == SINGLE
    assert process_setup(SLURM) == ProcessSetup(4, 2, None, "slurm")
    assert process_setup(dict(SLURM, JAX_COORDINATOR_ADDRESS="n1:99")) == ProcessSetup(4, 2, "n1:99", "slurm")
    assert process_setup(dict(SLURM, SLURM_NTASKS="1", SLURM_PROCID="0")) == SINGLE
    assert process_setup({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "4"}) == SINGLE  # a batch script outside srun
    assert process_setup(dict(SLURM, **JOB)) == ProcessSetup(4, 3, "10.0.0.1:1234", "jax")  # explicit wins
    ompi = {"OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1:34911", "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    assert process_setup(ompi) == ProcessSetup(8, 5, None, "ompi")


@pytest.mark.parametrize("env, names", [
    ({"JAX_NUM_PROCESSES": "2"}, ["JAX_NUM_PROCESSES is set but JAX_PROCESS_ID is not"]),
    ({"JAX_PROCESS_ID": "1", "JAX_COORDINATOR_ADDRESS": "h:1"}, ["JAX_NUM_PROCESSES is not"]),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}, ["JAX_COORDINATOR_ADDRESS is not"]),
    ({"JAX_COORDINATOR_ADDRESS": "h:1"}, ["JAX_COORDINATOR_ADDRESS is set but JAX_NUM_PROCESSES and JAX_PROCESS_ID"]),
    (dict(JOB, JAX_PROCESS_ID="4"), ["JAX_PROCESS_ID='4' is not an integer in [0, 3]"]),
    (dict(JOB, JAX_NUM_PROCESSES="two"), ["JAX_NUM_PROCESSES='two' is not an integer >= 1"]),
    (dict(JOB, JAX_COORDINATOR_ADDRESS="10.0.0.1"), ["JAX_COORDINATOR_ADDRESS='10.0.0.1' is not HOST:PORT"]),
    (dict(JOB, JAX_COORDINATOR_ADDRESS="h:70000"), ["JAX_COORDINATOR_ADDRESS='h:70000' is not HOST:PORT"]),
    (dict(JOB, JAX_LOCAL_DEVICE_IDS="0;1"), ["JAX_LOCAL_DEVICE_IDS='0;1'"]),
    (dict(SLURM, SLURM_PROCID="x"), ["SLURM_PROCID='x'", "srun"]),
    ({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://h:1", "OMPI_COMM_WORLD_SIZE": "2"},
     ["OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_LOCAL_RANK are not", "mpirun"]),
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1"},
     ["OMPI_MCA_orte_hnp_uri", "JAX_NUM_PROCESSES=$OMPI_COMM_WORLD_SIZE"]),
    ({"KUBERNETES_SERVICE_HOST": "10.1.0.1", "JOB_COMPLETION_INDEX": "1"},
     ["pip install 'jax[k8s]'", "a pod that runs alone", "set JAX_NUM_PROCESSES=1 and JAX_PROCESS_ID=0"]),
])
def test_bad_or_partial_variables_are_refused_naming_the_variable_and_the_fix(env, names):
    with pytest.raises(LaunchError) as e:
        process_setup(env)
    for name in names:
        assert name in str(e.value)
    assert "JAX_COORDINATOR_ADDRESS" in str(e.value) or "unset" in str(e.value) or "mpirun" in str(e.value)


@pytest.mark.parametrize("raw", ["0", "1.5", "abc", "-3"])
def test_a_bad_heartbeat_is_refused_naming_the_variable(raw):
    assert heartbeat_options({}) == {} and heartbeat_options({"HETERO_JAX_HEARTBEAT_S": " 30 "}) == {
        "heartbeat_timeout_seconds": 30}
    with pytest.raises(LaunchError, match=f"HETERO_JAX_HEARTBEAT_S='{raw}' is not a whole number of seconds >= 1"):
        heartbeat_options({"HETERO_JAX_HEARTBEAT_S": raw})


def test_exit_on_failure_ends_a_jobs_process_on_the_projects_errors_and_passes_a_single_process_through():
    """A project error raised in one process of a job was passed on, and the process then waited at jax's shutdown
    barrier while its peers waited for it in a collective: 300 s, then every process aborted (review 93). It now
    ends the process at once, exit code 2 as the command's own errors (tests/test_multihost.py kills a peer for
    the other failures, exit code 1)."""
    import subprocess
    import sys

    code = ("from hetero_jax.errors import PromptError\n"
            "from hetero_jax.runtime.distributed import ProcessSetup, exit_on_failure\n"
            "with exit_on_failure(ProcessSetup(2, 1, '10.0.0.1:1234', 'jax')):\n"
            "    raise PromptError('--prompt-file /data/q.txt does not exist')\n"
            "print('after the block')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "after the block" not in out.stdout
    assert "error (process 1 of 2): --prompt-file /data/q.txt does not exist" in out.stderr
    with pytest.raises(PromptError):
        with exit_on_failure(SINGLE):
            raise PromptError("one process: raised as usual")


def test_one_process_joins_nothing():
    import jax

    assert initialize_distributed({}) == SINGLE
    assert not jax.distributed.is_initialized()


def test_generate_refuses_a_partial_job_before_loading_anything(monkeypatch, capsys):
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.delenv("JAX_PROCESS_ID", raising=False)
    assert main(["generate", "--model", "/no/such/model", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "JAX_NUM_PROCESSES is set but JAX_PROCESS_ID is not" in err and "no/such/model" not in err


def test_launch_runs_generate_only_and_sets_the_job_per_process(capsys):
    with pytest.raises(LaunchError, match="runs generate in every process"):
        check_command(["--", "serve"])
    assert check_command(["--", "generate", "--prompt", "x"]) == ["generate", "--prompt", "x"]
    assert main(["launch", "-n", "2", "--", "models"]) == 2
    assert "hetero-jax launch runs generate" in capsys.readouterr().err
    assert main(["launch", "-n", "0", "--", "generate"]) == 2
    capsys.readouterr()
    assert main(["launch", "-n", "100000", "--", "generate", "--prompt", "x"]) == 2  # started processes until ^C
    assert f"-n 100000: more processes than one machine runs (at most {max(64, os.cpu_count())} here" in (
        capsys.readouterr().err)
    env = process_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=6 --a=1"}, 3, 2, 555, 2)
    assert process_setup(env) == ProcessSetup(3, 2, "127.0.0.1:555", "jax")
    assert env["XLA_FLAGS"] == "--a=1 --xla_force_host_platform_device_count=2" and env["JAX_LOCAL_DEVICE_IDS"] == "4,5"


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


@pytest.mark.parametrize("failing, code", [("import sys; sys.exit(3)", 3),
                                           ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 128 + 9)])
def test_a_failing_process_stops_the_others_within_a_bounded_time(tmp_path, failing, code):
    """Process 0 would wait for ten minutes (as one blocked in a collective waits), and ignores SIGTERM;
    process 1 fails: launch returns the failure's code within the grace time, and process 0 is gone."""
    pid_file = tmp_path / "pid"
    waiter = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(600)")
    failer = f"import time; time.sleep(1.0); {failing}"
    start = time.monotonic()
    rc = run_processes([_py(waiter), _py(failer)], [dict(os.environ)] * 2, grace_s=2.0)
    assert rc == code and time.monotonic() - start < 30
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_launcher_killed_by_a_signal_stops_its_processes(tmp_path, signum):
    """Two workers that ignore SIGTERM (as JAX's do) and would wait ten minutes; the launcher gets ``signum``
    (a kill, a timeout, a closed terminal): it exits 128 + signum within the grace time and no worker is left."""
    waiter = ("import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              "open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)")
    pids = [tmp_path / "pid0", tmp_path / "pid1"]
    launcher = ("import os, sys; from hetero_jax.launch import run_processes; "
                f"sys.exit(run_processes([[sys.executable, '-c', {waiter!r}, p] for p in {list(map(str, pids))!r}], "
                "[dict(os.environ)] * 2, grace_s=2.0))")
    proc = subprocess.Popen(_py(launcher), stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not all(p.exists() and p.read_text() for p in pids):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    start = time.monotonic()
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signum and time.monotonic() - start < 15
    assert f"got signal {int(signum)} ({signum.name}); stopping its 2 process(es)" in err
    for p in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(int(p.read_text()), 0)


def test_all_processes_succeeding_return_zero():
    assert run_processes([_py("pass"), _py("import time; time.sleep(0.5)")], [dict(os.environ)] * 2) == 0


def _answer(stdout: str) -> list[str]:
    """The lines generate printed, less gloo's connection notes (its C++ code writes them to stdout)."""
    return [line for line in stdout.splitlines() if not line.startswith("[Gloo]")]


@pytest.mark.slow
def test_launch_two_processes_of_generate_gives_the_one_process_text(tiny_checkpoint, tmp_path, capsys):
    """The tiny Llama (2 KV heads) tensor-parallel over two processes of one CPU device each: the same
    greedy text and session turns as one process, printed once (by process 0)."""
    _, ck = tiny_checkpoint("llama")
    capsys.readouterr()  # the conversion's report
    turns = tmp_path / "turns.txt"
    turns.write_text("what comes next?\nand after that?\n")
    prompt = "the quick brown fox jumps over the lazy dog and the lazy dog sleeps"
    env = dict(os.environ, HETERO_JAX_CACHE=str(tmp_path / "cache"))
    env.pop("XLA_FLAGS", None)  # one CPU device per process: the mesh spans both
    for extra in ([], ["--turns", str(turns)]):
        args = ["generate", "--model", ck, "--prompt", prompt, "--no-chat", "--max-new-tokens", "6", "--no-stream",
                *extra]
        assert main(args) == 0
        one = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("[stats]")]
        run = subprocess.run([sys.executable, "-m", "hetero_jax.cli", "launch", "-n", "2", "--", *args], cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        lines = _answer(run.stdout)
        stats = [line for line in lines if line.startswith("[stats]")]
        assert len(stats) == (2 if extra else 1)  # only process 0 printed
        assert [line for line in lines if not line.startswith("[stats]")] == one


def test_stdin_is_read_once_and_handed_to_every_process_as_a_file(tmp_path, monkeypatch):
    """`echo ... | hetero-jax launch -n 2 -- generate --prompt-file -` failed in every process with 'empty prompt'
    (each is started without stdin). The launcher reads stdin once; each process reads the same text from a
    temporary file, removed when they exit."""
    import io

    from hetero_jax.launch import launch, stdin_to_file

    cmd, path = stdin_to_file(["generate", "--prompt-file", "-", "--no-chat"], stdin=io.BytesIO(b"a prompt\r\n"))
    assert cmd == ["generate", "--prompt-file", path, "--no-chat"] and open(path, "rb").read() == b"a prompt\r\n"
    os.unlink(path)
    cmd, path = stdin_to_file(["generate", "--prompt", "p", "--turns=-"], stdin=io.BytesIO(b"q1\nq2\n"))
    assert cmd == ["generate", "--prompt", "p", f"--turns={path}"] and open(path).read() == "q1\nq2\n"
    os.unlink(path)
    # abbreviated as argparse takes them, and a flag given twice (review 88), counted by its last value (review 89)
    from hetero_jax.cli import build_parser, long_options

    opts = long_options(build_parser().command_parsers["generate"])
    for given in (["--prompt-f", "-"], ["--prompt-file", "-", "--prompt-file", "-"], ["--prompt-fi=-"],
                  ["--prompt-file", "notes.txt", "--prompt-file", "-"]):
        cmd, path = stdin_to_file(["generate", *given], stdin=io.BytesIO(b"x"), options=opts)
        assert cmd[-1] in (path, f"--prompt-file={path}") and open(path).read() == "x", given
        os.unlink(path)
    for unread in (["--prompt", "-"], ["--prompt-file", "-", "--prompt-file", "notes.txt"]):  # no stdin read
        cmd, path = stdin_to_file(["generate", *unread], stdin=io.BytesIO(b"x"), options=opts)
        assert (cmd, path) == (["generate", *unread], None), unread
    unread = io.BytesIO(b"x")
    for same in (["generate", "--prompt-file", "f.txt"], ["generate", "--prompt-file", "-", "--turns", "-"]):
        assert stdin_to_file(same, stdin=unread) == (same, None)  # generate refuses two readers of stdin
    assert unread.tell() == 0

    stub = tmp_path / "python"  # stands for `python -m hetero_jax.cli generate ...`: copies its prompt file
    stub.write_text('#!/bin/sh\nwhile [ "$1" != "--prompt-file" ]; do shift; done\n'
                    f'cat "$2" > "{tmp_path}/seen-$JAX_PROCESS_ID"\necho "$2" > "{tmp_path}/path"\n')
    stub.chmod(0o755)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"What is 2+2?\n")))
    assert launch(2, ["--", "generate", "--prompt-file", "-"], python=str(stub)) == 0
    assert [(tmp_path / f"seen-{i}").read_text() for i in range(2)] == ["What is 2+2?\n"] * 2
    assert not os.path.exists((tmp_path / "path").read_text().strip())  # removed after the processes
