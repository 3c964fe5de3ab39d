"""The package's layering (README, "How it works"): imports point down only, and the
engine's parts are built from what they use, not from the engine."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "terascale"


def _imported_by(module: str) -> set[str]:
    code = f"import sys, {module}; print(' '.join(sorted(m for m in sys.modules if m.startswith('terascale'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def _imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_lower_layers_do_not_import_higher_ones() -> None:
    engine = _imported_by("terascale.engine")
    assert not {"terascale.pipe", "terascale.entry", "terascale.integrations"} & engine, sorted(engine)
    # zero takes ZeroOptions, never the config (zero.Init alone reads one: DeepSpeed's API).
    for path in sorted((PACKAGE / "zero").glob("*.py")):
        imported = _imports_of(path)
        assert not any(m.startswith("terascale.engine") for m in imported), path
        if path.name != "init.py":
            assert not any(m.startswith("terascale.config") for m in imported), path
    pipe = _imported_by("terascale.pipe")
    assert "terascale.entry" not in pipe and "terascale.engine" in pipe  # the pipeline engine is a layer over it


def test_engine_parts_are_not_handed_the_engine() -> None:
    from terascale.engine.checkpointing import Checkpointer
    from terascale.engine.monitor import Reporter
    from terascale.engine.observe import Observer
    from terascale.engine.resilience import Resilience

    for part in (Checkpointer, Resilience, Observer, Reporter):
        params = inspect.signature(part.__init__).parameters
        assert "engine" not in params, part
        assert all("Engine" not in str(p.annotation) for p in params.values()), part
