"""`fxopt tile`: JSON keys, the readable report, drawings, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fxopt.cli import main

#: The keys `fxopt tile --json` promises scripts (listed in docs/tiling.md).
TILE_KEYS = ("nodes", "covered", "tile_count", "tiles", "time_ms")

GRAPH = {
    "nodes": [
        {"id": "m1", "op": "linear", "inputs": ["x"]},
        {"id": "g1", "op": "gelu", "inputs": ["m1"]},
        {"id": "m2", "op": "linear", "inputs": ["g1"]},
        {"id": "a", "op": "add", "inputs": ["m2", "x"]},
        {"id": "n", "op": "layer_norm", "inputs": ["a"]},
        {"id": "s", "op": "sigmoid", "inputs": ["n"]},
    ],
    "outputs": ["s"],
}


@pytest.fixture
def graph_file(tmp_path):
    path = tmp_path / "graph.json"
    path.write_text(json.dumps(GRAPH))
    return path


def test_json_has_the_documented_keys(graph_file, capsys):
    assert main(["tile", str(graph_file), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for key in TILE_KEYS:
        assert key in report
    assert (report["nodes"], report["covered"], report["tile_count"]) == (6, 5, 2)
    first = {"pattern": "mlp_gelu", "nodes": {"l1": "m1", "g": "g1", "l2": "m2"}}
    assert report["tiles"][0] == first  # ties: the larger tile at the earliest node
    assert report["uncovered"] == [{"id": "s", "op": "sigmoid"}]
    assert report["optimal"] is True


def test_table_library_file_and_drawings(graph_file, tmp_path, capsys):
    library = tmp_path / "lib.yaml"
    library.write_text(
        "patterns:\n"
        "  - name: everything_but_sigmoid\n"
        "    nodes:\n"
        "      - {id: l1, op: linear, inputs: ['*']}\n"
        "      - {id: g, op: gelu, inputs: [l1]}\n"
        "      - {id: l2, op: linear, inputs: [g]}\n"
        "      - {id: a, op: add, inputs: [l2, '*']}\n"
        "      - {id: n, op: layer_norm, inputs: [a]}\n"
        "  - {name: conv, nodes: [{id: c, op: conv}]}\n"
    )
    dot, png = tmp_path / "t.dot", tmp_path / "t.png"
    args = ["tile", str(graph_file), "--library", str(library), "--dot", str(dot)]
    assert main([*args, "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "5/6 nodes covered (83.3%) by 1 tiles" in out
    assert "everything_but_sigmoid" in out and "sigmoid" in out
    assert "conv (no conv in the graph)" in out  # unused, not an error
    text = dot.read_text()
    assert text.startswith("digraph tiling {") and 'label="everything_but_sigmoid"' in text
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_model_spec_is_captured_and_tiled(capsys):
    assert main(["tile", "zoo:mlp", "--library", "transformer+singles", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["covered"] == report["nodes"] > 0
    assert report["tiles_per_pattern"]["linear_relu"] == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["tile", "missing.json"], "graph file not found: missing.json"),
        (["tile", "zoo:mlp", "--library", "nope"], "unknown library 'nope'"),
        (["tile", "zoo:mlp", "--library", "nope.yaml"], "library file not found: nope.yaml"),
    ],
)
def test_user_mistakes_exit_2(args, message, capsys):
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_bad_graph_file_exits_2_with_one_line_naming_the_entry(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"nodes": [{"id": "a", "op": "relu", "inputs": ["a"]}]}))
    result = subprocess.run(
        [sys.executable, "-m", "fxopt.cli", "tile", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "bad.json: the graph has a cycle: a → a" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_wrong_input_shape_is_one_line_naming_the_op(mode, capfd):
    assert main(["tile", "zoo:mlp", "--input", "1x3x5", "--mode", mode]) == 2
    line = _one_line(capfd.readouterr().err)
    assert "aten.addmm on float32[256], float32[3, 5], float32[784, 256]" in line
    assert "module 'fc1' (Linear)" in line


@pytest.mark.parametrize("role", ["graph", "library"])
def test_a_binary_graph_or_library_file_is_a_user_error(role, graph_file, tmp_path, capfd):
    binary = tmp_path / ("g.json" if role == "graph" else "lib.yaml")
    binary.write_bytes(bytes(range(128, 256)))  # not UTF-8
    argv = [str(binary)] if role == "graph" else [str(graph_file), "--library", str(binary)]
    assert main(["tile", *argv]) == 2
    assert f"{role} file {binary} is not a text file" in _one_line(capfd.readouterr().err)


@pytest.mark.parametrize("option", ["--png", "--dot", "--save-graph"])
def test_unwritable_outputs_fail_before_tiling(option, tmp_path, capfd):
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    out = blocker / "out.file"
    assert main(["tile", "zoo:no_such_model", option, str(out)]) == 2
    assert _one_line(capfd.readouterr().err).startswith(f"fxopt: error: {option} {out}:")
