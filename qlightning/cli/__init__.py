"""`qlightning` console script: one small module per subcommand."""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from qlightning.cli.console import debugging, internal_error  # noqa: F401  (debugging: re-exported)

USAGE = """usage: qlightning COMMAND [ARGS...]

commands:
  train [OVERRIDES...]     train with QAT and convert to int8 (Hydra app; `qlightning train --help`)
  recipes list|show|validate|cp
                           the shared recipes: list them, print one, check one without training, copy one
  doctor pkg.mod:Class | recipe=NAME
                           which submodules FX can trace, why the others cannot, the route and config for each
  export CHECKPOINT [--formats torchscript,onnx,pt2] [--out DIR]
                           write the int8 model of a checkpoint (TorchScript, ONNX QDQ, .pt2) and check parity
  report RUN_DIR [--write] show the report of a run (read-only); --write renders report.md and the plots again

options:
  --debug                  show the Python traceback of an unexpected error (or set HYDRA_FULL_ERROR=1)

examples:
  qlightning train
  qlightning train recipe=digits_fast trainer.max_epochs=3 quant.backend=qnnpack
  qlightning train ckpt_path=outputs/2026-11-30/10-00-00/checkpoints/last.ckpt
"""


COMMANDS = ("train", "recipes", "doctor", "export", "report")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``qlightning`` console script: run one subcommand and return its exit status.

    A configuration error prints one message and returns 2; any other exception is an internal error
    (:func:`~qlightning.cli.console.internal_error`, 1) unless ``--debug`` shows its traceback.

    Args:
        argv: the command line after the program name; ``None`` uses ``sys.argv[1:]``. ``--debug`` is
            taken out of it and sets ``QLIGHTNING_DEBUG=1`` and ``HYDRA_FULL_ERROR=1``.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in args:
        args = [a for a in args if a != "--debug"]
        os.environ["QLIGHTNING_DEBUG"] = "1"
        os.environ["HYDRA_FULL_ERROR"] = "1"
    from qlightning.errors import ConfigError

    try:
        return _dispatch(args)
    except ConfigError as exc:
        print(f"qlightning: configuration error\n{exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # no traceback for any input; a bug shows it with --debug
        return internal_error(exc)


def _dispatch(args: list[str]) -> int:
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command not in COMMANDS and any(a.startswith("hydra.job.name=train_ddp_process_") for a in args):
        # Lightning's ddp strategy (without torchrun/SLURM) re-launches this program for local ranks
        # 1..N-1 with sys.argv[1:], which `qlightning train` set to the train overrides, plus its own
        # hydra.run.dir/hydra.job.name=train_ddp_process_N overrides
        command, rest = "train", args
    if command == "train":
        from qlightning.cli.train import main as train_main

        return train_main(rest)
    if command == "recipes":
        from qlightning.cli.recipes import main as recipes_main

        return recipes_main(rest)
    elif command == "export":
        from qlightning.cli.export import main as export_main

        return export_main(rest)
    elif command == "report":
        from qlightning.cli.report import main as report_main

        return report_main(rest)
    elif command == "doctor":
        from qlightning.cli.doctor import main as doctor_main

        return doctor_main(rest)
    print(f"qlightning: unknown command {command!r}; valid commands: train, recipes, doctor, export, report\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
