"""``python -m reports [DIR ...] [--readme PATH] [--check] [--csv PATH] [--out DIR] [--no-plots]``: results.json →
table, CSV, plots.

Without DIR it reads the results committed under reports/results and, with
--check, compares README.md's results block against them, and docs/results.md's (the full table: the README's
block is the answer and a short table whenever a docs/results.md with the markers lies beside it). One DIR: the report
goes into it. Several: one combined report in combined-report/ of the folder
they all lie in (--out DIR: elsewhere), never over one sweep's own report.
``python -m reports plan PATH [-o OUT.png]`` draws one plan (a point folder or a plan.json);
``python -m reports balance DIR [DIR ...]`` compares modeled and measured balance over repeated sweeps.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from backends.runtime.collector import exit_with
from reports.collect import collect
from reports.plan_figure import draw_plan_file, draw_side_by_side, readme_plan_lines, write_plan_figures
from reports.plan_files import plan_figure_paths, published_plans
from reports.plots import (
    length_histogram_paths,
    plot_paths,
    profile_figure_paths,
    write_length_histograms,
    write_plots,
    write_profile_figures,
)
from reports.render import (
    current_block,
    markdown_tables,
    no_block_message,
    readme_block,
    replace_block,
    short_block,
    short_tables,
    write_csv,
)
from reports.side_by_side import TITLE, with_side_by_side

PACKAGE = Path(__file__).resolve().parent
REPO = PACKAGE.parent
COMMITTED = PACKAGE / "results"
PLANS = PACKAGE / "plans"  # dry-run plan.json files docs/results.md draws (reports/plans/<name>/plan.json)
COMBINED = "combined-report"  # where several DIRs' report goes by default: a folder of its own in their common one


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m reports", description=__doc__.splitlines()[0],
                                 epilog="python -m reports plan PATH [-o OUT.png] draws one plan (see: plan --help); "
                                        "python -m reports balance DIR [DIR ...] compares modeled and measured balance")
    ap.add_argument("dirs", nargs="*", type=Path, help="run or multirun folders (default: reports/results)")
    ap.add_argument("--readme", type=Path, help="rewrite the block between the results markers of this file")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 when the README block (or the --full page's) differs from the results")
    ap.add_argument("--full", type=Path, help="the page whose results block gets the full table, the README's then "
                    "short (default: docs/results.md beside --readme, when it holds the markers)")
    ap.add_argument("--csv", type=Path, help="write the collected frame as CSV here")
    ap.add_argument("--out", type=Path, help="the folder report.md, results.csv and plots/ go into (default: DIR; "
                    f"with several DIRs, {COMBINED} in the folder they all lie in, never one sweep's own)")
    ap.add_argument("--no-plots", action="store_true",
                    help="report.md and results.csv only: no figures drawn, none linked (a text report in a second)")
    return ap.parse_args(argv)


def plan_main(argv) -> int:
    """``python -m reports plan PATH [-o OUT.png]``: the picture of one plan, nothing else run."""
    from backends.errors import UserError

    ap = argparse.ArgumentParser(prog="python -m reports plan", description=plan_main.__doc__.split(": ", 1)[1])
    ap.add_argument("path", type=Path, help="a point folder holding plan.json, or a plan.json file")
    ap.add_argument("-o", "--out", help="the PNG to write (default: plan.png beside the plan.json); a folder: "
                    "FOLDER/plan-<point>.png; no extension: OUT.png; only PNG is written")
    args = ap.parse_args(argv)
    try:
        png = draw_plan_file(args.path, args.out)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(png)
    return 0


def balance_main(argv) -> int:
    """``python -m reports balance DIR [DIR ...]``: modeled against measured balance per setting, over the sweeps."""
    from reports.balance_table import balance_markdown

    ap = argparse.ArgumentParser(prog="python -m reports balance", description=balance_main.__doc__.split(": ", 1)[1])
    ap.add_argument("dirs", nargs="+", type=Path, help="sweep folders (the same grid run several times)")
    args = ap.parse_args(argv)
    missing = [d for d in args.dirs if not d.exists()]
    if missing:
        print(f"error: {missing[0]}: no such folder (give sweep folders holding results.json)", file=sys.stderr)
        return 2
    print(balance_markdown(args.dirs))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:
        return plan_main(argv[1:])
    if argv[:1] == ["balance"]:
        return balance_main(argv[1:])
    from backends.errors import UserError

    try:
        return report(parse_args(argv))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def readme_text(readme: Path, verb: str) -> str:
    """The README's text, which must hold the results block (UserError naming the file and the markers otherwise)."""
    from backends.errors import UserError

    usage = f"--readme takes the Markdown file whose results block to {verb}"
    if not readme.exists():
        raise UserError(f"{readme}: no such file ({usage})")
    if not readme.is_file():
        raise UserError(f"{readme}: not a file ({usage})")
    try:
        text = readme.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{readme}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    if current_block(text) is None:
        raise UserError(no_block_message(readme, verb))
    return text


