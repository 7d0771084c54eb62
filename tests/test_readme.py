"""The README is tested: every fenced code block runs as written, in README order, in one fresh folder.

A Python block runs as a script; a bash block runs command by command (continuation lines joined,
comments dropped). The only edits are ``outputs/<date>/<time>`` replaced by the folder of the latest
run and ``trainer.enable_progress_bar=false`` added to ``qlightning train``, for readable logs. Commands
that cannot run on one machine are listed in :data:`NOT_RUN` with what checks them instead; a block
that is neither run nor listed fails :func:`test_every_block_is_run_or_accounted_for`.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# command prefix -> why it does not run here, and what checks it instead
NOT_RUN = {
    "python3 -m venv .venv": "the first screen's set-up: .ci/run does it on a fresh clone, and "
    "tests/test_cli.py::test_wheel_installs_in_a_fresh_venv_and_runs_the_default_job installs the wheel and runs the job",
    "bash .ci/run": "this is CI itself",
    "torchrun --standalone --nproc_per_node 2": "tests/test_ddp.py runs this command (2 CPU processes)",
    "torchrun --nnodes 2": "needs two nodes with 8 GPUs (no cluster here)",
    "srun": "needs a SLURM cluster",
}
# non-code blocks (a file tree)
NOT_CODE = ("conf/            Hydra config tree",)


@dataclass(frozen=True)
class Block:
    line: int
    lang: str
    text: str

    @property
    def id(self) -> str:
        first = next((ln for ln in self.text.splitlines() if ln.strip() and not ln.startswith("#")), "")
        return f"L{self.line}-{self.lang}-{re.sub(r'[^A-Za-z0-9_.=-]+', '_', first)[:40]}"


def readme_blocks() -> list[Block]:
    text = README.read_text()
    return [
        Block(text[: m.start()].count("\n") + 1, m.group(1), m.group(2))
        for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)
    ]


def commands(block: Block) -> list[str]:
    """A bash block's commands: continuation lines joined, comment lines and trailing comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block.text)
    out = []
    for line in joined.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        lexer = shlex.shlex(line, posix=False)  # posix=False keeps the quotes for bash
        lexer.whitespace_split = True
        out.append(" ".join(lexer))
    return out


def _not_run(command: str) -> str | None:
    return next((why for prefix, why in NOT_RUN.items() if command.startswith(prefix)), None)


BLOCKS = readme_blocks()
RUNNABLE = [b for b in BLOCKS if b.lang == "python" or (b.lang == "bash" and any(not _not_run(c) for c in commands(b)))]


def test_every_block_is_run_or_accounted_for():
    for block in BLOCKS:
        if block in RUNNABLE:
            continue
        if block.lang == "bash":
            assert all(_not_run(c) for c in commands(block)), block
        else:
            assert block.text.startswith(NOT_CODE), f"README line {block.line}: a {block.lang or 'plain'} block nobody runs"
    assert len(RUNNABLE) >= 6  # Python API, restore, PTQ, command line, qconfig, doctor, PT2E


def test_commands_are_parsed_as_a_shell_would():
    block = Block(1, "bash", "# comment\nqlightning train 'a={b: c, d: [e]}' x=1   # trailing\ntorchrun -m \\\n    qlightning.cli train\n")
    assert commands(block) == ["qlightning train 'a={b: c, d: [e]}' x=1", "torchrun -m qlightning.cli train"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("readme")


def _env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "HF_HUB_OFFLINE": "1"}


def _latest_run(folder: Path) -> str:
    runs = sorted(p.parent for p in folder.glob("outputs/*/*/checkpoints/last.ckpt"))
    if not runs:  # a block run alone (-k): make the run the README's earlier blocks would have made
        out = subprocess.run([sys.executable, "-m", "qlightning.cli", "train", "recipe=digits_fast",
                              "trainer.enable_progress_bar=false"], cwd=folder, env=_env(), capture_output=True,
                             text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
        runs = sorted(p.parent for p in folder.glob("outputs/*/*/checkpoints/last.ckpt"))
    return str(runs[-1].relative_to(folder))


def _run(command: list[str] | str, folder: Path, label: str) -> str:
    out = subprocess.run(command, cwd=folder, env=_env(), capture_output=True, text=True, timeout=1200,
                         shell=isinstance(command, str), executable="/bin/bash" if isinstance(command, str) else None)
    text = out.stdout + out.stderr
    assert out.returncode == 0, f"{label} exited {out.returncode}:\n{text[-4000:]}"
    assert "Traceback" not in text, f"{label}:\n{text[-4000:]}"
    return text


@pytest.mark.slow
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_readme_block_runs_as_written(block: Block, folder: Path):
    if block.lang == "python":
        code = block.text
        if "outputs" in code:
            _latest_run(folder)
        _run([sys.executable, "-c", code], folder, f"README line {block.line} (python)")
        return
    for command in commands(block):
        if _not_run(command):
            continue
        if "<date>/<time>" in command:
            command = command.replace("outputs/<date>/<time>", _latest_run(folder))
        if re.search(r"(^|\s)qlightning train(\s|$)", command) and "-m" not in command.split():
            command += " trainer.enable_progress_bar=false"
        text = _run(command, folder, f"README line {block.line}: {command}")
        if " train" in command and "qlightning" in command:
            assert "run folder: " in text, text[-2000:]
            if "minilm" not in command:  # the digits jobs have nothing to warn about: no library noise either
                assert "Warning" not in text and "Tip:" not in text, text[-3000:]
