"""The multi-device defects of the mesh review (/work/adhoc/review_mesh.md, F1-F6 and S1): a mesh with jax's default
Explicit axes, launch variables that pass the checks and then hang or crash inside jax, an explicit --tp 1 in a
job, bench_mesh's late mesh checks, its stale sentence, and launch's GPUs per process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from bench_cases import usage_error
from hetero_jax.cli import main
from hetero_jax.launch import process_env
from hetero_jax.runtime.distributed import LaunchError, ProcessSetup, heartbeat_options, process_setup

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_mesh  # noqa: E402

JOB = {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}
DAY = 86400  # the heartbeat's bound, as docs/devices.md gives it


def _run(code: str, devices: int, timeout: float = 600) -> dict:
    """``code`` in a fresh Python with ``devices`` simulated CPU devices; the JSON of its last stdout line."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               PYTHONPATH=os.pathsep.join([str(REPO / "tests"), str(REPO)]))
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ F1: jax.make_mesh's Explicit axes
F1_CODE = """
import json
import jax
from jax.sharding import AxisType
import hetero_jax
from hetero_jax.model.sharding import MeshError
from hetero_jax.policies import FullKV
from multihost_model import PROMPTS, tiny_model

names = ("data", "model")
try:
    hetero_jax.place(tiny_model(), jax.make_mesh((2, 3), names))  # jax's default axis types: Explicit
    refused = None
except MeshError as e:
    refused = str(e)
auto = jax.make_mesh((2, 3), names, axis_types=(AxisType.Auto,) * 2)  # the fix the error names
run = lambda m: [r.token_ids for r in hetero_jax.generate(m, PROMPTS, FullKV(), max_new_tokens=4, chat=False)]
print(json.dumps(dict(refused=refused, one=run(tiny_model()), mesh=run(hetero_jax.place(tiny_model(), auto)))))
"""


def test_a_mesh_with_explicit_axes_is_refused_naming_the_fix_which_matches_one_device():
    """It used to be accepted, then failed inside prefill with jax's ShardingTypeError."""
    out = _run(F1_CODE, devices=6)
    assert out["refused"] is not None, "an Explicit-axes mesh was accepted"
    for needle in ("'data': Explicit", "'model': Explicit", "hetero_jax.make_mesh", "AxisType.Auto"):
        assert needle in out["refused"], (needle, out["refused"])
    assert out["mesh"] == out["one"] and len(out["one"]) == 2 and all(len(t) == 4 for t in out["one"])


# ------------------------------------------------------------------ F2: addresses and counts
@pytest.mark.parametrize("address", ["http://host0:1234", "host 0:1234", "host0:1234/x:99", "user@host0:1234",
                                     "::1:1234", "[::1:1234", "-host:1234", "host0:+123", "host0:1_0"])
def test_an_address_that_is_not_host_port_is_refused_before_jax_starts(address):
    """Each used to pass, and the job waited jax's 5-minute connection timeout, then aborted."""
    with pytest.raises(LaunchError, match="is not HOST:PORT"):
        process_setup(dict(JOB, JAX_COORDINATOR_ADDRESS=address))


@pytest.mark.parametrize("address", ["host0:1234", "10.0.0.1:1", "node-1.cluster.local:65535", "[::1]:1234",
                                     "[fe80::1%eth0]:8476", "h_x:5"])
def test_hostnames_ipv4_and_bracketed_ipv6_addresses_are_accepted(address):
    assert process_setup(dict(JOB, JAX_COORDINATOR_ADDRESS=address)) == ProcessSetup(2, 0, address, "jax")


@pytest.mark.parametrize("name, value", [("JAX_NUM_PROCESSES", "1_0"), ("JAX_NUM_PROCESSES", "+2"),
                                         ("JAX_NUM_PROCESSES", "\u0663"), ("JAX_PROCESS_ID", "0_1")])
def test_a_count_that_is_not_plain_digits_is_refused(name, value):
    """int() reads '1_0' as 10 and the Arabic-Indic '3' as 3: a typo became a job of another size."""
    with pytest.raises(LaunchError, match=re.escape(f"{name}={value!r} is not an integer")):
        process_setup(dict(JOB, JAX_COORDINATOR_ADDRESS="h:1", **{name: value}))


