"""The stand-in switch ([Note: the stand-in switch] in terascale/integrations/deepspeed/standin.py).

With ``TERASCALE_AS_DEEPSPEED=1`` a fresh interpreter of this environment sees terascale as
``deepspeed``: the module, every ``deepspeed.X`` path the installed transformers, accelerate,
TRL and PEFT import (read from their source, so a new release's imports are checked too), the
distribution metadata their version checks read. Off, ``terascale-standin.pth`` imports nothing
and installs no finder. A real DeepSpeed in the environment (a fake one here: a package folder,
or only its dist-info) stops ``import deepspeed`` and ``terascale run --as-deepspeed`` with a
message naming both. The .pth reaches site-packages by both installs: the editable one this
environment has, and a wheel built from a clean copy of the sources.

Each check is a fresh interpreter, since start-up is what the switch acts on. Serially, on
this 2-core machine, the file takes about 15 s: the on-probe (which imports transformers,
accelerate, TRL and PEFT's DeepSpeed modules) ~6 s, the two builds ~5 s.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from terascale.integrations.deepspeed import names, standin

REPO = Path(__file__).resolve().parents[1]
PTH = "terascale-standin.pth"
SITE = Path(sysconfig.get_paths()["purelib"])
LIBRARIES = ("transformers", "accelerate", "trl", "peft")
_IMPORT = re.compile(r"(?m)^[ \t]*(?:import[ \t]+(?P<module>deepspeed[\w.]*)"
                     r"|from[ \t]+(?P<from>deepspeed[\w.]*)[ \t]+import[ \t]+(?P<names>\([^)]*\)|[^\n#]*))")


def _python(code: str, *, switch: str | None, pythonpath: str | None = None, cwd: Path | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in (standin.ENV_VAR, "PYTHONPATH")}
    env["OMP_NUM_THREADS"] = "1"
    if switch is not None:
        env[standin.ENV_VAR] = switch
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd or REPO, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def _json(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _deepspeed_imports() -> list[tuple[str, tuple[str, ...]]]:
    """Every ``import deepspeed.X`` / ``from deepspeed.X import a, b`` in the libraries' source
    (read with a pattern: parsing the files that name deepspeed would take seconds)."""
    found: set[tuple[str, tuple[str, ...]]] = set()
    for library in LIBRARIES:
        root = SITE / library
        for path in root.rglob("*.py") if root.is_dir() else ():
            data = path.read_bytes()
            if b"deepspeed" not in data:
                continue
            for match in _IMPORT.finditer(data.decode(errors="replace")):
                if match["module"]:
                    found.add((match["module"], ()))
                else:
                    attrs = match["names"].strip("()").replace("\\\n", " ").split(",")
                    found.add((match["from"], tuple(sorted(a.split()[0] for a in attrs if a.strip()))))
    return sorted(found)


# What the on-probe runs in a fresh interpreter with the switch on.
_ON_PROBE = r"""
import importlib, importlib.metadata as md, json, sys
from packaging import version
imports = json.loads(sys.argv[1])
finders = [type(f).__name__ for f in sys.meta_path]
import deepspeed
out = {"finders": finders, "terascale": getattr(deepspeed, "__terascale__", False), "version": deepspeed.__version__,
       "dist_version": md.version("deepspeed"), "packages": md.packages_distributions().get("deepspeed"),
       "at_least_0.9.3": version.parse(deepspeed.__version__) >= version.parse("0.9.3"), "failed": {}}
for module, attrs in imports:
    try:
        mod = importlib.import_module(module)
        for attr in attrs:
            getattr(mod, attr)
    except (ImportError, AttributeError) as err:
        out["failed"][f"{module}:{','.join(attrs)}"] = f"{type(err).__name__}: {err}"
