"""List the functions and classes of each module of an installed DeepSpeed, for the names map.

    python tools/deepspeed_module_names.py PATH/TO/site-packages/deepspeed [--out FILE]

Writes ``terascale/integrations/deepspeed/deepspeed_modules.json.gz``: for every module of
the package (``runtime.zero.stage3``, ...), the names it defines with ``def`` or ``class``
(private ones too), and those it takes from another DeepSpeed module (``from .x import Y``)
with where they come from: names only, read from the syntax tree, never code or values. The
names map serves each one that terascale does not provide as a stand-in that refuses when it
is used ([Note: refused when used, not when imported] in ``unprovided.py``). Module-level
constants are left out on purpose: a stand-in for a value would compare unequal without a
word, where a missing one fails at the import.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "terascale" / "integrations" / "deepspeed" / "deepspeed_modules.json.gz"


def _module_path(root: Path, file: Path) -> str:
    parts = list(file.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _origin(module: str, is_package: bool, node: ast.ImportFrom) -> str | None:
    """The DeepSpeed module path (after ``deepspeed.``) an import takes names from, or None."""
    if node.level == 0:
        name = node.module or ""
        if name != "deepspeed" and not name.startswith("deepspeed."):
            return None
        return name.removeprefix("deepspeed").lstrip(".")
    base = module.split(".") if module else []
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join([*base, *([node.module] if node.module else [])])


def _names(module: str, is_package: bool, tree: ast.Module) -> tuple[set[str], dict[str, str]]:
    """The functions and classes a module defines, and the names it takes from other
    DeepSpeed modules (name -> ``origin.path:name``)."""
    defined: set[str] = set()
    taken: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.ImportFrom) and (origin := _origin(module, is_package, node)) is not None:
            for alias in node.names:
                if alias.name != "*":
                    taken[alias.asname or alias.name] = f"{origin}:{alias.name}"
    # Private names too: a test or a tool that imports one for a path it never takes still
    # loads (dunder names are the module machinery's).
    own = {n for n in defined if not n.startswith("__")}
    return own, {n: o for n, o in taken.items() if not n.startswith("__") and n not in own}


def scan(root: Path) -> tuple[dict[str, list[str]], dict[str, dict[str, str]]]:
    modules: dict[str, list[str]] = {}
    imported: dict[str, dict[str, str]] = {}
    for file in sorted(root.rglob("*.py")):
        if "__pycache__" in file.parts:
            continue
        try:
            tree = ast.parse(file.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        path = _module_path(root, file)
        defined, imported[path] = _names(path, file.name == "__init__.py", tree)
        modules[path] = sorted(defined)
    # Follow each taken name to where it is defined; keep those that end at a function, a
    # class or a module (a constant gets no stand-in: see the names map's Note).
    def final(origin: str, seen: int = 0) -> str | None:
        module, _, name = origin.partition(":")
        if name in modules.get(module, ()) or (f"{module}.{name}" if module else name) in modules:
            return origin
        nxt = imported.get(module, {}).get(name)
        return final(nxt, seen + 1) if nxt and seen < 20 else None

    resolved = {path: {n: o for n, o in ((n, final(o)) for n, o in sorted(taken.items())) if o}
                for path, taken in imported.items()}  # fmt: skip
    return modules, {path: taken for path, taken in resolved.items() if taken}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("package", type=Path, help="the installed deepspeed package folder")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    if not (args.package / "__init__.py").is_file():
        print(f"{args.package}: not a package folder (no __init__.py)", file=sys.stderr)
        return 2
    version = "unknown"
    info = args.package / "git_version_info_installed.py"
    if info.is_file():
        for line in info.read_text().splitlines():
            if line.startswith("version="):
                version = line.split("=", 1)[1].strip().strip("'\"")
    modules, imported = scan(args.package)
    listing = {"deepspeed": version, "modules": modules, "imported": imported}
    data = json.dumps(listing, indent=0, sort_keys=True).encode()
    args.out.write_bytes(gzip.compress(data, mtime=0))  # mtime 0: the same listing, the same bytes
    print(f"{len(modules)} modules, {sum(map(len, modules.values()))} functions and classes, "
          f"{sum(map(len, imported.values()))} names taken from other modules, of DeepSpeed {version} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
