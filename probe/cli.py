"""The ``probe`` command line (also ``python -m probe``)."""

from __future__ import annotations

import argparse
import enum
import os
import sys
from typing import Any, List, Optional, TextIO

from probe.cli_check import add_commands as add_check_commands

__all__ = ["ExitCode", "main"]


class ExitCode(enum.IntEnum):
    OK = 0
    VIOLATIONS = 1
    USAGE = 2


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {value}")
    return value


def _cmd_demo(args: argparse.Namespace) -> int:
    from probe.demo import run_demo

    run_demo(steps=args.steps, logdir=args.logdir, seed=args.seed)
    return ExitCode.OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="probe", description="See what the 1/sqrt(d_k) scaling in attention does to your model.")
    from probe import __version__

    parser.add_argument("--version", action="version", version=f"probe {__version__} (attention-probe)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser("demo", help="train a small transformer with and without scaling, log to TensorBoard")
    demo.add_argument("--steps", type=_positive_int, default=200, help="training steps per run (default 200)")
    demo.add_argument("--logdir", default="runs/demo", help="TensorBoard directory (default runs/demo)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_cmd_demo)
    add_check_commands(sub)  # probe check, probe report
    from probe.comparison import add_commands as add_compare_commands

    add_compare_commands(sub)  # probe compare
    from probe.coverage import add_commands as add_coverage_commands

    add_coverage_commands(sub)  # probe coverage
    return parser


class _PipeSafeStdout:
    """sys.stdout that goes quiet once its reader has gone (``probe check RUN | head -1``): the
    command finishes and returns its own exit code instead of dying of BrokenPipeError."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.broken = False

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._silence()
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._silence()

    def _silence(self) -> None:
        self.broken = True
        try:  # the interpreter's own flush of fd 1 at exit must not raise again
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main(argv: Optional[List[str]] = None) -> int:
    from probe.errors import ProbeError
    from probe.torch_support import check_torch

    try:
        check_torch()  # an unsupported torch: say what it lacks before any command imports it
    except ProbeError as err:
        print(f"probe: error: {err}", file=sys.stderr)
        return ExitCode.USAGE
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse exits 2 on usage errors, 0 on --help
        return int(exit_.code or 0)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return ExitCode.USAGE
    stdout, sys.stdout = sys.stdout, _PipeSafeStdout(sys.stdout)  # type: ignore[assignment]
    try:
        code = int(args.func(args))
        sys.stdout.flush()
        return code
    except ProbeError as err:  # bad input that a command did not map itself
        print(f"probe {args.command}: error: {err}", file=sys.stderr)
        return ExitCode.USAGE
    finally:
        sys.stdout = stdout


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
