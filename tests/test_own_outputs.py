"""A command replaces only a file it wrote: each writer marks its output (hetero_jax.io.own_outputs), a later run
may replace a marked or empty file, and any other existing file (a user's notes, another program's figure) is
refused before any work and left as it was."""

from __future__ import annotations

import gzip
import importlib
import json
import os
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from hetero_jax.cli import main  # noqa: E402
from hetero_jax.errors import OutputError  # noqa: E402
from hetero_jax.io import hub  # noqa: E402
from hetero_jax.io.files import check_output_path, write_text  # noqa: E402
from hetero_jax.io.own_outputs import TEXT_MARK, figure_metadata, is_own_output  # noqa: E402
from hetero_jax.policies.contextkeeper.ranking import CARanking  # noqa: E402
from hetero_jax.policies.hcattention.codebook import KeyCodebook  # noqa: E402
from hetero_jax.profile import load_profile, plot_profile, shipped_profile_path  # noqa: E402
from fs_state import snapshot  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_needle  # noqa: E402
import bench_step_ops  # noqa: E402
from harness import results  # noqa: E402

calibrate = importlib.import_module("hetero_jax.profile.calibrate")
FIGURE_FORMATS = ("png", "pdf", "svg", "svgz", "eps", "ps")


def _figure(path: Path, fmt: str, metadata) -> Path:
    fig = plt.figure(figsize=(2, 2))
    fig.gca().plot([0, 1], [1, 0])
    fig.savefig(path, format=fmt, metadata=metadata)
    plt.close(fig)
    return path


@pytest.mark.parametrize("fmt", FIGURE_FORMATS)
def test_a_figure_is_ours_only_with_our_creator(tmp_path, fmt):
    assert is_own_output(_figure(tmp_path / f"ours.{fmt}", fmt, figure_metadata(fmt)))
    assert not is_own_output(_figure(tmp_path / f"theirs.{fmt}", fmt, None))  # matplotlib's own creator
    assert not is_own_output(_figure(tmp_path / f"other.{fmt}", fmt, {next(iter(figure_metadata(fmt))): "gnuplot"}))


def test_formats_without_a_creator_field_are_never_ours(tmp_path):
    assert figure_metadata("jpg") is None
    assert not is_own_output(_figure(tmp_path / "a.jpg", "jpg", None))


@pytest.mark.parametrize("content, ours", [
    (b"", True),  # nothing to lose
    (json.dumps({"format": "hetero-jax-head-profile"}).encode(), True),
    (b'  \n{"format": "hetero-jax-benchmark", "rows": []}', True),
    (json.dumps({"format": "my-lab-notes"}).encode(), False),
    (json.dumps({"benchmark": "latency", "rows": []}).encode(), False),  # no mark
    (json.dumps(["hetero-jax-head-profile"]).encode(), False),
    (b'{"format": "hetero-jax-head-profile", ', False),  # damaged
    (f"{TEXT_MARK} bench_step_ops --dump-hlo\nHloModule m\n".encode(), True),
    (b"HloModule m\n" + f"{TEXT_MARK}\n".encode(), False),  # the mark only counts as the first line
    (b"my notes\n", False),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\x00IEND", False),
])
def test_documents_and_text_are_ours_by_their_mark(tmp_path, content, ours):
    f = tmp_path / "f"
    f.write_bytes(content)
    assert is_own_output(f) is ours


def test_an_npz_is_ours_by_its_meta_format(tmp_path):
    np.savez(tmp_path / "a.npz", meta=np.array(json.dumps({"format": "hetero-jax-hcattention-codebook"})))
    np.savez(tmp_path / "b.npz", meta=np.array(json.dumps({"format": "other"})))
    np.savez(tmp_path / "c.npz", centroids=np.zeros(3))
    (tmp_path / "d.npz").write_bytes(b"PK\x03\x04 not really a zip")
    assert [is_own_output(tmp_path / f"{n}.npz") for n in "abcd"] == [True, False, False, False]


