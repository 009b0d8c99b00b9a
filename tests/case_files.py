"""Case files (``tests/*_cases.py``, which pytest does not collect on its own) run in a process of their own:
for cases that need JAX started with other flags, or a process where nothing else runs."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run_case_file(name: str, *pytest_args: str, env: dict | None = None, timeout: float = 900) -> str:
    """pytest on ``tests/<name>`` in a fresh process (``pytest_args`` after the file, e.g. ``-k``; ``env`` its
    environment, default this one's); asserts it exited 0 with cases passed and none skipped. Returns its
    stdout."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                           os.path.join(HERE, name), *pytest_args], cwd=os.path.dirname(HERE),
                          env=env, capture_output=True, text=True, timeout=timeout)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, tail
    return proc.stdout
