"""The installed stagemesh version (one place; stages compare it across nodes)."""

from __future__ import annotations

from importlib import metadata


def stagemesh_version() -> str:
    try:
        return metadata.version("stagemesh")
    except metadata.PackageNotFoundError:
        return "0+unknown"
