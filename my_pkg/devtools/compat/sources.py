"""The sources of one vLLM distribution: a wheel (fetched once into a cache), a directory, or the installed vLLM.

``SourceTree`` reads ``.py`` files by path and parses them with ``ast`` on demand; nothing is installed or
imported. ``fetch_wheel`` downloads a release's wheel with ``pip download vllm==X --no-deps
--only-binary=:all:`` into a cache folder, reusing a wheel already there. A source that cannot be obtained
(no such wheel, not a zip, no vLLM installed) raises ``CompatError``.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from my_pkg.devtools.compat.resolver import Resolver

__all__ = ["CompatError", "SourceTree", "default_cache_dir", "fetch_wheel"]


class CompatError(RuntimeError):
    """The vLLM sources could not be obtained."""


class SourceTree:
    """The ``.py`` files of a vLLM distribution, parsed on demand; never imported.

    ``read(path)`` returns the text of a path such as ``vllm/config/__init__.py``, or None.
    """

    def __init__(self, read: Callable[[str], str | None], origin: str) -> None:
        self._read = read
        self.origin = origin
        self._parsed: dict[str, ast.Module | None] = {}
        self.files_read: set[str] = set()

    @classmethod
    def from_wheel(cls, wheel: str | Path) -> SourceTree:
        try:
            archive = zipfile.ZipFile(wheel)
        except (OSError, zipfile.BadZipFile) as exc:
            raise CompatError(f"cannot open {wheel} as a wheel: {exc}") from exc
        names = set(archive.namelist())

        def read(path: str) -> str | None:
            return archive.read(path).decode("utf-8") if path in names else None

        return cls(read, str(wheel))

    @classmethod
    def from_directory(cls, site: str | Path) -> SourceTree:
        """Sources under ``site`` (the folder that holds the ``vllm`` package)."""
        root = Path(site)

        def read(path: str) -> str | None:
            file = root / path
            return file.read_text(encoding="utf-8") if file.is_file() else None

        return cls(read, str(root / "vllm"))

    @classmethod
    def installed(cls) -> SourceTree:
        """The vLLM importable from this interpreter (located, not imported)."""
        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            raise CompatError("vLLM is not installed in this environment")
        return cls.from_directory(Path(list(spec.submodule_search_locations)[0]).parent)

    def _path(self, module: str) -> tuple[str, bool] | None:
        base = module.replace(".", "/")
        for path, is_package in ((f"{base}.py", False), (f"{base}/__init__.py", True)):
            if path not in self._parsed:
                text = self._read(path)
                if text is not None:
                    self.files_read.add(path)
                self._parsed[path] = ast.parse(text, filename=path) if text is not None else None
            if self._parsed[path] is not None:
                return path, is_package
        return None

    def module(self, module: str) -> ast.Module | None:
        found = self._path(module)
        return self._parsed[found[0]] if found else None

    def is_package(self, module: str) -> bool:
        found = self._path(module)
        return bool(found and found[1])

    def version(self) -> str | None:
        """``vllm.__version__`` when it is a string literal somewhere along its imports."""
        found = Resolver(self).lookup("vllm", "__version__")
        value = getattr(found, "value", None) if found else None
        return value.value if isinstance(value, ast.Constant) and isinstance(value.value, str) else None


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/my_pkg/vllm-wheels``, or ``~/.cache/my_pkg/vllm-wheels``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "my_pkg" / "vllm-wheels"


def fetch_wheel(version: str, cache_dir: Path) -> Path:
    """The vLLM ``version`` wheel from ``cache_dir``, downloaded there first when missing (no dependencies)."""
    cached = sorted(cache_dir.glob(f"vllm-{version}-*.whl"))
    if cached:
        return cached[0]
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as staging:  # a partial download never looks cached
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            f"vllm=={version}",
            "--no-deps",
            "--only-binary=:all:",
            "--quiet",
            "-d",
            staging,
        ]
        print(f"downloading the vLLM {version} wheel (no dependencies) into {cache_dir} ...", flush=True)
        proc = subprocess.run(command, capture_output=True, text=True)
        wheels = sorted(Path(staging).glob(f"vllm-{version}-*.whl"))
        if proc.returncode != 0 or not wheels:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise CompatError(f"`{' '.join(command[2:])}` failed: {' / '.join(tail) or 'no wheel for this platform'}")
        target = cache_dir / wheels[0].name
        shutil.move(str(wheels[0]), target)
    return target
