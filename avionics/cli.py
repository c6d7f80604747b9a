"""The ``avionics`` command line: demo, plot, diagnose, export."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EXPORT_FORMATS = ("csv", "cockpit-json", "tensorboard")
EXPORT_DEFAULT_NAMES = {"csv": "log.csv", "cockpit-json": "cockpit.json", "tensorboard": "tb"}


class CommandError(Exception):
    """An error the user can fix; printed without a traceback."""


def _run_dir(run: str) -> Path:
    """Where outputs of ``run`` go by default: the run directory, or the log file's folder."""
    path = Path(run)
    return path if path.is_dir() else path.parent


def _read(run: str):
    from avionics.records import read_run

    result = read_run(run)
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
    plot(run, output, title=args.title)
    print(f"dashboard written to {output}")
    if args.secondary:
        plot_secondary(run, args.secondary)
        print(f"secondary screen written to {args.secondary}")
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
    if args.format == "csv":
        to_csv(run, output)
    elif args.format == "cockpit-json":
        if output.suffix != ".json":
            raise CommandError(
                f"the reference tool reads logs named *.json; got {output}. Pass -o FILE.json."
            )
        to_cockpit_json(run, output)
    else:
        to_tensorboard(run, output, progress=True)
    print(f"{args.format} written to {output}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``avionics`` command."""
    from avionics import __version__

    parser = argparse.ArgumentParser(
        prog="avionics",
        description="A cockpit for PyTorch training: draw, diagnose and export run logs "
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
        "--steps", type=int, default=200, help="training steps per run (default: %(default)s)"
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


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status (0 success, 1 error, 2 usage error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except (CommandError, FileNotFoundError, FileExistsError, ValueError, ImportError) as error:
        print(f"avionics {args.command}: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
