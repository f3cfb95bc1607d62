"""Paths and tools the deployment tests share. The tools are installed by `make install` (.venv and
.venv/compose): a missing one is a failed install, never a skip."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
COMPOSE = ROOT / ".venv" / "compose" / "bin" / "docker-compose"
KUBE_VALIDATE = VENV_BIN / "kubernetes-validate"
CHART = ROOT / "helm" / "tokenmill"
