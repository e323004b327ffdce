"""Pictures of a tiling: Graphviz DOT text and a matplotlib PNG, tiles coloured by pattern.

DOT is written here as text (render it with ``dot -Tsvg``); the PNG needs no Graphviz: a
layered drawing where a node's row is its longest-path depth from the graph inputs and
nodes of one row are spread in topological order.

    >>> from fxopt.tiling import Graph, tile
    >>> g = Graph.from_json({"nodes": [{"id": "a", "op": "add", "inputs": ["x", "y"]},
    ...     {"id": "n", "op": "layer_norm", "inputs": ["a"]}], "outputs": ["n"]})
    >>> print(to_dot(tile(g, "transformer")).splitlines()[3])
      subgraph cluster_0 {
"""

from __future__ import annotations

from pathlib import Path

from fxopt.tiling.tiling import Tiling

__all__ = ["draw_png", "to_dot"]

UNCOVERED = "#ffffff"


def _palette(tiling: Tiling) -> dict[str, str]:
    """A colour per pattern used, in library order (matplotlib's tab20)."""
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    cmap = colormaps["tab20"]
    used = list(tiling.tiles_per_pattern())
    return {name: to_hex(cmap(k % 20), keep_alpha=False) for k, name in enumerate(used)}


def _quote(*lines: str) -> str:
    """A DOT string literal; several arguments become lines of one label."""
    escaped = (text.replace("\\", "\\\\").replace('"', '\\"') for text in lines)
    return '"' + "\\n".join(escaped) + '"'


def to_dot(tiling: Tiling) -> str:
    """The graph as DOT: one filled cluster per tile, labelled with its pattern;
    uncovered nodes white with a dashed border. External inputs are left out."""
    graph, colours = tiling.graph, _palette(tiling)
    where = tiling.tile_index()
    lines = [
        "digraph tiling {",
        "  rankdir=TB;",
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
    ]
    for k, t in enumerate(tiling.tiles):
        lines.append(f"  subgraph cluster_{k} {{")
        lines.append(
            f"    label={_quote(t.pattern)}; style=rounded; color={_quote(colours[t.pattern])};"
        )
        for node_id in t.nodes.values():
            label = _quote(node_id, graph.node(node_id).op)
            fill = _quote(colours[t.pattern])
            lines.append(f"    {_quote(node_id)} [label={label}, fillcolor={fill}];")
        lines.append("  }")
    for n in graph.nodes:
        if n.id not in where:
            label = _quote(n.id, n.op)
            lines.append(
                f'  {_quote(n.id)} [label={label}, fillcolor="{UNCOVERED}", style="dashed"];'
            )
    for n in graph.nodes:
        for slot, v in enumerate(n.inputs):
            if v is not None and v in graph.index:
                lines.append(f"  {_quote(v)} -> {_quote(n.id)} [label={slot}, fontsize=8];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def draw_png(tiling: Tiling, path: str | Path, *, title: str | None = None) -> Path:
    """Draw the tiling to ``path`` (PNG) and return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    graph, colours = tiling.graph, _palette(tiling)
    where = tiling.tile_index()
    depth = [0] * len(graph)
    for v in range(len(graph)):  # nodes are in topological order
        depth[v] = max((depth[p] + 1 for p in graph.preds[v]), default=0)
    rows: dict[int, list[int]] = {}
    for v in range(len(graph)):
        rows.setdefault(depth[v], []).append(v)
    width = max((len(r) for r in rows.values()), default=1)
    xy: dict[int, tuple[float, float]] = {}
    for d, members in rows.items():
        for k, v in enumerate(members):
            xy[v] = ((k + 0.5) * width / len(members), -d)
    labelled = len(graph) <= 300
    # About 1.2 inch per column and 0.5 per row, within what a PNG viewer opens.
    fig_w = min(max(6.0, 1.2 * width), 40.0)
    fig_h = min(max(4.0, 0.5 * len(rows)), 120.0)
    fig, ax = plt.subplots(figsize=(fig_w, fig_h), dpi=80 if len(graph) > 1000 else 100)
    for v in range(len(graph)):
        for p in graph.preds[v]:
            (x0, y0), (x1, y1) = xy[p], xy[v]
            same = p in where and where.get(p) == where.get(graph.nodes[v].id)
            ax.plot([x0, x1], [y0, y1], color="#444444" if same else "#bbbbbb", lw=0.6, zorder=1)
    for v, n in enumerate(graph.nodes):
        k = where.get(n.id)
        colour = colours[tiling.tiles[k].pattern] if k is not None else UNCOVERED
        x, y = xy[v]
        ax.scatter(
            [x],
            [y],
            s=120 if labelled else 12,
            c=[colour],
            marker="s",
            zorder=2,
            edgecolors="#333333" if k is not None else "#cc0000",
            linewidths=0.6,
        )
        if labelled:
            ax.annotate(
                n.op,
                (x, y),
                fontsize=6,
                ha="center",
                va="bottom",
                xytext=(0, 5),
                textcoords="offset points",
            )
    handles = [Patch(facecolor=c, edgecolor="#333333", label=name) for name, c in colours.items()]
    handles.append(Patch(facecolor=UNCOVERED, edgecolor="#cc0000", label="uncovered"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.set_axis_off()
    ax.set_title(
        title
        or f"{tiling.covered}/{tiling.nodes} nodes covered ({tiling.coverage:.1%}) by "
        f"{tiling.tile_count} tiles of library '{tiling.library.name}'"
    )
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
