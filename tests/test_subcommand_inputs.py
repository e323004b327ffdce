"""User mistakes in ``--input`` shared by ``fxopt convert``, ``remat`` and ``tile``: each
must exit 2 with one line, never 1 with "internal error"."""

from __future__ import annotations

import pytest

from fxopt.cli import main
from tests.extras import require_circle

COMMANDS = {
    "convert": ["-o", "{tmp}/m.circle"],
    "remat": [],
    "tile": [],
}


# The shapes are parsed and the random inputs allocated in fxopt.models.load: a failed
# allocation ("DefaultCPUAllocator: can't allocate memory") is a user error.
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_input_too_large_to_allocate_is_a_user_error(command, tmp_path, capfd):
    if command == "convert":
        require_circle()
    extra = [a.format(tmp=tmp_path) for a in COMMANDS[command]]
    code = main([command, "zoo:mlp", "--input", "100000x100000x100000", *extra])
    err = capfd.readouterr().err
    assert code == 2, err
    assert "internal error" not in err and "100000x100000x100000" in err
