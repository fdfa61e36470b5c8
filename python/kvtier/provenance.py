"""Where a result came from: commit, machine, versions. Recorded in every ``--json`` output."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

import torch


def git_commit() -> str | None:
    """The checkout's HEAD commit, or None outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def machine() -> dict:
    """CPU/GPU description of this machine."""
    info = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def provenance(**extra) -> dict:
    """{"commit", "machine", "timestamp", **extra}."""
    return {"commit": git_commit(), "machine": machine(),
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **extra}
