"""fxopt.circle on TICO's own module tests (``test/modules/op`` and ``net``), scored as
TICO's runner scores them, beside TICO on the same modules.

TICO's repository carries one test module per operator and per small network; each is a
``TestModuleBase`` with ``get_example_inputs()`` (and sometimes ``get_dynamic_shapes()``,
tolerances ``rtol``/``atol``). Modules tagged ``skip`` or ``test_negative`` (TICO expects
those to fail) are counted apart. For each module:

- fxopt: ``fxopt.circle.convert`` with its default validation (onert, else LiteRT, on the
  example and on a second input); a refusal or a validation error is a miss, with its reason;
- TICO: ``tico.convert``, then the file run in onert (else LiteRT) on the example and
  compared with the module's tolerance (TICO's runner defaults: rtol = atol = 1e-4...
  TICO's own reference interpreter is not installed here).

Each test file runs in its own process (a crashing runtime takes only that file with it).
Writes results/tico_modules.json; benchmarks/make_results.py renders it.

    python benchmarks/tico_modules.py --tico-repo /path/to/TICO [--only cat,copy] [--jobs 2]

``--tico-repo`` is a TICO checkout or a bare git directory (its ``HEAD`` is read).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

RESULTS_FILE = "tico_modules.json"
TIMEOUT_S = 600


def _tree(repo: Path, into: Path) -> Path:
    """TICO's ``test`` package under ``into``: copied from a work tree, or extracted from a
    bare repository's HEAD."""
    if (repo / "test" / "modules").is_dir():
        return repo
    archive = subprocess.run(
        ["git", f"--git-dir={repo}", "archive", "HEAD", "test"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def _module_files(root: Path, only: set[str]) -> list[str]:
    names = []
    for group in ("op", "net"):
        for path in sorted((root / "test" / "modules" / group).glob("*.py")):
            if path.stem == "__init__" or (only and path.stem not in only):
                continue
            names.append(f"test.modules.{group}.{path.stem}")
    return names


# --- one test file, in a child process ----------------------------------------------------


def _tagged(cls, tag: str) -> bool:
    return bool(getattr(cls, f"__tag_{tag}", False))


def _run_file(root: Path, module_name: str) -> list[dict]:
    sys.path.insert(0, str(root))
    import torch

    module = importlib.import_module(module_name)
    base = importlib.import_module("test.modules.base").TestModuleBase
    rows = []
    for name, cls in inspect.getmembers(module, inspect.isclass):
        if cls.__module__ != module_name or not issubclass(cls, base) or cls is base:
            continue
        row: dict = {"module": f"{module_name.removeprefix('test.modules.')}.{name}"}
        if _tagged(cls, "skip"):
            rows.append(row | {"status": "skipped by TICO"})
            continue
        if _tagged(cls, "test_negative"):
            rows.append(row | {"status": "negative test"})
            continue
        if hasattr(cls, "get_calibration_data") or hasattr(cls, "get_compile_config"):
            row["tico_config"] = True  # quantized or configured: TICO-specific setups
        torch.manual_seed(0)
        try:
            model = cls().eval()
            args, kwargs = model.get_example_inputs()
            dynamic = model.get_dynamic_shapes() if hasattr(model, "get_dynamic_shapes") else None
        except Exception as error:  # the module itself cannot be built here
            rows.append(row | {"status": "unbuildable", "error": _reason(error)})
            continue
        if any(type(m).__module__.startswith("tico.") for m in model.modules()):
            # a layer of TICO's own (tico.ops: its custom Circle operators), not PyTorch's
            rows.append(row | {"status": "uses TICO's own layers"})
            continue
        tolerance = {k: getattr(model, k) for k in ("rtol", "atol") if hasattr(model, k)}
        row["fxopt"] = _fxopt(model, args, kwargs, dynamic)
        row["tico"] = _tico(model, args, kwargs, dynamic, tolerance)
        rows.append(row | {"status": "scored"})
    return rows


def _reason(error: BaseException) -> str:
    """The error's first line, without this machine's paths (a file keeps its name)."""
    from circle import error_line

    return re.sub(r"/(?:[\w.+-]+/)+([\w.+-]+)", r"\1", error_line(error))


def _fxopt(model, args, kwargs, dynamic) -> dict:
    from fxopt import circle

    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            file = circle.convert(
                model, args, kwargs=kwargs or None, dynamic_shapes=dynamic, memory_check=False
            )
    except Exception as error:
        return {"validated": False, "error": _reason(error)}
    validation = file.validation
    return {
        "validated": bool(validation is not None and validation.runtime is not None),
        "runtime": None if validation is None else validation.runtime,
        "operators": sum(file.op_counts.values()),
        "convert_s": round(time.perf_counter() - start, 3),
    }


def _tico(model, args, kwargs, dynamic, tolerance: dict) -> dict:
    import numpy as np
    import torch
    from torch.utils import _pytree as pytree

    from circle import op_names
    from fxopt.circle.runtime import LiteRTSession, Session

    try:
        import tico
    except ImportError:
        return {"validated": False, "error": "tico is not installed"}
    with torch.no_grad():
        expected = pytree.tree_leaves(model(*args, **kwargs))
    try:
        with warnings.catch_warnings(), tempfile.TemporaryDirectory() as tmp:
            warnings.simplefilter("ignore")
            path = Path(tmp) / "model.circle"
            tico.convert(model, args, kwargs or None, dynamic_shapes=dynamic).save(str(path))
            data = path.read_bytes()
    except Exception as error:
        return {"validated": False, "converted": False, "error": _reason(error)}
    row: dict = {"converted": True, "operators": len(op_names(data))}
    inputs = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    for runtime, session_type in (("onert", Session), ("litert", LiteRTSession)):
        try:
            with session_type(data) as session:
                outputs = session.run(inputs)
        except Exception as error:
            row[f"{runtime}_error"] = _reason(error)
            continue
        expected_arrays = [
            np.asarray(e.detach().numpy() if isinstance(e, torch.Tensor) else e)
            for e in expected
            if e is not None
        ]
        row["runtime"] = runtime
        row["validated"] = len(outputs) == len(expected_arrays) and all(
            o.size == e.size
            and np.allclose(
                o.reshape(e.shape).astype(np.float64),
                e.astype(np.float64),
                rtol=tolerance.get("rtol", 1e-4),
                atol=tolerance.get("atol", 1e-4),
                equal_nan=True,
            )
            for o, e in zip(outputs, expected_arrays)
        )
        break
    row.setdefault("validated", False)
    return row


# --- the driver -------------------------------------------------------------------------


def _child(root: Path, module_name: str) -> list[dict]:
    command = [sys.executable, __file__, "--child", module_name, "--root", str(root)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return [{"module": module_name, "status": "crashed", "error": f"timeout {TIMEOUT_S} s"}]
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("ROWS "):
            return json.loads(line[5:])
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return [{"module": module_name, "status": "crashed", "error": tail[:200]}]


def summarize(rows: list[dict]) -> dict:
    scored = [r for r in rows if r["status"] == "scored"]
    both = [r for r in scored if r["fxopt"]["validated"] and r["tico"]["validated"]]
    return {
        "modules": len(rows),
        "scored": len(scored),
        "by_status": dict(Counter(r["status"] for r in rows)),
        "fxopt_validated": sum(r["fxopt"]["validated"] for r in scored),
        "tico_converted": sum(bool(r["tico"].get("converted")) for r in scored),
        "tico_validated": sum(r["tico"]["validated"] for r in scored),
        "both_validated": len(both),
        "operators_fxopt_both": sum(r["fxopt"]["operators"] for r in both),
        "operators_tico_both": sum(r["tico"]["operators"] for r in both),
        "fxopt_fewer_ops": sum(r["fxopt"]["operators"] < r["tico"]["operators"] for r in both),
        "fxopt_more_ops": sum(r["fxopt"]["operators"] > r["tico"]["operators"] for r in both),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tico-repo", type=Path, help="a TICO checkout or bare git directory")
    parser.add_argument("--only", default="", help="comma-separated test files (cat,copy)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--update",
        action="store_true",
        help="with --only: replace those files' rows in the results file, keep the rest",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        print("ROWS " + json.dumps(_run_file(options.root, options.child)))
        return 0
    if options.tico_repo is None:
        parser.error("--tico-repo is required (a TICO checkout or its git directory)")
    from rich.progress import track

    from common import RESULTS, command_line, machine_info, write_json

    with tempfile.TemporaryDirectory() as tmp:
        root = _tree(options.tico_repo.resolve(), Path(tmp))
        only = {x for x in options.only.split(",") if x}
        files = _module_files(root, only)
        rows: list[dict] = []
        start = time.perf_counter()
        with ThreadPoolExecutor(options.jobs) as pool:
            for found in track(
                pool.map(lambda name: _child(root, name), files),
                total=len(files),
                description="TICO modules",
            ):
                rows.extend(found)
    out = options.out or RESULTS / RESULTS_FILE
    runtime_s = time.perf_counter() - start
    if options.update:
        previous = json.loads(out.read_text())
        redone = {name.removeprefix("test.modules.") for name in files}
        kept = [r for r in previous["rows"] if r["module"].rsplit(".", 1)[0] not in redone]
        rows = sorted(kept + rows, key=lambda r: r["module"])
        runtime_s += previous.get("runtime_s", 0.0)
    summary = summarize(rows)
    print(json.dumps(summary, indent=1))
    for row in rows:
        if row["status"] == "scored" and not row["fxopt"]["validated"]:
            print(f"  fxopt misses {row['module']}: {row['fxopt'].get('error')}")
    if not only or options.out or options.update:
        write_json(
            out,
            {
                "machine": machine_info(),
                "command": command_line(),
                "runtime_s": runtime_s,
                "summary": summary,
                "rows": rows,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
