"""Hand-edited or damaged profile files (ours, the HeteroCache authors' format, HCAttention codebooks) are refused
with a ProfileError naming the file, the entry and the value, never a traceback; the authors' files are identified by
their content, not their name; reclustered/build_profile refuse thresholds that calibration refuses."""

import copy
import json
import math
import re
import warnings

import numpy as np
import pytest

from hetero_jax.policies.hcattention.codebook import KeyCodebook, load_codebook
from hetero_jax.profile import HeadProfile, ProfileError, ProfileSettings, build_profile, load_profile
from test_profile_format import synthetic_profile


def _profile():
    """A small calibrated-looking profile with copy scores (every settings field filled)."""
    return synthetic_profile(n_layers=4, copy_steps=8)


@pytest.fixture(scope="module")
def doc():
    return _profile().to_dict()


def _first(grid):
    return grid[0]


# (case, edit of the document, words the message must hold besides the file name)
OUR_CASES = [
    ("model_list", lambda d: d.__setitem__("model", []), "model = []"),
    ("model_null", lambda d: d.__setitem__("model", None), "model = None"),
    ("settings_null", lambda d: d.__setitem__("settings", None), "settings = None"),
    ("settings_list", lambda d: d.__setitem__("settings", [1]), "settings = [1]"),
    ("tau_copy_str", lambda d: d["settings"].__setitem__("tau_copy", "high"), "settings.tau_copy = 'high'"),
    ("tau_stable_str", lambda d: d["settings"].__setitem__("tau_stable", "abc"), "settings.tau_stable = 'abc'"),
    ("tau_sim_big", lambda d: d["settings"].__setitem__("tau_sim", 3.0), "settings.tau_sim = 3.0"),
    ("top_k_str", lambda d: d["settings"].__setitem__("top_k", "16"), "settings.top_k = '16'"),
    ("top_k_float", lambda d: d["settings"].__setitem__("top_k", 16.0), "settings.top_k = 16.0"),
    ("top_k_eq_tokens", lambda d: d["settings"].__setitem__("top_k", 64), "settings.top_k = 64 is not below"),
    ("top_k_over_tokens", lambda d: d["settings"].__setitem__("top_k", 65), "settings.top_k = 65 is not below"),
    ("tokens_str", lambda d: d["settings"].__setitem__("tokens_per_sample", "64"), "settings.tokens_per_sample"),
    ("roles_float", lambda d: _first(d["roles"]).__setitem__(0, 1.7), "roles[0][0] = 1.7"),
    ("roles_str", lambda d: _first(d["roles"]).__setitem__(0, "1"), "roles[0][0] = '1'"),
    ("roles_bool", lambda d: _first(d["roles"]).__setitem__(0, True), "roles[0][0] = True"),
    ("pivot_float", lambda d: d["clusters"].__setitem__(0, [{"pivot": 1.9, "satellites": [0]}]),
     "clusters[0][0].pivot = 1.9"),
    ("clusters_layer_dict", lambda d: d["clusters"].__setitem__(0, {"pivot": 1, "satellites": [2]}), "clusters[0]"),
    ("head_dim_str", lambda d: d["model"].__setitem__("head_dim", "64"), "model.head_dim = '64'"),
    ("num_layers_str", lambda d: d["model"].__setitem__("num_layers", "4"), "model.num_layers = '4'"),
    ("name_int", lambda d: d["model"].__setitem__("name", 5), "model.name = 5"),
    ("source_list", lambda d: d.__setitem__("source", ["x"]), "source = ['x']"),
    ("stability_str", lambda d: _first(d["stability"]).__setitem__(0, "0.5"), "stability[0][0] = '0.5'"),
    ("copy_score_7", lambda d: _first(d["copy_score"]).__setitem__(0, 7.0), "copy_score[0][0] = 7.0"),
]


def _refused(path, doc, edit, words):
    """``doc`` edited by ``edit`` and written to ``path``: load_profile refuses it naming the file and ``words``."""
    d = copy.deepcopy(doc)
    edit(d)
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError) as e:
        load_profile(path)
    assert str(path) in str(e.value) and words in str(e.value)


@pytest.mark.parametrize("case,edit,words", OUR_CASES, ids=[c[0] for c in OUR_CASES])
def test_damaged_own_profile_is_refused_naming_file_entry_value(tmp_path, doc, case, edit, words):
    path = tmp_path / f"{case}.json"
    _refused(path, doc, edit, words)
    with pytest.raises(ProfileError):
        HeadProfile.from_json(path)


def test_good_own_profile_still_loads_and_round_trips(tmp_path):
    p = _profile()
    path = tmp_path / "p.json"
    p.to_json(path)
    assert load_profile(path) == p


