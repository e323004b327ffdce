import json

from fxopt import report

REPORT = {
    "model": "toy",
    "mode": "fx",
    "nodes_before": 10,
    "nodes_after": 7,
    "verified": True,
    "max_abs_error": 0.0,
    "latency_ms": {"original": 2.0, "optimized": 1.0},
    "speedup": 2.0,
    "ops_before": {"relu": 2, "add": 1},
    "ops_after": {"relu": 1, "add": 1},
    "passes": [
        {
            "name": "cse",
            "round": 0,
            "changed": True,
            "time_ms": 0.5,
            "stats": {"merged": 1},
            "skipped": [{"node": "r", "reason": "random op"}],
        }
    ],
}


def test_markdown_lists_models_passes_and_removed_ops():
    text = report.markdown([REPORT])
    assert "| toy (fx) | 10→7 | cse | — | — | yes | 0 | 2.000 | 1.000 | 2.00× |" in text
    assert "| cse | 0 | True | 0.50 | merged=1 |" in text
    assert "relu −1" in text


def test_explain_lists_skips_with_reasons():
    assert report.explain(REPORT) == ["cse (round 0): r: random op"]


def test_json_and_plot(tmp_path):
    report.write_json([REPORT], tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())[0]["model"] == "toy"
    png = report.plot([REPORT, REPORT | {"model": "other"}], tmp_path / "p.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
