"""Shared by the benchmark scripts' tests: a stand-in machine record and the check of a usage error."""

from __future__ import annotations

import pytest

MACHINE = {"cpu_model": "Test CPU", "cpu_count": 2, "ram_bytes": 2**34, "loadavg_1_5_15": [1.0, 1.0, 1.0]}


def usage_error(capsys, call, argv, *needles) -> str:
    """``call(argv)`` exits 2 with a one-line 'error: ...' holding every one of ``needles``, no traceback;
    returns the line."""
    with pytest.raises(SystemExit) as e:
        call(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, (e.value.code, err)
    line = err.rstrip("\n").splitlines()[-1]
    assert ": error: " in line, line
    for needle in needles:
        assert needle in line, (needle, line)
    return line
