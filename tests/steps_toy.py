"""Step functions for tests/test_steps.py: importable by name in Ray workers (the tests put this folder on their
PYTHONPATH)."""

import os
import signal
from pathlib import Path


def number(key: dict, inputs: dict) -> float:
    """key's value plus the sum of its inputs."""
    return key["value"] + sum(inputs.values())


def flaky(key: dict, inputs: dict) -> float:
    """Killed (SIGKILL, as the OOM killer does) on its first `kills` tries, counted in key's marker folder."""
    marker = Path(key["marker"])
    tries = len(list(marker.glob("try-*")))
    (marker / f"try-{tries}").touch()
    if tries < key["kills"]:
        os.kill(os.getpid(), signal.SIGKILL)
    return key["value"] + sum(inputs.values())


def broken(key: dict, inputs: dict) -> float:
    raise RuntimeError(f"step {key['value']} always fails")