# ------------------------------------------------------------ the authors' format
def _official_doc(n_layers=32, n_heads=8, long_names=False):
    """A file in the authors' release format, built here (layer l: head 0 pivot of heads 1-2, head 3 anchor,
    head 4 volatile, the rest pivot 5 of 6.. when there are enough heads)."""
    names = (("Stable_Unique", "Decaying_Unique", "Similar_Leader", "Similar_Member") if long_names
             else ("anchor", "volatile", "pivot", "satellite"))
    type_map = dict(zip(names, (1, 2, 3, 4)))
    row = [3, 4, 4, 1, 2] + [3] + [4] * (n_heads - 6)
    alloc = [-1.0, 1.0, 1.0, 1.0, -1.0, -1.0] + [1.0] * (n_heads - 6)
    rel = {"0": [1, 2], "5": list(range(6, n_heads))}
    counts = {names[i]: n_layers * row.count(i + 1) for i in range(4)}
    return {"meta": {"type_map": type_map, "counts": counts},
            "classification_matrix": [list(row) for _ in range(n_layers)],
            "allocation_matrix": [list(alloc) for _ in range(n_layers)],
            "leader_member_relations": [dict(rel) for _ in range(n_layers)]}


OFFICIAL_CASES = [
    ("type_map_list", lambda d: d["meta"].__setitem__("type_map", list(d["meta"]["type_map"])), "meta.type_map"),
    ("type_map_code_str", lambda d: d["meta"]["type_map"].__setitem__("anchor", "x"), "meta.type_map.anchor = 'x'"),
    ("relations_int", lambda d: d.__setitem__("leader_member_relations", 5), "leader_member_relations = 5"),
    ("relations_layer_list", lambda d: d["leader_member_relations"].__setitem__(0, [1, 2]),
     "leader_member_relations[0] = [1, 2]"),
    ("counts_str", lambda d: d["meta"].__setitem__("counts", {"anchor": "many"}), "meta.counts.anchor = 'many'"),
    ("counts_list", lambda d: d["meta"].__setitem__("counts", [1, 2]), "meta.counts = [1, 2]"),
    ("pivot_key_str", lambda d: d["leader_member_relations"].__setitem__(0, {"a": ["b"]}), "'a'"),
    ("satellite_str", lambda d: d["leader_member_relations"].__setitem__(0, {"0": ["b"]}), "'b'"),
    ("codes_float", lambda d: d["classification_matrix"][0].__setitem__(0, 3.5), "classification_matrix[0][0] = 3.5"),
    ("meta_null", lambda d: d.__setitem__("meta", None), "meta = None"),
]


@pytest.mark.parametrize("case,edit,words", OFFICIAL_CASES, ids=[c[0] for c in OFFICIAL_CASES])
def test_damaged_authors_profile_is_refused(tmp_path, case, edit, words):
    _refused(tmp_path / f"official_profile_llama-3.1-8b-instruct.{case}.json", _official_doc(), edit, words)


@pytest.mark.parametrize("name", ["official_profile_llama-3.1-8b-instruct.json", "authors_profile.json",
                                  "profile.json"])