from accelerate.utils import is_deepspeed_available as accelerate_sees
from transformers.integrations.deepspeed import is_deepspeed_available as transformers_sees
from transformers.dependency_versions_check import dep_version_check
dep_version_check("deepspeed")  # transformers' own "deepspeed>=0.9.3", from the metadata
out["accelerate_sees"], out["transformers_sees"] = accelerate_sees(), transformers_sees()
import deepspeed.comm, terascale.comm
out["comm_is_terascale"] = deepspeed.comm is terascale.comm
print(json.dumps(out))
"""


def test_on_deepspeed_is_terascale_for_every_path_the_libraries_import():
    imports = _deepspeed_imports()
    assert ("deepspeed.launcher.runner", ("DEEPSPEED_ENVIRONMENT_NAME",)) in imports  # accelerate's launcher
    assert len(imports) > 10, imports
    out = _json(_python(_ON_PROBE.replace("sys.argv[1]", repr(json.dumps(imports))), switch="1"))
    assert out["finders"][0] == "DeepSpeedFinder"  # installed at start-up by the .pth, first on sys.meta_path
    assert out["terascale"] is True and out["comm_is_terascale"] is True
    assert out["version"] == out["dist_version"] == standin.VERSION and "+terascale." in out["version"]
    assert out["packages"] == ["deepspeed"]
    assert out["at_least_0.9.3"] and out["accelerate_sees"] and out["transformers_sees"]
    # An import may fail only where the names map refuses the path, with the map's reason.
    unexplained = {}
    for key, error in out["failed"].items():
        module, _, attrs = key.partition(":")
        path = module.removeprefix("deepspeed").lstrip(".")
        hits = [names.refusal(".".join(p for p in (path, a) if p)) for a in attrs.split(",")] or [names.refusal(path)]
        if not any(hit is not None and hit[1] in error for hit in hits):
            unexplained[key] = error
    assert unexplained == {}, unexplained


@pytest.mark.parametrize("switch", [None, "0", ""])
def test_off_the_pth_imports_nothing_and_deepspeed_is_not_found(switch):
    code = (
        "import sys, json\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('terascale', 'deepspeed'))\n"
        "finders = [type(f).__name__ for f in sys.meta_path]\n"
        "try:\n    import deepspeed\n    error = None\n"
        "except ModuleNotFoundError as err:\n    error = str(err)\n"
        "print(json.dumps({'loaded': loaded, 'finders': finders, 'error': error}))\n"
    )
    out = _json(_python(code, switch=switch))
    assert out["loaded"] == []  # start-up cost when off: the .pth's one test, no import
    assert "DeepSpeedFinder" not in out["finders"]
    assert out["error"] == "No module named 'deepspeed'"


def test_off_spellings_of_the_variable():
    """The .pth tests for "" and "0" only; "false"/"off" reach standin.enabled, which says off."""
    out = _json(_python("import sys, json; print(json.dumps([type(f).__name__ for f in sys.meta_path]))",
                        switch="false"))  # fmt: skip
    assert "DeepSpeedFinder" not in out
    assert not standin.enabled({standin.ENV_VAR: "off"}) and standin.enabled({standin.ENV_VAR: "yes"})


def _fake_deepspeed(root: Path, *, package: bool, dist_info: bool) -> Path:
    root.mkdir()
    if package:
        (root / "deepspeed").mkdir()
        (root / "deepspeed" / "__init__.py").write_text("__version__ = '0.15.0'\nREAL = True\n")
    if dist_info:
        info = root / "deepspeed-0.15.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.15.0\n")
        (info / "top_level.txt").write_text("deepspeed\n")
    return root


@pytest.mark.parametrize("package, dist_info", [(True, True), (True, False), (False, True)],
                         ids=["installed", "package-folder", "dist-info-only"])  # fmt: skip
def test_a_real_deepspeed_stops_the_switch_naming_both(tmp_path, package, dist_info):
    fake = _fake_deepspeed(tmp_path / "site", package=package, dist_info=dist_info)
    code = "import deepspeed\nprint(getattr(deepspeed, 'REAL', False))"
    done = _python(code, switch="1", pythonpath=str(fake))
    assert done.returncode != 0
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("ImportError:") and standin.ENV_VAR in error and "real DeepSpeed" in error, error
    assert str(fake) in error and "uninstall DeepSpeed" in error, error
    if package:  # without the switch the real one is `deepspeed`, untouched
        done = _python(code, switch=None, pythonpath=str(fake))
        assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr


def test_terascale_run_as_deepspeed_refuses_a_real_deepspeed(tmp_path):
    """Before any rank starts (no torchrun here): exit code 2 and the same message."""
    fake = _fake_deepspeed(tmp_path / "site", package=True, dist_info=True)
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('a rank started')\n")
    code = ("from terascale.launcher.cli import main\n"
            f"raise SystemExit(main(['run', '--as-deepspeed', {str(script)!r}]))")  # fmt: skip
    done = _python(code, switch=None, pythonpath=f"{fake}{os.pathsep}{REPO}")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "real DeepSpeed is installed" in done.stderr and str(fake) in done.stderr
    assert "a rank started" not in done.stdout + done.stderr


def test_import_terascale_as_deepspeed_keeps_working():
    import terascale
    import terascale as deepspeed

    assert deepspeed.initialize is terascale.initialize
    assert deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME == ".deepspeed_env"
    assert deepspeed.__version__ == terascale.__version__  # terascale's own version, not the stand-in's
    assert not any(isinstance(f, standin.DeepSpeedFinder) for f in sys.meta_path)


def test_the_editable_install_has_the_pth():
    assert (SITE / PTH).read_text() == (REPO / PTH).read_text()


@pytest.fixture(scope="module")
def clean_copy(tmp_path_factory) -> Path:
    """The sources a build reads, without the repository's build/ (whose stale files could stand in)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", PTH, "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "terascale", src / "terascale", ignore=shutil.ignore_patterns("__pycache__"))
    return src


def _build(command: list[str], cwd: Path) -> None:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_a_built_wheel_puts_the_pth_in_site_packages(clean_copy, tmp_path):
    _build([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
            "."], clean_copy)  # fmt: skip
    (wheel,) = tmp_path.glob("terascale-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        files = zf.namelist()
        assert PTH in files  # at the wheel's root: site-packages
        assert zf.read(PTH).decode() == (REPO / PTH).read_text()
    assert not [f for f in files if f.split("/")[0].startswith("deepspeed")]  # nothing named deepspeed


def test_an_editable_wheel_puts_the_pth_in_site_packages(clean_copy, tmp_path):
    code = f"from setuptools import build_meta; print(build_meta.build_editable({str(tmp_path)!r}))"
    _build([sys.executable, "-c", code], clean_copy)
    (wheel,) = tmp_path.glob("terascale-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        assert PTH in zf.namelist()