# ------------------------------------------------------------------ F3: the heartbeat bound
@pytest.mark.parametrize("raw", [str(2**31), "99999999999", str(DAY + 1)])
def test_a_heartbeat_jaxlib_cannot_take_is_a_launch_error(raw):
    """jaxlib takes a C int: 2**31 was a TypeError inside jax.distributed.initialize, in every process."""
    with pytest.raises(LaunchError, match=f"HETERO_JAX_HEARTBEAT_S='{raw}' is not a whole number of seconds >= 1 "
                                          f"\\(at most {DAY}"):
        heartbeat_options({"HETERO_JAX_HEARTBEAT_S": raw})
    assert heartbeat_options({"HETERO_JAX_HEARTBEAT_S": str(DAY)}) == {
        "heartbeat_timeout_seconds": DAY}


# ------------------------------------------------------------------ F4: an explicit --tp 1 in a job
@pytest.fixture
def two_device_job(monkeypatch):
    """generate as process 0 of a 2-process job holding 2 devices; the mesh it asks for is recorded, not built."""
    import jax

    import hetero_jax
    from hetero_jax import cli
    from hetero_jax.model import sharding
    from hetero_jax.runtime import distributed

    job = ProcessSetup(2, 0, "127.0.0.1:1", "jax")
    monkeypatch.setattr(distributed, "process_setup", lambda *a, **k: job)
    monkeypatch.setattr(distributed, "initialize_distributed", lambda *a, **k: job)
    monkeypatch.setattr(distributed, "end_process", lambda code: None)  # a job's process would end here: go on
    monkeypatch.setattr(jax, "device_count", lambda *a: 2)
    monkeypatch.setattr(jax, "process_count", lambda *a: 2)
    monkeypatch.setattr(cli, "enable_compilation_cache", lambda: False)
    made = []

    def make_mesh(tp=1, dp=1, devices=None):
        made.append((tp, dp))
        return types.SimpleNamespace(devices=types.SimpleNamespace(size=tp * dp))
    monkeypatch.setattr(sharding, "make_mesh", make_mesh)

    def load(*a, **k):
        raise sharding.MeshError("tensor parallelism tp=2 does not divide the model's 3 KV heads; choose tp in "
                                 "[1, 3]")
    monkeypatch.setattr(hetero_jax, "load", load)
    return job, made


