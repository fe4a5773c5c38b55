"""What a user gets besides the code: the license, type information, quiet imports, no prints."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mtapply"


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_is_the_apache_license_pyproject_names():
    pyproject = _pyproject()
    assert pyproject["project"]["license"] == "Apache-2.0"
    assert "LICENSE" in pyproject["project"]["license-files"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) == 202


def test_package_is_typed():
    """PEP 561: the marker lies in the package folder, which the wheel ships whole."""
    pyproject = _pyproject()
    assert pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"] == ["mtapply"]
    assert (PACKAGE / "py.typed").is_file()


def _programs() -> set:
    """Modules run as programs (`python -m ...`), which may print: the benchmarks, and any
    module with a `__main__` guard."""
    programs = set(PACKAGE.glob("bench/**/*.py")) | set(PACKAGE.glob("**/__main__.py"))
    for path in PACKAGE.glob("**/*.py"):
        if 'if __name__ == "__main__":' in path.read_text():
            programs.add(path)
    return programs


def test_the_library_reports_through_warnings_not_prints():
    """A library speaks through `warnings` (or `logging`); print and direct writes to stdout or
    stderr belong to programs."""
    found = []
    for path in sorted(set(PACKAGE.glob("**/*.py")) - _programs()):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            if name == "print" or name in ("sys.stdout.write", "sys.stderr.write"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}(...)")
    assert not found, "\n".join(found)


def test_import_mtapply_torch_is_light():
    """`import mtapply.torch` adds little to `import torch`: no torch._dynamo (over 1 s on its
    own), no jax, no CuPy until a GPU step needs it. The bound on the time is generous (the
    import takes about 0.1 s) so that a loaded machine passes."""
    pytest.importorskip("torch")
    probe = ("import sys, time; import torch; start = time.perf_counter(); import mtapply.torch; "
             "print(time.perf_counter() - start); "
             "print(' '.join(m for m in ('torch._dynamo', 'jax', 'cupy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    seconds, loaded = (done.stdout.splitlines() + [""])[:2]
    assert loaded == "", f"import mtapply.torch imported {loaded}"
    assert float(seconds) < 1.0, f"import mtapply.torch took {float(seconds):.2f} s over torch"


def test_import_mtapply_imports_no_framework():
    probe = ("import sys, mtapply; "
             "print(' '.join(m for m in ('torch', 'jax', 'cupy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"import mtapply imported {done.stdout.strip()}"
