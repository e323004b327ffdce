"""The CLI/JSON contract of docs/architecture.md, shared by the API and CLI tests."""

#: Keys every `fxopt optimize --json` object (and `fxopt.optimize(...).report`) carries.
OPTIMIZE_KEYS = (
    "model",
    "passes",
    "nodes_before",
    "nodes_after",
    "verified",
    "max_abs_error",
    "latency_ms",
    "speedup",
)
