"""The one report shape of every ``stagemesh bench`` kind, and where it goes.

Contract: ``build_report(kind, started_at=, config=, results=, ratios=)`` is the only place a report is
assembled. Every kind's report has the same keys (``ENVELOPE_KEYS``): ``schema`` (``SCHEMA``), ``kind``,
``command`` (argv, as ``stagemesh ...``), ``started_at`` / ``finished_at`` (ISO 8601, UTC), ``environment``
(``environment()``), ``config`` (the settings the run used), ``results`` (the kind's own measurements) and
``ratios`` (a list of records, each naming what it compares with what; empty where the kind compares
nothing). ``flags_of(args)`` turns a kind's parsed flags into its ``config``; ``emit(report, args, text)``
writes ``--output`` and prints either ``text`` (the kind's table) or, with ``--json``, the report itself.
Times inside ``results`` are whatever unit their keys say (``_s``, ``_ms``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import socket
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

SCHEMA = "stagemesh-bench/2"
ENVELOPE_KEYS = ("schema", "kind", "command", "started_at", "finished_at", "environment", "config", "results",
                 "ratios")


def now() -> _dt.datetime:
    """When a run starts: pass it to ``build_report`` as ``started_at``."""
    return _dt.datetime.now(_dt.UTC)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def environment(local_mlx: bool = False) -> dict[str, Any]:
    """This host as a report records it: its name, CPU and memory, the versions of Python, stagemesh, MLX and
    mlx-lm (from package metadata, importing nothing), and with ``local_mlx`` (the kind ran a model here)
    MLX's backend."""
    import psutil

    backend = None
    if local_mlx:
        from stage_worker.model.device import current_backend

        backend = current_backend()
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "backend": backend,
        "versions": {"python": sys.version.split()[0], "stagemesh": _version("stagemesh"),
                     "mlx": _version("mlx"), "mlx-lm": _version("mlx-lm")},
    }


def flags_of(args: argparse.Namespace) -> dict[str, Any]:
    """The flags a run was given, for its report's ``config`` (without the CLI's own entries and the report
    flags)."""
    skip = {"command", "kind", "output", "json"}
    return {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in skip}


def build_report(kind: str, *, started_at: _dt.datetime, config: Mapping[str, Any], results: Any,
                 ratios: Sequence[Mapping[str, Any]] = (), command: Sequence[str] | None = None,
                 env: Mapping[str, Any] | None = None, local_mlx: bool = False) -> dict[str, Any]:
    """The report of one run of ``stagemesh bench KIND`` (see the module docstring for its keys)."""
    return {
        "schema": SCHEMA,
        "kind": kind,
        "command": list(command) if command is not None else ["stagemesh", *sys.argv[1:]],
        "started_at": started_at.isoformat(timespec="seconds"),
        "finished_at": now().isoformat(timespec="seconds"),
        "environment": dict(env) if env is not None else environment(local_mlx),
        "config": dict(config),
        "results": results,
        "ratios": [dict(r) for r in ratios],
    }


def emit(report: dict[str, Any], args: argparse.Namespace, text: str) -> None:
    """Write the report to ``args.output`` (when given) and print ``text``, or the report with ``args.json``."""
    output, as_json = args.output, args.json
    document = json.dumps(report, indent=1)
    if output:
        path = Path(output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(document + "\n")
    print(document if as_json else text)
    if output:
        print(f"stagemesh bench {report['kind']}: wrote {output}", file=sys.stderr)
