import os

import pytest

from fxopt.errors import UserInputError
from fxopt.paths import read_text, writable, writable_directory


def test_writable_accepts_a_new_file_in_a_missing_folder(tmp_path):
    assert writable(tmp_path / "a" / "b" / "report.md", "--report").name == "report.md"


def test_writable_refuses_a_directory_a_file_parent_and_a_read_only_folder(tmp_path):
    with pytest.raises(UserInputError, match=r"--plot .* is a directory"):
        writable(tmp_path, "--plot")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserInputError, match="is a file, not a directory"):
        writable(tmp_path / "file" / "out.png", "--png")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as a user who can write anywhere (root)")
        with pytest.raises(UserInputError, match="permission denied"):
            writable(locked / "out.md", "--report")
    finally:
        locked.chmod(0o700)


def test_writable_directory(tmp_path):
    assert writable_directory(tmp_path / "new", "--out") == tmp_path / "new"
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserInputError, match="not a directory"):
        writable_directory(tmp_path / "f", "--out")


def test_read_text_names_missing_binary_and_directory_inputs(tmp_path):
    with pytest.raises(UserInputError, match="config not found"):
        read_text(tmp_path / "missing.yaml", "config")
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)))
    with pytest.raises(UserInputError, match="not a text file"):
        read_text(binary, "config")
    with pytest.raises(UserInputError, match="is a directory"):
        read_text(tmp_path, "graph file")
    (tmp_path / "ok.yaml").write_text("a: 1\n")
    assert read_text(tmp_path / "ok.yaml", "config") == "a: 1\n"