def _write(path: Path, write, hint: str) -> None:
    """Run ``write``; a file it cannot write is one line naming it (UserError), not a traceback."""
    from backends.errors import UserError

    try:
        write()
    except OSError as exc:
        raise UserError(f"{exc.filename or path}: cannot write ({exc.strerror or exc}; {hint})") from None


def report(args: argparse.Namespace) -> int:
    from backends.errors import UserError

    committed = not args.dirs
    dirs = args.dirs or [COMMITTED]
    check_dirs(dirs)
    readme = args.readme or (REPO / "README.md" if committed and args.check else None)
    if args.check and readme is None:
        raise UserError("--check needs --readme PATH (or no DIR, to check README.md)")
    if args.no_plots and args.readme is not None and not args.check:
        raise UserError("--no-plots: the README's results block links the figures; drop --no-plots or --readme")
    # Before anything is written: a README the command cannot check or rewrite stops it here.
    verb = "check" if args.check else "rewrite"
    text = readme_text(readme, verb) if readme is not None else None
    full = full_page(args.full, readme)
    full_text = readme_text(full, verb) if full is not None else None
    df = collect(dirs)
    out_dir = args.out or (PACKAGE if committed else report_folder(dirs))
    source = "reports/results" if committed else ", ".join(str(d) for d in dirs)
    plots = plot_paths(out_dir, df)  # the figures that have something to show (no tok/s axes where nothing ran)
    if not df.empty:
        df["plan_png"] = plan_figure_paths(df, out_dir)
        df["lengths_png"] = length_histogram_paths(df, out_dir)  # each setting's workload, drawn below
        df["profile_png"] = profile_figure_paths(df, out_dir)  # bench.profile's breakdowns, drawn below
    # the repository's own plan figures go on the repository's pages only: a user's page gets its results' figures
    plans = published_plans(PLANS) if committed and readme is not None else []
    plan_pngs = [PACKAGE / "plots" / f"plan-{p.parent.name}.png" for p in plans]
    # every column, the plots and the plan figures: the full page's block where there is one, else the README's
    page = full if full is not None else readme
    plan_lines = readme_plan_lines(plan_pngs, plans, page.parent if page else REPO)
    command = regenerate_command(args.dirs, readme, args.full)
    block = readme_block(df, plots, page, source, plan_lines, command)
    blocks = [(readme, text, block)] if full is None else [
        (readme, text, short_block(df, readme, full, source, command)), (full, full_text, block)]

    if args.check:
        stale = [path for path, old, new in blocks if current_block(old) != new]
        if stale:
            extra = "" if args.full is None else f" --full {args.full}"
            print(f"{', '.join(map(str, stale))}: results block is stale; run: python -m reports "
                  f"{' '.join(map(str, args.dirs))} --readme {readme}{extra}".replace("  ", " "))
            return 1
        print(f"{' and '.join(str(path) for path, _, _ in blocks)}: results block matches {source} ({len(df)} runs)")
        return 0

    here = f"the report goes into {out_dir}; --out DIR chooses another folder"
    _write(out_dir, lambda: out_dir.mkdir(parents=True, exist_ok=True), here)
    csv = args.csv or out_dir / "results.csv"
    csv = csv / "results.csv" if csv.is_dir() else csv
    # the CSV first: an output it cannot write stops the command before anything is drawn or printed
    _write(csv, lambda: write_csv(df, csv), "give --csv a path in a writable folder" if args.csv else here)
    drawn = []
    if args.no_plots:
        df["plan_png"] = df["lengths_png"] = df["profile_png"] = None
    else:
        drawn = _write_figures(lambda: write_plots(df, out_dir), plots[0] if plots else out_dir, here)
        # A figure it cannot draw is a warning, and the report links only the figures drawn.
        df["plan_png"] = write_plan_figures(df, out_dir)
        df["lengths_png"] = write_length_histograms(df, out_dir)  # each setting's workload: sequences, tokens by length
        df["profile_png"] = write_profile_figures(df, out_dir)  # each profiled point: seconds per category, pass, rank
        drawn += [p for col in ("plan_png", "lengths_png", "profile_png") for p in df[col].dropna()]
    if committed:  # the README's plan figures are committed files: only the committed run redraws them
        _write(plan_pngs[0] if plan_pngs else PACKAGE, lambda: draw_side_by_side(plans, plan_pngs), here)
    report_md = with_side_by_side(markdown_tables(df, out_dir), df)  # with the planners side by side, if several ran
    _write(out_dir / "report.md", lambda: (out_dir / "report.md").write_text(report_md + "\n"), here)
    for path, old, new in blocks if readme is not None else []:
        _write(path, lambda p=path, o=old, n=new: p.write_text(replace_block(o, n, p)), f"{path} must be writable")
    # The terminal gets the answer and the short table; every column is in report.md, whose path it ends with.
    print(terminal_text(df, out_dir / "report.md", csv, len(set(drawn)), TITLE in report_md))
    for path, _, _ in blocks if readme is not None else []:
        print(f"{path}: results block rewritten ({len(df)} runs)")
    return 0


