"""The DAG tiler: cover a graph with a library of fused-kernel patterns, optimally.

    graph ─ canonical op graph ─ match patterns ─ solve (max coverage, min tiles) ─ report

    >>> from fxopt.tiling import Graph, tile
    >>> g = Graph.from_json({"nodes": [
    ...     {"id": "a", "op": "add", "inputs": ["x", "y"]},
    ...     {"id": "n", "op": "layer_norm", "inputs": ["a"]}], "outputs": ["n"]})
    >>> tile(g, "transformer").tiles
    [Tile(pattern='add_layer_norm', nodes={'a': 'a', 'n': 'n'}, cost=1.0)]

Modules: :mod:`~fxopt.tiling.graph` (the graph and its JSON/fx forms),
:mod:`~fxopt.tiling.pattern` (patterns, libraries), :mod:`~fxopt.tiling.placements`
(``match``, ``find_placements``), :mod:`~fxopt.tiling.solve` (exact search, ILP,
schedulability), :mod:`~fxopt.tiling.tiling` (``tile``), :mod:`~fxopt.tiling.draw` (DOT /
PNG). See docs/tiling.md.
"""

from fxopt.tiling.errors import TilingInputError
from fxopt.tiling.graph import Graph, Node
from fxopt.tiling.pattern import BUILTIN_LIBRARIES, Library, Pattern, load_library
from fxopt.tiling.placements import Placement, match
from fxopt.tiling.tiling import Tile, Tiling, tile

__all__ = [
    "BUILTIN_LIBRARIES",
    "Graph",
    "Library",
    "Node",
    "Pattern",
    "Placement",
    "Tile",
    "Tiling",
    "TilingInputError",
    "load_library",
    "match",
    "tile",
]
