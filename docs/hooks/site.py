"""mkdocs hooks: the repository's top-level pages (README as the landing page, RESULTS,
WRITEUP, the benchmarks' README) and the results they link to become pages of the site,
with their links rewritten to the site's layout. Nothing is copied into docs/."""

from __future__ import annotations

from pathlib import Path

from markdown.extensions import Extension
from markdown.preprocessors import Preprocessor
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
#: Site path -> repository path of each generated page.
PAGES = {
    "index.md": "README.md",
    "RESULTS.md": "RESULTS.md",
    "WRITEUP.md": "WRITEUP.md",
    "benchmarks.md": "benchmarks/README.md",
}
#: (repository link, site link) in the top-level pages.
LINKS = (
    ("](docs/", "]("),
    ("](benchmarks/README.md)", "](benchmarks.md)"),
    ("[results/](results/)", "`results/`"),
    ("](../RESULTS.md)", "](RESULTS.md)"),
    ("](../docs/", "]("),
)


def _rewritten(text: str) -> str:
    for old, new in LINKS:
        text = text.replace(old, new)
    return text


def on_files(files, config):
    for site_path, repo_path in PAGES.items():
        content = _rewritten((ROOT / repo_path).read_text())
        files.append(File.generated(config, site_path, content=content))
    linked = [*(ROOT / "results").glob("*.json"), *(ROOT / "results").glob("*.png")]
    linked += (ROOT / "notebooks").glob("*.ipynb")  # downloads, linked from the README
    for path in sorted(linked):
        site_path = path.relative_to(ROOT).as_posix()
        files.append(File.generated(config, site_path, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown, page, config, files):
    # docs/*.md link the top-level pages as ../RESULTS.md (right on GitHub).
    return markdown.replace("](../", "](")


class _DoctestFences(Preprocessor):
    """Fence doctest examples (``>>>`` lines and the output after them, up to a blank
    line) as ``pycon`` code, so docstrings render as code rather than as quotes."""

    def run(self, lines: list[str]) -> list[str]:
        out: list[str] = []
        fenced = False
        in_code = False
        for line in lines:
            stripped = line.lstrip()
            if stripped.startswith("```"):
                in_code = not in_code
            if not in_code and not fenced and stripped.startswith(">>>"):
                indent = line[: len(line) - len(stripped)]
                out += ["", f"{indent}```pycon"]
                fenced = True
            elif fenced and not stripped:
                out += [f"{indent}```", ""]
                fenced = False
            out.append(line)
        if fenced:
            out.append(f"{indent}```")
        return out


class _DoctestExtension(Extension):
    def extendMarkdown(self, md):  # Python-Markdown's name
        md.preprocessors.register(_DoctestFences(md), "fxopt_doctest_fences", 29)


def on_config(config):
    config.markdown_extensions.append(_DoctestExtension())
    return config