def test_every_writer_marks_its_output(tmp_path):
    """What each writer produces is recognised, so a re-run may replace it: profile JSON and figure, ranking,
    codebook, a benchmark's JSON and figure, and an HLO dump's first line."""
    profile = load_profile(shipped_profile_path("smollm2-135m"))
    profile.to_json(tmp_path / "p.json")
    plot_profile(profile, tmp_path / "roles.svg")
    CARanking(scores=np.ones((2, 3)), votes=np.ones((2, 3), np.int64), model="tiny", head_dim=8).save(
        tmp_path / "r.json")
    KeyCodebook(np.zeros((1, 4, 2), np.float32)).save(tmp_path / "cb")
    results.write_json(tmp_path / "bench.json", {"rows": []})
    fig, ax = results.subplots(1, 1)
    ax.plot([0, 1])
    results.save_figure(fig, tmp_path / "bench.png", "t")
    write_text(tmp_path / "dump.hlo.txt", f"{bench_step_ops.HLO_DUMP_MARK}\nHloModule m\n")
    assert bench_step_ops.HLO_DUMP_MARK.startswith(TEXT_MARK)
    made = sorted(os.listdir(tmp_path))
    assert made == ["bench.json", "bench.png", "cb.npz", "dump.hlo.txt", "p.json", "r.json", "roles.svg"]
    assert [f for f in made if not is_own_output(tmp_path / f)] == []
    profile.to_json(tmp_path / "p.json")  # and replaced by the next run
    results.write_json(tmp_path / "bench.json", {"rows": [1]})
    assert json.loads((tmp_path / "bench.json").read_text())["rows"] == [1]


def test_a_file_not_ours_is_refused_and_kept(tmp_path):
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    message = (f"--out {notes} exists and is not a file hetero-jax wrote, so it was not replaced; choose another "
               f"--out, or move {notes} away first")
    with pytest.raises(OutputError, match=re.escape(message)):
        check_output_path(notes, "--out")
    with pytest.raises(OutputError, match=re.escape(message)):
        write_text(notes, "x", "--out")
    link = tmp_path / "link.json"
    link.symlink_to(notes)  # a link is judged by what it points to
    with pytest.raises(OutputError, match="is not a file hetero-jax wrote"):
        write_text(link, "x")
    assert notes.read_text() == '{"mine": 1}' and sorted(os.listdir(tmp_path)) == ["link.json", "notes.json"]


def test_a_results_file_is_updated_in_place_whoever_wrote_it(tmp_path):
    """RESULTS.md is edited, not replaced: a section is set and every other line kept."""
    md = tmp_path / "RESULTS.md"
    md.write_text("# My results\n\nhand-written notes\n")
    results.update_results_section("demo", "| a |\n| - |", md)
    assert md.read_text().startswith("# My results\n\nhand-written notes\n") and "<!-- BEGIN demo -->" in md.read_text()
    args = bench_needle.parse_args(["--write-results", "--results-file", str(md), "--out", str(tmp_path / "n.json")])
    assert args.results_file == md


@pytest.mark.parametrize("flag, name", [("--out", "profile.json"), ("--plot", "roles.png")])
def test_profile_refuses_a_user_file_before_any_work(tmp_path, capsys, monkeypatch, flag, name):
    def boom(*a, **k):
        raise AssertionError("work started for an output that should have been refused")
    monkeypatch.setattr(hub, "load", boom)
    monkeypatch.setattr(calibrate, "calibration_windows", boom)
    data, user = tmp_path / "data.txt", tmp_path / name
    data.write_text("text " * 100)
    user.write_bytes(b"\x89PNG\r\n\x1a\n" if name.endswith(".png") else b'{"my": "notes"}')
    outputs = {"--out": str(tmp_path / "new.json"), "--plot": str(tmp_path / "new.png"), flag: str(user)}
    before = snapshot(tmp_path)
    assert main(["profile", "--data", str(data), "--out", outputs["--out"], "--plot", outputs["--plot"]]) == 2
    err = capsys.readouterr().err
    assert f"{flag} {user} exists and is not a file hetero-jax wrote" in err and "Traceback" not in err
    assert snapshot(tmp_path) == before


def test_bench_refuses_a_user_file_before_any_work(tmp_path, capsys):
    user = tmp_path / "needle.json"
    user.write_text("[1, 2, 3]\n")
    with pytest.raises(SystemExit) as e:
        bench_needle.parse_args(["--preset", "cpu", "--out", str(user)])
    assert e.value.code == 2 and f"--out {user} exists and is not a file hetero-jax wrote" in capsys.readouterr().err
    assert user.read_text() == "[1, 2, 3]\n"


def test_step_ops_dump_replaces_only_its_own_dumps(tmp_path, capsys):
    dump = tmp_path / "hlo"
    dump.mkdir()
    name = bench_step_ops.hlo_filename("full", 1024)
    (dump / name).write_text(f"{bench_step_ops.HLO_DUMP_MARK}\nHloModule earlier\n")
    argv = ["--policies", "full", "--lengths", "1024", "--dump-hlo", str(dump), "--out", str(tmp_path / "s.json")]
    assert bench_step_ops.parse_args(argv).dump_hlo == dump
    (dump / name).write_text("HloModule someone_elses\n")
    with pytest.raises(SystemExit) as e:
        bench_step_ops.parse_args(argv)
    assert e.value.code == 2 and f"--dump-hlo {dump / name} exists and is not a file hetero-jax wrote" in (
        capsys.readouterr().err)


