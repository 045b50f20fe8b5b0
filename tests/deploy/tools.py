"""Where the deployment checkers live: ``make install`` puts them in place, a missing one fails the test.

The Python ones (docker-compose, hadolint, kubernetes-validate, helm) are test extras in the project's
virtual environment; helm-sdkpy needs Python >= 3.12 and gets a virtual environment of its own
(``.venv-helm``); promtool and prometheus come from the Debian ``prometheus`` package.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
HELM_SDK_PYTHON = REPO / ".venv-helm" / "bin" / "python"


def tool(name: str) -> str:
    """The path of a checker: next to this interpreter first (the venv), then on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise AssertionError(f"{name} is not installed: run `make install` (it installs every deployment checker)")
    return found


def helm_sdk_python() -> str:
    """The Python 3.12 interpreter that has helm-sdkpy (Helm's library) installed."""
    if not HELM_SDK_PYTHON.exists():
        raise AssertionError(f"{HELM_SDK_PYTHON} is missing: run `make install` (needs a Python >= 3.12 under pyenv)")
    return str(HELM_SDK_PYTHON)
