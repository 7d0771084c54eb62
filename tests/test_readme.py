"""The README is tested: every fenced code block runs as written, in README order, in one fresh folder.

A Python block runs as a script; a bash block runs command by command (continuation lines joined,
comments dropped), each command one test. Edits: ``outputs/<date>/<time>`` becomes the folder of the
latest run made with the same overrides, and ``qlightning train`` gets :data:`SHORT` (5 training batches per epoch, 2 validation and
test batches: every epoch milestone is still reached and every stage runs; the figures are other
tests' business). A command run as written by another test is listed in :data:`COVERED` (a quick test
checks that test still runs it); commands that cannot run on one machine are in :data:`NOT_RUN` with
what checks them instead. A block that is neither run nor accounted for fails
:func:`test_every_block_is_run_or_accounted_for`.
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
    "python3 -m venv .venv214": ".ci/run makes this venv (the same pins) for its torch 2.14.1 pass",
    ".venv214/bin/qlightning train recipe=resnet_qat": "needs the torch 2.14.1 venv (torchvision); tests/zoo/test_recipes.py "
    "runs every family recipe whole in .ci/run's 2.14.1 pass (a data module of the user's: mypkg is a placeholder)",
    "python3 -m venv .venv": "the first screen's set-up: .ci/run does it on a fresh clone, and "
    "tests/test_cli.py::test_wheel_installs_in_a_fresh_venv_and_runs_the_default_job installs the wheel and runs the job",
    "bash .ci/run": "this is CI itself",
    "torchrun --standalone --nproc_per_node 2": "tests/test_ddp.py runs this command (2 CPU processes)",
    "torchrun --nnodes 2": "needs two nodes with 8 GPUs (no cluster here)",
    "srun": "needs a SLURM cluster",
}
# command -> the test that runs it as written (with its arguments in its source)
COVERED = {
    "qlightning train": ("tests/test_cli.py", "test_default_job_trains_converts_and_reports", '"train", f"hydra.run.dir'),
    "qlightning train recipe=digits_fast": ("tests/test_recipes_e2e.py", "test_shipped_recipe_runs_end_to_end", 'f"recipe={name}"'),
    "HF_HUB_OFFLINE=1 qlightning train recipe=minilm_pt2e": ("tests/test_recipes_e2e.py", "test_shipped_recipe_runs_end_to_end", 'f"recipe={name}"'),
    # the shared run that test_cli.py::test_tensorboard_logger_gets_phase_scales_and_report reads
    "qlightning train recipe=digits_fast loggers=[csv,tensorboard]": (
        "tests/conftest.py", "digits_fast_run", '"loggers=[csv,tensorboard]"'),
}
SHORT = (" trainer.limit_train_batches=5 trainer.limit_val_batches=2 trainer.limit_test_batches=2"
         " trainer.log_every_n_steps=1 trainer.enable_progress_bar=false")  # log_every_n_steps: else Lightning warns about 5 batches
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
# (block, command) in README order; a Python block is one "command"
STEPS = [
    (b, c) for b in RUNNABLE for c in ([b.text] if b.lang == "python" else commands(b))
    if b.lang == "python" or not (_not_run(c) or c in COVERED)
]


def _step_id(block: Block, command: str) -> str:
    if block.lang == "python":
        return block.id
    return f"L{block.line}-{re.sub(r'[^A-Za-z0-9_.=-]+', '_', command)[:60]}"


def test_every_block_is_run_or_accounted_for():
    for block in BLOCKS:
        if block in RUNNABLE:
            continue
        if block.lang == "bash":
            assert all(_not_run(c) for c in commands(block)), block
        else:
            assert block.text.startswith(NOT_CODE), f"README line {block.line}: a {block.lang or 'plain'} block nobody runs"
    assert len(RUNNABLE) >= 6  # Python API, restore, PTQ, command line, qconfig, doctor, PT2E
    documented = {c for b in RUNNABLE if b.lang == "bash" for c in commands(b)}
    assert set(COVERED) <= documented, f"COVERED names commands the README no longer has: {set(COVERED) - documented}"


@pytest.mark.parametrize("command", sorted(COVERED))
def test_covered_commands_are_run_by_the_named_test(command):
    path, name, fragment = COVERED[command]
    source = (ROOT / path).read_text()
    assert f"def {name}(" in source, f"{command!r}: {path}::{name} is gone"
    body = source[source.index(f"def {name}("):]
    body = body[: body.find("\ndef ", 1) if "\ndef " in body[1:] else len(body)]
    assert fragment in body, f"{path}::{name} no longer runs {command!r}"


def test_commands_are_parsed_as_a_shell_would():
    block = Block(1, "bash", "# comment\nqlightning train 'a={b: c, d: [e]}' x=1   # trailing\ntorchrun -m \\\n    qlightning.cli train\n")
    assert commands(block) == ["qlightning train 'a={b: c, d: [e]}' x=1", "torchrun -m qlightning.cli train"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("readme")


def _env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "HF_HUB_OFFLINE": "1"}


def _overrides(run: Path) -> set[str]:
    """The command-line overrides a run was made with (Hydra's ``.hydra/overrides.yaml``), less :data:`SHORT`."""
    import yaml

    made_with = yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text()) or []
    return set(made_with) - set(SHORT.split())