def test_authors_llama_file_is_identified_by_content_not_name(tmp_path, name):
    path = tmp_path / name
    path.write_text(json.dumps(_official_doc(32, 8)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # identified: no warning
        p = load_profile(path)
    assert (p.model_name, p.architecture, p.head_dim) == ("meta-llama/Llama-3.1-8B-Instruct", "llama", 128)
    assert (p.settings.tau_stable, p.settings.top_k, p.settings.tokens_per_sample) == (0.5, 1024, 10_000)


def test_authors_qwen_file_is_identified_by_content(tmp_path):
    path = tmp_path / "renamed.json"
    path.write_text(json.dumps(_official_doc(48, 8, long_names=True)))
    p = load_profile(path)
    assert (p.model_name, p.architecture, p.head_dim, p.settings.tau_stable) == (
        "Qwen/Qwen2.5-14B-Instruct", "qwen2", 128, 0.4)


def test_ambiguous_content_falls_back_to_the_name(tmp_path):
    # A Llama-shaped grid in the other naming: the content alone does not say; the name does.
    d = _official_doc(32, 8, long_names=True)
    named = tmp_path / "official_profile_llama-3.1-8b-instruct.json"
    named.write_text(json.dumps(d))
    assert load_profile(named).head_dim == 128
    plain = tmp_path / "profile.json"
    plain.write_text(json.dumps(d))
    with pytest.warns(RuntimeWarning, match="head_dim and calibration settings are unknown"):
        p = load_profile(plain)
    assert (p.head_dim, p.settings.tau_stable) == (None, None)


def test_unknown_authors_file_loads_with_a_warning(tmp_path):
    path = tmp_path / "official_profile_llama-3.1-8b-instruct.json"  # the name cannot override the shape
    path.write_text(json.dumps(_official_doc(4, 8)))
    with pytest.warns(RuntimeWarning, match=r"4 layers x 8 KV heads.*drift threshold falls back"):
        p = load_profile(path)
    assert (p.head_dim, p.model_name, p.settings, p.architecture) == (None, None, ProfileSettings(), "llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # told head_dim and settings: nothing to warn about
        load_profile(path, head_dim=128, settings=ProfileSettings(tau_stable=0.5))


DEEPSEEK = "Head_Analysis_deepseek-r1-distill-llama-8b_topk1024_th0.5_sim0.4_step5000.json"


@pytest.mark.parametrize("name, named", [(DEEPSEEK, "deepseek-r1-distill-llama-8b"),
                                         ("official_profile_mistral-7b.json", "mistral-7b"),
                                         ("qwen2.5-14b-instruct.json", "Qwen/Qwen2.5-14B-Instruct")])
def test_a_file_named_for_another_model_is_not_labelled_by_its_content(tmp_path, name, named):
    """The release also publishes a DeepSeek-R1-Distill-Llama-8B file of the Llama file's shape and role names:
    a file whose name names another model gets no identity (a warning, as for an unknown file)."""
    path = tmp_path / name
    path.write_text(json.dumps(_official_doc(32, 8)))
    with pytest.warns(RuntimeWarning) as w:
        p = load_profile(path)
    assert len(w) == 1 and str(w[0].message).startswith(
        f"{path}: a HeteroCache release profile whose content (32 layers x 8 KV heads, role names anchor, pivot, "
        "satellite, volatile) is that of the published meta-llama/Llama-3.1-8B-Instruct file but whose file name "
        f"names {named!r}, so it is not labelled meta-llama/Llama-3.1-8B-Instruct: its head_dim and calibration ")
    assert (p.model_name, p.head_dim, p.settings.tokens_per_sample) == (None, None, None)
    if name == DEEPSEEK:  # the release's file name gives its settings
        assert (p.architecture, p.settings.top_k, p.settings.tau_stable, p.settings.tau_sim) == ("llama", 1024, 0.5,
                                                                                                0.4)
        assert "step 5000" in p.settings.calibration_data
        assert "drift threshold is tau_stable 0.5 with no chance correction" in str(w[0].message)


def test_release_file_names_give_their_settings(tmp_path):
    published = tmp_path / "Head_Analysis_llama-3.1-8b-instruct_topk1024_th0.5_sim0.5_step5000.json"
    published.write_text(json.dumps(_official_doc(32, 8)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the published file's name: its published settings, no warning
        p = load_profile(published)
    assert (p.model_name, p.settings.top_k, p.settings.tau_sim, p.settings.tokens_per_sample) == (
        "meta-llama/Llama-3.1-8B-Instruct", 1024, 0.5, 10_000)
    other = tmp_path / "Head_Analysis_llama-3.1-8b-instruct_topk512_th0.6_sim0.55_step4000.json"
    other.write_text(json.dumps(_official_doc(32, 8)))
    with pytest.warns(RuntimeWarning, match="whose file name's settings are not the published file's: its "
                                            "calibration length is unknown"):
        p = load_profile(other)
    assert (p.model_name, p.head_dim) == ("meta-llama/Llama-3.1-8B-Instruct", 128)
    s = p.settings
    assert (s.top_k, s.tau_stable, s.tau_sim, s.tokens_per_sample, s.samples) == (512, 0.6, 0.55, None, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # told the settings: nothing left unknown
        load_profile(other, settings=ProfileSettings(top_k=512, tokens_per_sample=5000))
    bad = tmp_path / "Head_Analysis_llama-3.1-8b-instruct_topk1024_th1.5_sim0.5_step5000.json"
    bad.write_text(json.dumps(_official_doc(32, 8)))
    with pytest.raises(ProfileError, match=rf"^{re.escape(str(bad))}: the file name's th = 1.5 is not a finite "
                                           r"number in \[0, 1\]; a file name in the release's pattern"):
        load_profile(bad)


# ------------------------------------------------------------ `hetero-jax profile` flags refused before any work
def _cli_refused(capsys, monkeypatch, argv, needle):
    from hetero_jax.cli import main
    from hetero_jax.io import hub  # where the profile command loads from

    monkeypatch.setattr(hub, "load", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    assert main(["profile", "--data", "pydoc", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err, err


def test_tau_copy_without_a_copy_phase_is_refused(tmp_path, capsys, monkeypatch):
    _cli_refused(capsys, monkeypatch, ["--out", str(tmp_path / "p.json"), "--copy-steps", "0", "--tau-copy", "0.2"],
                 "--tau-copy 0.2 sets the copy rule of the copy phase, which --copy-steps 0 turns off: drop "
                 "--tau-copy (it would change nothing) or give --copy-steps N > 0")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("flag", ["--out", "--plot"])
def test_outputs_inside_the_package_are_refused(tmp_path, capsys, monkeypatch, flag):
    """--out on the shipped profile would change the default profile of every run; nothing in the installed
    package is an output."""
    import hashlib
    import os

    import hetero_jax
    from hetero_jax.profile import shipped_profile_path

    shipped = shipped_profile_path("smollm2-135m")
    before = hashlib.sha256(open(shipped, "rb").read()).hexdigest()
    package = os.path.dirname(os.path.abspath(hetero_jax.__file__))
    for target in (shipped, os.path.join(package, "data", "new.png"), os.path.join(tmp_path, "link", "x.png")):
        if "link" in target:
            os.symlink(os.path.join(package, "data"), tmp_path / "link")
        argv = (["--out", target] if flag == "--out" else ["--out", str(tmp_path / "p.json"), "--plot", target])
        _cli_refused(capsys, monkeypatch, argv, f"{flag} {target} lies inside the installed hetero_jax package "
                                                f"({package}): writing there would replace data shipped with the "
                                                "library")
    assert hashlib.sha256(open(shipped, "rb").read()).hexdigest() == before
    assert not os.path.exists(os.path.join(package, "data", "new.png"))


# ------------------------------------------------------------ thresholds of reclustered / build_profile
BAD_TAUS = [dict(tau_sim=5.0), dict(tau_stable=-1.0), dict(tau_stable=math.nan), dict(tau_copy=7.0),
            dict(tau_sim="0.7"), dict(tau_stable=math.inf), dict(tau_sim=True)]


@pytest.mark.parametrize("kw", BAD_TAUS, ids=[str(k) for k in BAD_TAUS])
def test_reclustered_refuses_thresholds_calibration_refuses(kw):
    p = _profile()
    name = next(iter(kw))
    with pytest.raises(ProfileError, match=rf"{name} = .* is not a finite number in \[0, 1\]"):
        p.reclustered(**kw)
    args = {**dict(tau_stable=0.5, tau_sim=0.5, tau_copy=None), **kw}
    with pytest.raises(ProfileError, match=rf"{name} = "):
        build_profile(p.stability, p.similarity_matrix, copy_score=p.copy_score, **args)


def test_reclustered_with_good_thresholds_still_works(tmp_path):
    r = _profile().reclustered(tau_stable=0.4, tau_sim=0.7, tau_copy=0.5)
    assert (r.settings.tau_stable, r.settings.tau_sim, r.settings.tau_copy) == (0.4, 0.7, 0.5)
    r.to_json(tmp_path / "r.json")
    assert load_profile(tmp_path / "r.json") == r


# ------------------------------------------------------------ HCAttention codebooks
def _codebook_file(tmp_path, name="cb.npz", **meta_edit):
    cb = KeyCodebook(np.random.default_rng(0).normal(size=(2, 8, 4)).astype(np.float16), model="tiny",
                     architecture="llama", head_dim=16, num_kv_heads=2, settings={"steps": 3})
    path = cb.save(tmp_path / name)
    if meta_edit:
        with np.load(path) as z:
            meta = json.loads(str(z["meta"]))
            cents = np.array(z["centroids"])
        np.savez(path, centroids=cents, meta=np.array(json.dumps({**meta, **meta_edit})))
    return path


def test_truncated_codebook_is_refused(tmp_path):
    path = _codebook_file(tmp_path)
    raw = open(path, "rb").read()
    cut = tmp_path / "cut.npz"
    cut.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ProfileError, match=r"cut\.npz' is not readable"):
        load_codebook(cut)


@pytest.mark.parametrize("edit,words", [(dict(head_dim="16"), "meta.head_dim = '16'"),
                                        (dict(num_kv_heads=2.0), "meta.num_kv_heads = 2.0"),
                                        (dict(settings=[1, 2]), "meta.settings = [1, 2]"),
                                        (dict(model=["x"]), "meta.model = ['x']")])
def test_codebook_with_bad_meta_is_refused(tmp_path, edit, words):
    path = _codebook_file(tmp_path, **edit)
    with pytest.raises(ProfileError) as e:
        load_codebook(path)
    assert "cb.npz" in str(e.value) and words in str(e.value)


def test_good_codebook_still_loads(tmp_path):
    cb = load_codebook(_codebook_file(tmp_path))
    assert (cb.head_dim, cb.num_kv_heads, cb.settings) == (16, 2, {"steps": 3})
