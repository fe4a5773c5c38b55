"""The README's python blocks run as pasted, in order, in one fresh interpreter.

Blocks whose first line is `# needs a CUDA GPU` run only under the `gpu` marker (the GPU run
executes every block, in order); the CPU run leaves them out. The README's set-up commands are
the ones CI runs, and its links point at files that exist.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GPU_MARK = "# needs a CUDA GPU"
LONGEST = 400  # lines: a user's page; details go to docs/

# Runs the blocks of a JSON list [(first README line, code), ...] in one namespace, as pasted
# into one interpreter; a failure names the block's line in README.md.
DRIVER = """
import json, sys, traceback
namespace = {"__name__": "__main__"}
for line, code in json.load(open(sys.argv[1])):
    print(f"README.md:{line}", flush=True)
    try:
        exec(compile(code, f"README.md block at line {line}", "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        sys.exit(f"README.md block at line {line} failed")
"""


def python_blocks() -> list:
    """(line of the block's first code line, code) for every ```python block, in order."""
    blocks, code, start = [], None, 0
    for number, line in enumerate(README.read_text().splitlines(), start=1):
        if code is None and line.strip() == "```python":
            code, start = [], number + 1
        elif code is not None and line.strip() == "```":
            blocks.append((start, "\n".join(code) + "\n"))
            code = None
        elif code is not None:
            code.append(line)
    assert code is None, f"README.md: the block opened at line {start - 1} is never closed"
    return blocks


def needs_gpu(code: str) -> bool:
    return code.lstrip().startswith(GPU_MARK)


def run_blocks(blocks: list, tmp_path: Path) -> str:
    """Runs `blocks` in a fresh interpreter in an empty folder; returns its output."""
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    pytest.importorskip("optax")
    listing = tmp_path / "blocks.json"
    listing.write_text(json.dumps(blocks))
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", DRIVER, str(listing)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert not any(work.iterdir()), "a README block wrote into the folder it ran in"
    return output


def test_readme_has_python_blocks_for_the_cpu_and_for_the_gpu():
    blocks = python_blocks()
    assert len([b for b in blocks if not needs_gpu(b[1])]) >= 5
    assert any(needs_gpu(code) for _, code in blocks)
    for line, code in blocks:  # the mark is the first line, where a reader sees it
        assert GPU_MARK not in code or needs_gpu(code), f"README.md:{line}"


def test_readme_cpu_blocks_run_as_pasted(tmp_path):
    """Every block that does not need a GPU, in order, in one interpreter on this machine."""
    blocks = [b for b in python_blocks() if not needs_gpu(b[1])]
    output = run_blocks(blocks, tmp_path)
    assert output.count("README.md:") == len(blocks), output


@pytest.mark.gpu
def test_readme_blocks_run_as_pasted_on_a_gpu(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("this torch build sees no CUDA device")
    blocks = python_blocks()
    output = run_blocks(blocks, tmp_path)
    assert output.count("README.md:") == len(blocks), output


def test_readme_test_command_is_the_one_ci_runs():
    """.ci/run runs the README's test command exactly; the README gives both set-up commands."""
    commands = re.findall(r"```bash\n(.+?)\n```", README.read_text())
    assert len(commands) == 2, commands
    run, test = commands
    assert run.endswith("python examples/digits_torch.py") and "[cuda13,examples]" in run
    assert test.endswith("python -m pytest -q") and "[cuda13,test]" in test
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test in ci, f".ci/run does not run the README's test command: {test}"


def test_readme_is_a_users_page_with_working_links():
    text = README.read_text()
    assert len(text.splitlines()) <= LONGEST, "README.md is for users: move details to docs/"
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert any(link.startswith("docs/") for link in links)
    for link in links:
        if "://" not in link:
            assert (ROOT / link).exists(), f"README.md links to {link}, which does not exist"
    for page in (ROOT / "docs").glob("*.md"):
        for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in link:
                assert (page.parent / link).exists(), f"{page.name} links to missing {link}"
