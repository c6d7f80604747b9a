"""The ``avionics`` command line: demo, plot, compare, diagnose, export."""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from pathlib import Path

EXPORT_FORMATS = ("csv", "cockpit-json", "tensorboard")
EXPORT_DEFAULT_NAMES = {"csv": "log.csv", "cockpit-json": "cockpit.json", "tensorboard": "tb"}
# What to do about an operating system's refusal, by errno (otherwise: check the path).
OS_ERROR_ADVICE = {
    errno.ENOSPC: "free some disk space or write elsewhere",
    errno.EDQUOT: "free some of your disk quota or write elsewhere",
}


class CommandError(Exception):
    """An error the user can fix; printed without a traceback."""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on stderr (exit status 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def _positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    error = argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    try:
        value = int(text)
    except ValueError:
        raise error from None
    if value < 1:
        raise error
    return value


def _unwritable(path: Path, kind: str) -> str | None:
    """Why ``path`` cannot be written as a ``kind`` ("file" or "folder"), or None if it can:
    it exists as the other kind, the nearest of its folders that exists (missing ones are
    created) is a file, or what would be written into is not writable."""
    if path.exists():
        if path.is_dir() != (kind == "folder"):
            return f"it is a {'folder' if path.is_dir() else 'file'}, not a {kind}"
        target = path
    else:
        target = next(folder for folder in path.absolute().parents if folder.exists())
        if not target.is_dir():
            return f"{target} is a file, not a folder"
    if not os.access(target, os.W_OK | (os.X_OK if target.is_dir() else 0)):
        return f"{target} is not writable (permission denied)"
    return None


def _check_output(path: Path, kind: str, what: str, option: str) -> None:
    """Raise :class:`CommandError` unless ``path`` can be written as a ``kind`` holding
    ``what``; ``option`` is the command-line option that chooses it."""
    reason = _unwritable(path, kind)
    if reason is not None:
        raise CommandError(
            f"cannot write {what} to {path}: {reason}. Pass {option} with another {kind}."
        )


def _check_image(path: Path, what: str, option: str) -> None:
    """:func:`_check_output` for an image file, which must also name a format the dashboard
    saves."""
    from avionics.dashboard.style import FORMATS

    _check_output(path, "file", what, option)
    if path.suffix.lower() not in FORMATS:
        raise CommandError(
            f"cannot save {what} as {path.name!r}: use a file name ending in "
            f"{', '.join(FORMATS)} (pass {option})."
        )


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file (after following links and ``..``)."""
    return a.resolve() == b.resolve()


def _run_dir(run: str) -> Path:
    """Where outputs of ``run`` go by default: the run directory, or the log file's folder."""
    path = Path(run)
    return path if path.is_dir() else path.parent


def _read(run: str):
    """The run at ``run``; a note on stderr if some lines could not be read, and an error if
    no step could (then it is no run log, or one that has not logged a step yet)."""
    from avionics.records import read_run

    result = read_run(run)
    if not result.steps:
        found = f" (first problem: {result.problems[0]})" if result.problems else ""
        raise CommandError(
            f"no step could be read from {result.path}{found}: pass a run directory or "
            ".jsonl log written by Cockpit(..., log=DIR) once it has logged a step."
        )
    if result.problems:
        print(
            f"note: {len(result.problems)} line(s) of {result.path} could not be read and were "
            f"skipped; first: {result.problems[0]}",
            file=sys.stderr,
        )
    return result


def _demo(args) -> int:
    from avionics.demo import run_demo

    out = Path(args.out) if args.out else _fresh_folder(Path("avionics-demo"))
    _check_output(out, "folder", "the demo runs", "--out")
    run_demo(out, steps=args.steps, progress=not args.quiet)
    return 0


def _fresh_folder(base: Path) -> Path:
    """``base``, or ``base-2``, ``base-3``, ... : the first that does not exist yet."""
    candidate, k = base, 1
    while candidate.exists():
        k += 1
        candidate = base.with_name(f"{base.name}-{k}")
    return candidate


def _plot(args) -> int:
    from avionics.dashboard import plot, plot_secondary

    run = _read(args.run)
    output = Path(args.output) if args.output else _run_dir(args.run) / "cockpit.png"
    secondary = Path(args.secondary) if args.secondary else None
    _check_image(output, "the dashboard", "-o/--output")
    if secondary is not None:
        _check_image(secondary, "the secondary screen", "--secondary")
        if _same_file(secondary, output):
            raise CommandError(
                f"--secondary {secondary} is the dashboard's file too: pass another file."
            )
    plot(run, output, title=args.title)
    print(f"dashboard written to {output}")
    if secondary is not None:
        plot_secondary(run, secondary)
        print(f"secondary screen written to {secondary}")
    return 0


def _compare(args) -> int:
    from avionics.dashboard.compare import plot_compare

    runs = [_read(run) for run in args.runs]
    folders = [_run_dir(run).absolute() for run in args.runs]
    output = (
        Path(args.output) if args.output else Path(os.path.commonpath(folders)) / "compare.png"
    )
    _check_image(output, "the comparison", "-o/--output")
    labels = args.labels.split(",") if args.labels else None
    plot_compare(runs, output, title=args.title, labels=labels)
    print(f"comparison of {len(runs)} runs written to {output}")
    return 0


def _diagnose(args) -> int:
    from avionics.diagnosis import diagnose, report

    run = _read(args.run)
    findings = diagnose(run)
    if args.json:
        print(json.dumps([f.to_dict() for f in findings], indent=2))
    else:
        print(report(run, findings))
    return 0


def _export(args) -> int:
    from avionics.records import to_cockpit_json, to_csv, to_tensorboard

    run = _read(args.run)
    name = EXPORT_DEFAULT_NAMES[args.format]
    output = Path(args.output) if args.output else _run_dir(args.run) / name
    kind = "folder" if args.format == "tensorboard" else "file"
    _check_output(output, kind, f"the {args.format} export", "-o/--output")
    if args.format == "cockpit-json" and output.suffix != ".json":
        raise CommandError(
            f"the reference tool reads logs named *.json; got {output}. Pass -o FILE.json."
        )
    if _same_file(output, run.path):
        raise CommandError(
            f"-o/--output {output} is the run's log: exporting there would overwrite it. "
            "Pass -o with another path."
        )
    if args.format == "tensorboard":
        to_tensorboard(run, output, progress=True)
    else:
        output.parent.mkdir(parents=True, exist_ok=True)  # as plot and tensorboard do
        export = to_csv if args.format == "csv" else to_cockpit_json
        export(run, output)
    print(f"{args.format} written to {output}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``avionics`` command."""
    from avionics import __version__

    parser = _Parser(
        prog="avionics",
        description="A cockpit for PyTorch training: draw, compare, diagnose and export run logs "
        "written by Cockpit(..., log=DIR), or run the demo.",
    )
    parser.add_argument("--version", action="version", version=f"avionics {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="train a small network on the 8x8 digits twice and compare the cockpits",
        description="Train an MLP on scikit-learn's 8x8 handwritten digits twice, with a "
        "well-chosen and with a too-large learning rate, logging every instrument; draw both "
        "dashboards and print a diagnosis of each.",
    )
    demo.add_argument(
        "--out", help="output folder (default: avionics-demo, or avionics-demo-2, ... if taken)"
    )
    demo.add_argument(
        "--steps",
        type=_positive_int,
        default=200,
        help="training steps per run, at least 1 (default: %(default)s)",
    )
    demo.add_argument("--quiet", action="store_true", help="no progress bars")
    demo.set_defaults(handler=_demo)

    run_help = "a run directory (holding log.jsonl), a .jsonl log, or a reference-tool .json log"
    plot = commands.add_parser(
        "plot", help="draw the dashboard of a run", description="Draw the dashboard of a run."
    )
    plot.add_argument("run", help=run_help)
    plot.add_argument(
        "-o", "--output", help="image file: .png, .pdf or .svg (default: RUN/cockpit.png)"
    )
    plot.add_argument("--secondary", metavar="FILE", help="also draw the secondary screen to FILE")
    plot.add_argument("--title", help="figure title (default: run name, optimizer, steps)")
    plot.set_defaults(handler=_plot)

    compare = commands.add_parser(
        "compare",
        help="overlay several runs' instruments in one figure",
        description="Overlay the runs of a sweep in one figure: each run a colour, each "
        "instrument the runs recorded a panel (loss, learning rate, alpha, gradient norm, "
        "noise, curvature, logged metrics).",
    )
    compare.add_argument("runs", nargs="+", metavar="RUN", help=run_help + "; two or more")
    compare.add_argument(
        "-o",
        "--output",
        help="image file: .png, .pdf or .svg (default: compare.png in the runs' common folder)",
    )
    compare.add_argument(
        "--labels", help="the runs' names in the legend, comma-separated (default: their folders)"
    )
    compare.add_argument("--title", help="figure title (default: number of runs, steps)")
    compare.set_defaults(handler=_compare)

    diagnose = commands.add_parser(
        "diagnose",
        help="print plain-language findings about a run",
        description="Print findings about a run, each with the numbers it rests on and what "
        "to try.",
    )
    diagnose.add_argument("run", help=run_help)
    diagnose.add_argument("--json", action="store_true", help="print the findings as JSON")
    diagnose.set_defaults(handler=_diagnose)

    export = commands.add_parser(
        "export",
        help="export a run as CSV, reference-tool JSON or TensorBoard events",
        description="Export a run: csv (scalar series), cockpit-json (the layout of the "
        "reference Cockpit tool's JSON log) or tensorboard (event files).",
    )
    export.add_argument("run", help=run_help)
    export.add_argument("--format", required=True, choices=EXPORT_FORMATS)
    export.add_argument(
        "-o", "--output", help="output file or folder (default: in the run directory)"
    )
    export.set_defaults(handler=_export)
    return parser


def _message(error: Exception) -> str:
    """One line saying what went wrong: an OSError raised by the operating system names its
    file, reason and what to do (``/tmp/x.csv: permission denied; check the path and its
    permissions.``); any other error of avionics says what to do itself."""
    if isinstance(error, OSError) and error.strerror and error.filename is not None:
        advice = OS_ERROR_ADVICE.get(error.errno, "check the path and its permissions")
        return f"{error.filename}: {error.strerror.lower()}; {advice}."
    return " ".join(str(error).split())


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status (0 success, 1 error, 2 usage error,
    130 interrupted). Every error is one line on stderr, ``avionics COMMAND: error: ...``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    prefix = f"avionics {args.command}"
    try:
        return args.handler(args)
    except BrokenPipeError:
        # stdout's reader went away (``avionics diagnose RUN | head``): stop quietly, and
        # point stdout at devnull so that the interpreter's last flush does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print(f"{prefix}: interrupted", file=sys.stderr)
        return 130
    # User errors, printed as one line: CommandError (the checks above); OSError (a path the
    # user chose is missing, a directory, unwritable, or the disk is full); ValueError (the
    # library's answer to bad content: not a run log, a newer log format, a blank path);
    # ImportError (an optional dependency is missing: the message says what to install).
    # Anything else, TypeError included (the command line passes only strings, so the
    # library's TypeErrors for wrong argument types cannot come from the user), is a bug:
    # its traceback is what a bug report needs.
    except (CommandError, OSError, ValueError, ImportError) as error:
        print(f"{prefix}: error: {_message(error)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
