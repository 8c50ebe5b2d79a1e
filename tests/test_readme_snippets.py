"""The code the README and the docs show runs as shown, so a newcomer's first copy-paste works.

Which blocks run (the convention the pages follow):

* README.md: every ```python block is a complete program, and runs.
* README.md and docs/*.md: a fenced ```python or ```bash block on the line right after
  ``<!-- snippet: run -->`` runs. In a bash block, ``memfit`` is this interpreter's ``python -m memfit``.
* Every other block in docs/ is a fragment that uses names the reader already has (``model``,
  ``trainer``, ``args``...) or a setup command (the README's install commands, which CI runs through
  ``.ci/run``); fragments do not run, but every ```python block on every page must be valid Python.

Each runnable block runs in a fresh process, in a temporary folder, on the CPU (``CUDA_VISIBLE_DEVICES=""``)
and offline (``HF_HUB_OFFLINE=1``), with a timeout: the snippets build tiny models from configs with
random weights and make their data in code, so nothing is downloaded.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MARKER = "<!-- snippet: run -->"
TIMEOUT_S = 300  # a tiny training run on a busy 2-core machine takes well under a minute


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: Path
    line: int  # where its opening fence is, 1-based
    language: str
    code: str
    marked: bool  # preceded by MARKER

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT).as_posix()}:{self.line}"

    @property
    def runnable(self) -> bool:
        return self.marked or (self.page == README and self.language == "python")


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` in order; an unclosed fence is an error, not a silent skip."""
    lines = page.read_text().splitlines()
    found, index = [], 0
    while index < len(lines):
        opening = re.fullmatch(r"```(\w*)\s*", lines[index])
        if opening is None:
            index += 1
            continue
        try:
            end = lines.index("```", index + 1)
        except ValueError:
            raise AssertionError(f"{page.name}:{index + 1}: a code block that is never closed") from None
        marked = index > 0 and lines[index - 1].strip() == MARKER
        code = "\n".join(lines[index + 1 : end]) + "\n"
        found.append(Block(page, index + 1, opening.group(1), code, marked))
        index = end + 1
    return found


ALL_BLOCKS = [block for page in PAGES for block in blocks(page)]
RUNNABLE = [block for block in ALL_BLOCKS if block.runnable]


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    path = [str(ROOT / "src"), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env.update(
        PYTHONPATH=os.pathsep.join(path),  # this checkout's memfit, wherever the snippet runs
        CUDA_VISIBLE_DEVICES="",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
        MPLBACKEND="Agg",
        WANDB_MODE="disabled",
    )
    return env


def test_every_python_block_is_valid_python() -> None:
    python = [block for block in ALL_BLOCKS if block.language == "python"]
    assert python, "no python blocks found: the extraction is broken"
    for block in python:
        compile(block.code, block.name, "exec")  # a SyntaxError names the page and line


def test_marked_blocks_are_python_or_bash() -> None:
    marked = [block for block in ALL_BLOCKS if block.marked]
    assert marked
    assert all(block.language in ("python", "bash") for block in marked), [b.name for b in marked]


def test_the_readme_quickstarts_all_run() -> None:
    """The three quickstarts (Lightning, the HF Trainer, the command line) are among the blocks that run."""
    readme = [block for block in RUNNABLE if block.page == README]
    assert any("from memfit.lightning import MemoryPlanner" in block.code for block in readme)
    assert any("from memfit.huggingface import" in block.code for block in readme)
    assert any(block.language == "bash" and block.code.startswith("memfit plan ") for block in readme)


@pytest.mark.parametrize("block", RUNNABLE, ids=[block.name for block in RUNNABLE])
def test_the_snippet_runs(block: Block, tmp_path: Path) -> None:
    if block.language == "python":
        script = tmp_path / "snippet.py"
        script.write_text(block.code)
        command = [sys.executable, str(script)]
    else:
        script = tmp_path / "snippet.sh"
        script.write_text(f'set -euo pipefail\nmemfit() {{ "{sys.executable}" -m memfit "$@"; }}\n{block.code}')
        command = ["bash", str(script)]
    result = subprocess.run(
        command, cwd=tmp_path, env=_environment(), capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    output = (result.stdout + result.stderr)[-4000:]
    assert result.returncode == 0, f"{block.name} failed ({result.returncode}):\n{output}"


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_links_between_the_pages_resolve() -> None:
    """A page moved or a heading renamed must not leave the README or the docs pointing nowhere."""
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in _anchors(linked)):
                broken.append(f"{page.relative_to(ROOT).as_posix()}: {target}")
    assert not broken, broken
