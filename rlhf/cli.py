"""The `rlhf` command line: one subcommand per module in `rlhf/commands/`.

Each command module defines `register(subparsers)` which adds its parser and sets `func(args) -> int`.
Bad input (`UserError`), a failure of any role's workers (`WorkerGroupError`) and a file problem the user
can fix (`FileProblem`: a full disk, a read-only folder, a truncated file, named by our readers and writers;
or an OSError of those kinds that names its file) end with one line on stderr and exit code 2; anything else
is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from rlhf.errors import Stopped, UserError
from workers.file_problems import FileProblem, os_cause, output_name

# Command modules, imported lazily so `rlhf --help` stays fast. Add new commands here.
COMMAND_MODULES = [
    "rlhf.commands.init_model",
    "rlhf.commands.preprocess",
    "rlhf.commands.clean",
    "rlhf.commands.convert",
    "rlhf.commands.checkpoint",
    "rlhf.commands.train",
    "rlhf.commands.generate",
    "rlhf.commands.eval",
    "rlhf.commands.plan",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhf", description="Post-training of LLMs on Ray, megatron-core and vLLM.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def is_worker_failure(exc: BaseException) -> bool:
    """Whether `exc` is a failure of a role's workers (any role: policy, reference, critic, reward model,
    rollout). Looked up in sys.modules: a command that never imported the worker groups cannot raise one,
    and `rlhf --help` stays free of Ray."""
    errors = sys.modules.get("workers.group.errors")
    return errors is not None and isinstance(exc, errors.WorkerGroupError)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (UserError, FileProblem) as e:
        print(f"rlhf {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        cause = os_cause(e)
        if cause is None or not e.filename:
            raise
        print(f"rlhf {args.command}: error: {output_name(e.filename)}: {cause}", file=sys.stderr)
        return 2
    except Stopped as e:  # SIGTERM / SIGINT: stopped at a step boundary (rlhf.driver.infra.preempt)
        print(f"rlhf {args.command}: {e}", file=sys.stderr)
        return e.exit_code
    except Exception as e:
        if not is_worker_failure(e):
            raise
        # The first line names the role, rank, node and pid; the lines after it hold the rank's last log lines.
        print(f"rlhf {args.command}: error: worker failure: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"rlhf {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