def _write_figures(draw, path: Path, hint: str) -> list:
    out: list = []
    _write(path, lambda: out.extend(draw()), hint)
    return out


def terminal_text(df, report_md: Path, csv: Path, n_figures: int, planners: bool) -> str:
    """What ``python -m reports`` (and so the end of a sweep) prints: per setting the answer lines, the setting and
    the short table (the README's columns), then where the full report is and what was written."""
    full = f"{report_md}" + (", with the planners side by side" if planners else "")
    beside = ["results.csv"] if csv == report_md.parent / "results.csv" else []
    if n_figures:
        beside.append(f"plots/ ({n_figures} figure{'s' if n_figures != 1 else ''})")
    tail = f"Beside it: {' and '.join(beside)}." if beside else ""
    if csv != report_md.parent / "results.csv":
        tail += f"{' ' if tail else ''}The CSV: {csv}."
    return f"{short_tables(df, None, full)}\n\n{tail}"


def check_dirs(dirs) -> None:
    """Each DIR is a folder holding at least one results.json, or a results.json (UserError naming the first that
    is not)."""
    from backends.errors import UserError
    from reports.collect import find_results

    usage = "give run or multirun folders holding results.json"
    for d in dirs:
        if not d.exists():
            raise UserError(f"{d}: no such folder ({usage})")
        if d.is_file() and d.name != "results.json":
            raise UserError(f"{d}: a file, not a run or multirun folder ({usage})")
        if d.is_dir() and not find_results([d]):
            raise UserError(f"{d}: no results.json in it or below ({usage})")


def regenerate_command(dirs, readme: Optional[Path], full: Optional[Path]) -> str:
    """The command that regenerates a page's block, its paths relative to the README's folder (the same text however
    the command was typed, so --check compares like with like)."""
    import os

    base = readme.resolve().parent if readme is not None else REPO
    rel = lambda p: Path(os.path.relpath(Path(p).resolve(), base)).as_posix()  # noqa: E731
    parts = ["python -m reports", *(rel(d) for d in dirs or []), "--readme", rel(readme) if readme else "README.md"]
    if full is not None and readme is not None and Path(full).resolve() != base / "docs" / "results.md":
        parts += ["--full", rel(full)]  # the default page goes unsaid, however the command was typed
    return " ".join(parts)


def full_page(given: Optional[Path], readme: Optional[Path]) -> Optional[Path]:
    """The page the full table goes to: --full, else docs/results.md beside the README when it holds the markers."""
    from backends.errors import UserError

    if given is not None:
        if readme is None:
            raise UserError("--full needs --readme PATH (or no DIR, with --check): the README's block links to it")
        return given
    if readme is None:
        return None
    page = readme.parent / "docs" / "results.md"
    try:
        return page if page.is_file() and current_block(page.read_text()) is not None else None
    except (OSError, UnicodeDecodeError):
        return None


def report_folder(dirs) -> Path:
    """Where a report of ``dirs`` goes: the one folder given (or a results.json file's); for several, a folder of its
    own (``COMBINED``) in the folder they all lie in: a combined table never overwrites one sweep's own report."""
    import os

    from backends.errors import UserError

    folders = [(d if d.is_dir() else d.parent).resolve() for d in dirs]
    if len(set(folders)) == 1:
        return Path(dirs[0]) if Path(dirs[0]).is_dir() else Path(dirs[0]).parent
    common = Path(os.path.commonpath(folders))
    if common == Path(common.anchor):  # /combined-report: not where anyone looks for a report, nor may write
        raise UserError(f"{', '.join(map(str, dirs))}: these folders share no folder but {common}, where the combined "
                        "report would go; choose one with --out DIR")
    return common / COMBINED


if __name__ == "__main__":
    exit_with(main())