def test_an_explicit_tp_1_in_a_job_is_not_taken_for_neither_flag(two_device_job, capsys):
    """It became tp=2, and the error said that neither --tp nor --dp was given."""
    assert main(["generate", "--tp", "1", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "--tp 1 x --dp 1 (--dp not given: 1) = 1 devices, but the 2 processes hold 2" in err, err
    assert "give --tp and --dp whose product is 2" in err and "With neither --tp nor --dp" not in err, err
    assert two_device_job[1] == []  # refused before any mesh was built


@pytest.mark.parametrize("flags, mesh", [((), (2, 1)), (("--tp", "1", "--dp", "2"), (1, 2)), (("--dp", "2"), (1, 2)),
                                         (("--tp", "2"), (2, 1))])
def test_the_job_mesh_honours_the_flags_given(two_device_job, capsys, flags, mesh):
    assert main(["generate", *flags, "--prompt", "hi"]) == 2  # the stand-in load refuses every mesh
    assert two_device_job[1] == [mesh]
    assert ("With neither --tp nor --dp" in capsys.readouterr().err) == (not flags)


# ------------------------------------------------------------------ F5: bench_mesh checks every mesh first
def _boom(*a, **k):
    raise AssertionError("work started before every mesh was checked")


@pytest.fixture
def no_bench_work(monkeypatch):
    monkeypatch.setattr(bench_mesh, "placement_rows", _boom)
    monkeypatch.setattr(bench_mesh, "sharded_runs", _boom)
    # this process's JAX has started (raising=False: the old script set its count at import)
    monkeypatch.setattr(bench_mesh, "simulate_devices", lambda meshes: None, raising=False)


def test_bench_mesh_refuses_a_malformed_mesh_before_any_work(no_bench_work, tmp_path, capsys):
    out = tmp_path / "m.json"
    usage_error(capsys, bench_mesh.main, ["--meshes", "1x1,3", "--json", str(out)],
                "--meshes '3' is not TPxDP")
    usage_error(capsys, bench_mesh.main, ["--meshes", "1x0", "--json", str(out)], "--meshes '1x0' is not TPxDP")
    assert not out.exists()


def test_bench_mesh_refuses_a_mesh_the_model_or_the_devices_cannot_take_before_any_work(
        no_bench_work, tiny_checkpoint, tmp_path, capsys):
    """The tiny Llama has 2 KV heads. A bad mesh after good ones used to end the run after those, --json
    unwritten."""
    import jax

    _, ck = tiny_checkpoint("llama")
    capsys.readouterr()
    out = tmp_path / "m.json"
    usage_error(capsys, bench_mesh.main, ["--model", ck, "--meshes", "1x1,3x1", "--json", str(out)],
                "--meshes 3x1: tp=3 does not divide the model's 2 KV heads; choose tp in [1, 2]")
    n = jax.device_count()
    usage_error(capsys, bench_mesh.main, ["--model", ck, "--meshes", f"1x1,1x{n + 1}", "--json", str(out)],
                f"--meshes 1x{n + 1}: needs {n + 1} devices but {n} are visible")
    assert not out.exists()


@pytest.mark.slow
def test_bench_mesh_simulates_as_many_cpu_devices_as_its_largest_mesh(tiny_checkpoint, tmp_path):
    """The GPU meshes' shape (8 devices) on a CPU: the simulated count was fixed at 6."""
    _, ck = tiny_checkpoint("llama")
    out = tmp_path / "m.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, str(BENCH / "bench_mesh.py"), "--model", ck, "--meshes", "1x1,2x4",
                           "--policies", "full", "--prompt-tokens", "32", "--steps", "3", "--tps", "8",
                           "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    payload = json.loads(out.read_text())
    assert payload["config"]["devices"] == 8 and payload["config"]["platform"] == "cpu"
    assert [(r["tp"], r["dp"], r["devices"]) for r in payload["runs"]] == [(1, 1, 1), (2, 4, 8)]
    assert "The 8 simulated devices share this machine's cores." in proc.stdout


# ------------------------------------------------------------------ F6: HeteroCache across processes runs
def test_the_per_process_section_no_longer_says_heterocache_is_refused(monkeypatch):
    monkeypatch.setattr(bench_mesh.common, "section_header", lambda title, payload: title)
    text = bench_mesh.render_processes({"config": {"rho": 0.3, "reference": "reference", "new_tokens": 256},
                                        "processes": []})
    results = (BENCH / "RESULTS.md").read_text()
    for where in (text, results):
        assert "HeteroCache across processes is still refused" not in where
    sentence = "HeteroCache runs across processes: the host column is what each process's own host holds"
    assert sentence in text and sentence in results


# ------------------------------------------------------------------ S1: one GPU per process by default
def test_launch_gives_each_process_its_own_gpu_without_devices_per_process():
    """Without JAX_LOCAL_DEVICE_IDS every process of a GPU host took every GPU."""
    for rank in range(3):
        env = process_env({"XLA_FLAGS": "--a=1"}, 3, rank, 555, None)
        assert env["JAX_LOCAL_DEVICE_IDS"] == str(rank) and env["XLA_FLAGS"] == "--a=1"
        assert process_setup(env) == ProcessSetup(3, rank, "127.0.0.1:555", "jax")
    assert process_env({}, 3, 2, 555, 2)["JAX_LOCAL_DEVICE_IDS"] == "4,5"


# ------------------------------------------------------------------ review 93: meshes the Python API accepted
def test_a_mesh_that_leaves_out_a_process_of_the_job_is_refused(monkeypatch):
    """make_mesh takes the first tp x dp devices, which in a job of 2 processes x 2 devices are all process 0's:
    place() accepted the mesh, process 0 ran alone and process 1 failed inside the engine with jax's raw
    'non-addressable devices' RuntimeError."""
    import jax

    from hetero_jax.model import sharding
    from tiny_model import tiny_model

    cfg = tiny_model().config
    mesh = sharding.make_mesh(1, 1)
    sharding.check_mesh(mesh, cfg)  # one process: fine
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(sharding.MeshError, match=r"the mesh holds devices of process\(es\) \[0\] only, but the job "
                                                 r"has 2 processes; .* tp x dp = jax.device_count\(\)"):
        sharding.check_mesh(mesh, cfg)


def test_make_mesh_takes_another_meshs_device_grid():
    """A 2-D device array (another mesh's .devices) was read as a list of rows: 'needs 4 devices but 2 are
    visible' with 4 visible, or an AttributeError from inside jax."""
    out = _run("import json\nfrom hetero_jax.model.sharding import make_mesh\n"
               "grid = make_mesh(2, 2).devices\n"
               "print(json.dumps([[d.id for d in make_mesh(tp, dp, devices=grid).devices.flat] "
               "for tp, dp in ((2, 2), (2, 1), (1, 4))]))", devices=4)
    assert out == [[0, 1, 2, 3], [0, 1], [0, 1, 2, 3]]
