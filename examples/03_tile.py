"""Which fused kernels cover a model? Tile a small BERT, a ResNet, and a hand-written graph."""

from fxopt import zoo
from fxopt.capture import trace
from fxopt.tiling import Graph, Pattern, tile

if __name__ == "__main__":
    # 1. A model from the zoo, captured with torch.fx, against the built-in libraries.
    for name, options, library in (
        ("bert", {"layers": 2, "seq": 8}, "transformer"),
        ("resnet18", {"image": 32}, "cnn"),
    ):
        entry = zoo.create(name, **options)
        result = tile(trace(entry.model, entry.example_inputs), library)
        print(
            f"{name:9}: {result.covered}/{result.nodes} nodes ({result.coverage:.0%}) "
            f"in {result.tile_count} tiles, {result.time_ms:.1f} ms; "
            f"uncovered: {dict((op, len(ids)) for op, ids in result.uncovered_by_op().items())}"
        )

    # 2. Your own graph and kernels. A 5-op chain where stopping at the first full
    #    coverage (abc + d + e) needs 3 tiles and the optimum (ab + cde) needs 2.
    ops = ["relu", "sigmoid", "tanh", "exp", "neg"]
    graph = Graph.from_json(
        {
            "nodes": [
                {"id": op, "op": op, "inputs": [ops[i - 1] if i else "x"]}
                for i, op in enumerate(ops)
            ],
            "outputs": ["neg"],
        }
    )

    def kernel(name, *chain):
        nodes = [
            {"id": op, "op": op, "inputs": [chain[i - 1] if i else "*"]}
            for i, op in enumerate(chain)
        ]
        return Pattern(name, nodes)

    library = [
        kernel("abc", "relu", "sigmoid", "tanh"),
        kernel("ab", "relu", "sigmoid"),
        kernel("cde", "tanh", "exp", "neg"),
        kernel("cd", "tanh", "exp"),
        *(kernel(op, op) for op in ops),
    ]
    for solver in ("exact", "ilp", "greedy"):
        result = tile(graph, library, solver=solver)
        print(f"chain, {solver:6}: {[t.pattern for t in result.tiles]}")
