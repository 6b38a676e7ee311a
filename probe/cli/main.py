"""The ``probe`` command line (also ``python -m probe``): the parser, ``main`` and the demo-model
commands (``probe demo``, ``probe compare``), ``probe coverage``'s arguments; ``probe check`` /
``probe report`` live in :mod:`probe.ci.check`, the exit codes in :mod:`probe.ci.exit_codes`.

Building the parser imports no torch: ``probe --help``, ``probe --version`` and argument errors
answer at once (importing torch takes seconds, more on a busy machine). Only the commands that run
a model (``demo``, ``compare``, ``coverage``) import it, after their arguments are parsed.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, List, Optional, TextIO

from probe.ci.check import int_at_least, positive_int
from probe.ci.check import add_commands as add_check_commands
from probe.ci.exit_codes import ExitCode

__all__ = ["ExitCode", "build_parser", "main"]


def cmd_coverage(args: argparse.Namespace) -> int:
    from probe.session.coverage import cmd_coverage as run

    return int(run(args))


def _cmd_demo(args: argparse.Namespace) -> int:
    from probe.cli.demo import run_demo

    run_demo(steps=args.steps, logdir=args.logdir, seed=args.seed)
    return ExitCode.OK


def _cli_scale(text: str) -> Any:
    try:
        return float(text)
    except ValueError:
        return text


_zero_or_more = int_at_least(0, "an int >= 0")


def _cmd_compare(args: argparse.Namespace) -> int:
    import json

    import torch

    from probe.experiment.compare import compare
    from probe.cli.demo_model import DemoConfig, TinyTransformer, majority_batch, majority_loss
    from probe.errors import ProbeError

    config = DemoConfig(seed=args.seed, batch=args.batch)
    torch.manual_seed(config.seed)
    model = TinyTransformer(config)
    gen = torch.Generator().manual_seed(config.seed + 1)
    if args.train_steps:
        opt = torch.optim.AdamW(model.parameters(), lr=config.lr)
        for _ in range(args.train_steps):
            opt.zero_grad(set_to_none=True)
            majority_loss(model, *majority_batch(config, gen)).backward()
            opt.step()
    batch = majority_batch(config, gen)
    scales = args.scale or ["actual", "unscaled"]
    try:
        result = compare(model, batch, lambda m, b: majority_loss(m, *b), scales=scales)
    except ProbeError as err:
        print(f"probe compare: error: {err}", file=sys.stderr)
        return ExitCode.USAGE
    d_k = config.d_model // config.heads
    print(f"probe compare: demo model ({config.layers} layers, {config.heads} heads, d_k = {d_k}, "
          f"actual scale 1/√{d_k}), {args.train_steps} training steps on the demo's majority task, "
          f"one batch of {config.batch}")
    print(result.table())
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result.to_dict(), f, indent=1)
        print(f"written: {args.json}")
    return ExitCode.OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="probe", description="See what the 1/sqrt(d_k) scaling in attention does to your model.")
    from probe import __version__

    parser.add_argument("--version", action="version", version=f"probe {__version__} (attention-probe)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser("demo", help="train a small transformer with and without the 1/sqrt(d_k) divisor, log both "
                                       "to TensorBoard, print what differs and the verdicts of probe check")
    demo.add_argument("--steps", type=positive_int, default=100, help="training steps per run (default 100)")
    demo.add_argument("--logdir", default="runs/demo", help="TensorBoard directory (default runs/demo)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_cmd_demo, needs_torch=True)
    add_check_commands(sub)  # probe check, probe report
    cmd = sub.add_parser("compare", help="one forward/backward of the demo model per scale, side by side")
    cmd.add_argument("--scale", action="append", type=_cli_scale, metavar="SCALE",
                     help="actual, unscaled, standard or a float; repeat (default: actual and unscaled)")
    cmd.add_argument("--train-steps", type=_zero_or_more, default=0,
                     help="train the demo model (standard scaling) this many steps first (default 0)")
    cmd.add_argument("--batch", type=positive_int, default=32, help="batch size (default 32)")
    cmd.add_argument("--seed", type=int, default=0)
    cmd.add_argument("--json", metavar="PATH", help="also write the table as JSON")
    cmd.set_defaults(func=_cmd_compare, needs_torch=True)
    cmd = sub.add_parser("coverage", help="list every attention of a model: captured or not (and why), scale, "
                                          "gradient metrics; exits 1 when one is missed")
    cmd.add_argument("target", metavar="MODULE:FUNCTION",
                     help="a function returning (model, args) or (model, args, kwargs): example inputs for one forward")
    cmd.add_argument("--no-backward", action="store_true", help="skip the backward (no gradient metrics listed)")
    cmd.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    cmd.set_defaults(func=cmd_coverage, needs_torch=True)  # the command itself: probe.session.coverage
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

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse exits 2 on usage errors, 0 on --help
        return int(exit_.code or 0)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return ExitCode.USAGE
    if getattr(args, "needs_torch", False):
        from probe.torch_support import check_torch

        try:
            check_torch()  # an unsupported torch: say what it lacks before the command imports it
        except ProbeError as err:
            print(f"probe: error: {err}", file=sys.stderr)
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