def _latest_run(folder: Path, like: str = "") -> str:
    """The latest run made with the same overrides as ``like`` (a resume resumes the job it was made by).

    ``like`` is the command that names the run; its ``ckpt_path=...`` and :data:`SHORT` do not count.
    """
    wanted = {a for a in shlex.split(like) if "=" in a and not a.startswith("ckpt_path=")} if like else None

    def runs() -> list[Path]:
        found = sorted(p.parent.parent for p in folder.glob("outputs/*/*/checkpoints/last.ckpt"))
        return [r for r in found if wanted is None or _overrides(r) == wanted]

    if not runs():  # a block run alone (-k): make the run the README's earlier blocks would have made
        made = ["recipe=digits_fast"] if wanted is None else sorted(wanted)
        out = subprocess.run([sys.executable, "-m", "qlightning.cli", "train", *made, *SHORT.split()],
                             cwd=folder, env=_env(), capture_output=True,
                             text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
    return str(runs()[-1].relative_to(folder))


def _run_earlier_steps_of_the_block(block: Block, command: str, folder: Path) -> None:
    """Run the earlier commands of ``block`` that this folder has not seen (e.g. the ``recipes cp``
    a ``recipes validate my_recipe.yaml`` reads): a README reader runs a block top to bottom, but test
    workers split it (``pytest -n 2``), each with its own folder. Training steps are left to
    :func:`_latest_run`, which makes the run a command needs."""
    done = folder / ".steps-done"
    seen = set(done.read_text().splitlines()) if done.exists() else set()
    steps = [c for b, c in STEPS if b is block]
    for earlier in steps[: steps.index(command)]:
        if earlier not in seen and re.search(r"(^|\s)qlightning train(\s|$)", earlier) is None:
            _run(earlier, folder, f"README line {block.line}: {earlier} (an earlier step of the block)")
            seen.add(earlier)
    done.write_text("\n".join(sorted(seen | {command})))


def _run(command: list[str] | str, folder: Path, label: str) -> str:
    out = subprocess.run(command, cwd=folder, env=_env(), capture_output=True, text=True, timeout=1200,
                         shell=isinstance(command, str), executable="/bin/bash" if isinstance(command, str) else None)
    text = out.stdout + out.stderr
    assert out.returncode == 0, f"{label} exited {out.returncode}:\n{text[-4000:]}"
    assert "Traceback" not in text, f"{label}:\n{text[-4000:]}"
    return text


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("block, command", STEPS, ids=[_step_id(b, c) for b, c in STEPS])
def test_readme_command_runs_as_written(block: Block, command: str, folder: Path):
    if block.lang == "python":
        if "outputs" in command:
            _latest_run(folder)
        _run([sys.executable, "-c", command], folder, f"README line {block.line} (python)")
        return
    _run_earlier_steps_of_the_block(block, command, folder)
    if "<date>/<time>" in command:
        like = command if command.startswith("qlightning train") else ""
        command = command.replace("outputs/<date>/<time>", _latest_run(folder, like))
    train = re.search(r"(^|\s)qlightning train(\s|$)", command) is not None
    if train:
        command += SHORT
    text = _run(command, folder, f"README line {block.line}: {command}")
    if train:
        assert "run folder: " in text, text[-2000:]
        if "minilm" not in command:  # the digits jobs have nothing to warn about: no library noise either
            assert "Warning" not in text and "Tip:" not in text, text[-3000:]