def test_svgz_mark_is_read_through_gzip(tmp_path):
    _figure(tmp_path / "a.svgz", "svgz", figure_metadata("svgz"))
    assert b"<dc:title>hetero-jax<" in gzip.decompress((tmp_path / "a.svgz").read_bytes())


def test_recount_reads_a_dump_past_its_mark(tmp_path):
    from step_ops_hlo import count_step_ops
    from test_step_ops import HLO

    (tmp_path / bench_step_ops.hlo_filename("full", 1024)).write_text(f"{bench_step_ops.HLO_DUMP_MARK}\n{HLO}")
    payload = {"rows": [{"policy": "full", "length": 1024}], "config": {}}
    assert bench_step_ops.recount(payload, tmp_path) == 1
    counts = count_step_ops(HLO)
    assert {k: payload["rows"][0][k] for k in counts} == counts


def test_the_committed_plots_are_marked_as_ours():
    """RESULTS.md's commands re-draw docs/*.png in place: each must be known as a benchmark's output."""
    plots = sorted((Path(__file__).resolve().parent.parent / "docs").glob("*.png"))
    assert plots and [p.name for p in plots if not is_own_output(p)] == []


def test_a_command_replaces_only_its_own_kind_of_output(tmp_path, capsys):
    """Any mark of ours counted: `profile --out cb.npz` replaced an HCAttention codebook (9 CPU-minutes of
    training) with a profile of another model, and a benchmark's --out could take a profile's place. An output
    of ours of another kind is refused before any work, naming both kinds; one of the same kind is replaced."""
    from hetero_jax.errors import OutputError
    from hetero_jax.io.files import check_output_path, check_outputs
    from hetero_jax.io.own_outputs import FIGURE, output_kind

    profile = tmp_path / "p.json"
    profile.write_text('{"format": "hetero-jax-head-profile"}')
    ranking = tmp_path / "r.json"
    ranking.write_text('{"format": "hetero-jax-contextkeeper-ranking"}')
    figure = _figure(tmp_path / "f.png", "png", figure_metadata("png"))
    assert [output_kind(p) for p in (profile, ranking, figure)] == [
        "hetero-jax-head-profile", "hetero-jax-contextkeeper-ranking", FIGURE]
    assert check_output_path(profile, "--out", kind="hetero-jax-head-profile")
    with pytest.raises(OutputError, match=r"--out .*r\.json exists and is another kind of hetero-jax output "
                                          r"\(hetero-jax-contextkeeper-ranking, where this command writes a "
                                          r"hetero-jax-head-profile\)"):
        check_outputs({"--out": ranking}, kinds={"--out": "hetero-jax-head-profile"})
    with pytest.raises(OutputError, match="another kind"):
        check_outputs({"--plot": profile}, kinds={"--plot": FIGURE})
    with pytest.raises(OutputError, match="another kind"):
        check_outputs({"--out": figure}, kinds={"--out": "hetero-jax-benchmark"})
    empty = tmp_path / "e.json"
    empty.write_text("")
    assert check_output_path(empty, "--out", kind="hetero-jax-benchmark")  # an empty file: anything may replace
    # through the command: a profile run refuses the ranking before it loads a model
    assert main(["profile", "--data", "pydoc", "--tokens", "64", "--out", str(ranking)]) == 2
    assert "another kind of hetero-jax output" in capsys.readouterr().err
    assert ranking.read_text() == '{"format": "hetero-jax-contextkeeper-ranking"}'


@pytest.mark.parametrize("ext", ["jpg", "tif", "webp", "raw"])
def test_profile_refuses_a_plot_format_that_cannot_carry_the_mark(ext, tmp_path, capsys):
    """`--plot roles.jpg` worked once, then the same command refused to replace it (JPEG has no creator field):
    refused up front, naming the formats that work."""
    assert main(["profile", "--data", "pydoc", "--out", str(tmp_path / "p.json"),
                 "--plot", str(tmp_path / f"roles.{ext}")]) == 2
    err = capsys.readouterr().err
    assert f".{ext} has no field for hetero-jax's mark, so a re-run could not replace it; use one of" in err
    assert ".png" in err and ".pdf" in err and os.listdir(tmp_path) == []
