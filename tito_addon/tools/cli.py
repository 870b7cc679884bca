"""`python -m tito_addon`: run mitmdump with the addon, or one of the subcommands (`--help` lists them).

python -m tito_addon [mitmdump args]          mitmdump -s tito_addon/__init__.py, connection_strategy=lazy
python -m tito_addon show RECORD_DIR|FILE [SELECTION] [--full] [--width N] [--json]
                                               a session as a person reads it: episodes, turns, calls, results
python -m tito_addon export RECORD_DIR OUT [--format generic|verl|slime|verl-dataset] [--to parquet|jsonl|pt]
                                  [SELECTION] [--group-size N [--group-policy refuse|drop|pad]]
                                  [--dedupe-shared-turns] [--mask-offpolicy]
                                               one row per segment, grouped, for trainers
python -m tito_addon audit RECORD_DIR [SELECTION] [--json OUT] [--html PAGE] [--branch SESSION:LEAF]
                                               drift against a stock re-render
    SELECTION: --session ID, --session-prefix P (both repeatable), --sessions-file FILE (one id a line);
    the named ids first, then each prefix's matches in id order; none given: every session
python -m tito_addon view RECORD_DIR [--port N] [--tokenizer PATH] [--html OUT [--episode E]]
                                               a web page over a record dir: episodes, trees, tokens, groups
python -m tito_addon reference-backend ...     the built-in sglang-protocol reference backend
python -m tito_addon demo                      an end-to-end capture against the reference backend
python -m tito_addon verify-template --tokenizer PATH [--family NAME] [--chat-template-kwargs JSON]
                                               is a template append-only, and which family to use
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tito_addon.records.record_reader import RecordError, iter_session_files, session_parts
from tito_addon.tools.selection_args import add_selection, selection, shown_sessions

# Replay answers every chat turn itself; the reverse target is never contacted (connection_strategy=lazy). It is
# named for what it is in mitmproxy's own listening line, on a name that never resolves (RFC 2606).
REPLAY_MODE = "reverse:http://tito-replay.invalid:1"


def run_mitmdump(args: list[str]) -> int:
    from mitmproxy.tools.main import mitmdump

    script = str(Path(__file__).resolve().parents[1] / "__init__.py")
    # Lazy upstream connections: the addon answers chat turns itself, so a down or absent upstream must
    # not close the client's connection before the addon sees the request.
    mitmdump(["-s", script, "--set", "connection_strategy=lazy", *args])
    return 0


def show(argv: list[str]) -> int:
    import shutil

    from tito_addon.tools.session_view import session_text, turn_json

    parser = argparse.ArgumentParser(
        prog="python -m tito_addon show",
        description="Print recorded sessions: per episode its reward, group, labels and segments; per turn its tool "
        "calls with their arguments, the results that answered them, reasoning and text.",
    )
    parser.add_argument("record_dir", type=Path, metavar="RECORD_DIR|FILE", help="a record dir or one record file")
    add_selection(parser, "only")
    parser.add_argument("--json", action="store_true", help="one JSON object per turn, with full prompt ids")
    parser.add_argument("--full", action="store_true", help="whole texts, tool arguments and results, not shortened")
    parser.add_argument("--width", type=int, metavar="N", help="cut lines to N characters (default: the terminal's)")
    args = parser.parse_args(argv)
    width = args.width or shutil.get_terminal_size((160, 24)).columns
    try:
        for session_file in shown_sessions(args.record_dir, selection(args)):
            if not args.json:
                for line in session_text(session_file, width, args.full):
                    print(line)
                continue
            ids = session_file.full_ids()
            images = session_file.sequence_images()
            notes: dict[int, list[Any]] = {}
            for note in session_file.annotations:
                if note.turn_id is not None:
                    notes.setdefault(note.turn_id, []).append(note)
            for turn in session_file.turns:
                print(turn_json(turn, ids[turn.turn_id], notes.get(turn.turn_id, []), images[turn.turn_id]))
    except RecordError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def export_command(argv: list[str]) -> int:
    from rich.progress import Progress

    from tito_addon.records.rollout_groups import GROUP_POLICIES, GroupSizeError
    from tito_addon.records.trainer_rows import (
        FILE_TYPES,
        FORMATS,
        ExportOptions,
        encode_rows,
        parse_calls,
        read_files,
        resolve_format,
        rows_of,
    )

    parser = argparse.ArgumentParser(prog="python -m tito_addon export", description="Export segments for trainers.")
    parser.add_argument("record_dir", type=Path)
    parser.add_argument("out", type=Path, help="the file to write (with --to pt: the folder of slime's rollout files)")
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="generic",
        help="row layout: generic, verl, slime or verl-dataset; parquet or jsonl: the generic layout in that file type",
    )
    parser.add_argument("--to", choices=FILE_TYPES, help="file type (default: parquet; pt: slime's rollout files)")
    add_selection(parser, "export")
    parser.add_argument(
        "--calls",
        metavar="CALLS",
        help="only the segments of these calls, comma-separated, of: main, compaction, subagent, side (default: all)",
    )
    parser.add_argument("--group-size", type=int, metavar="N", help="rows each group must have (n_samples_per_prompt)")
    parser.add_argument(
        "--group-policy",
        choices=GROUP_POLICIES,
        default="refuse",
        help="a group of another size than --group-size: refuse the export (default), drop the group, or pad it",
    )
    parser.add_argument(
        "--dedupe-shared-turns",
        action="store_true",
        help="a turn shared by several branches trains in its first row only (default: in every row holding it)",
    )
    parser.add_argument(
        "--mask-offpolicy",
        action="store_true",
        help="sampled tokens of an older weight version than their row's newest train nothing (slime's "
        "--mask-offpolicy-in-partial-rollout): a turn resumed across a weight update trains only its newest part",
    )
    parser.add_argument(
        "--groups-per-file", type=int, metavar="K", help="--to pt: groups per rollout file (default: all)"
    )
    parser.add_argument("--summary", type=Path, metavar="JSON", help="also write each group's episodes and rows here")
    args = parser.parse_args(argv)
    try:
        layout, file_type = resolve_format(args.format, args.to)
        options = ExportOptions(
            parse_calls(args.calls), args.group_size, args.group_policy, args.dedupe_shared_turns, args.mask_offpolicy
        )
        if args.group_size is not None and args.group_size < 1:
            raise ValueError("--group-size must be at least 1")
        if args.groups_per_file is not None and (file_type != "pt" or args.groups_per_file < 1):
            raise ValueError("--groups-per-file takes a positive number, with --to pt")
    except ValueError as exc:
        parser.error(str(exc))
    try:
        if not args.record_dir.is_dir():
            raise RecordError(f"{args.record_dir} is not a directory")
        chosen = selection(args)
        # Sessions, not files: one session may have a part per writer process.
        sessions = len(chosen) if chosen is not None else len(session_parts(args.record_dir))
        with Progress(transient=True) as progress:
            task = progress.add_task("reading sessions", total=sessions)
            files = read_files(args.record_dir, chosen, lambda: progress.advance(task))
        rows, arrangement = rows_of(files, layout, options)
        if file_type == "pt":
            from tito_addon.trainers.slime_rollouts import SlimeRolloutError, write_rollout_files

            try:
                written = write_rollout_files(rows, args.out, groups_per_file=args.groups_per_file)
            except ImportError as exc:
                raise RecordError(
                    f"slime's rollout files are written with torch ({exc}): export --format slime to Parquet, then "
                    "run `python -m tito_addon.trainers.slime_rollouts ROWS OUT_DIR` in slime's environment"
                ) from exc
            except SlimeRolloutError as exc:
                raise RecordError(str(exc)) from exc
        else:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_bytes(encode_rows(rows, layout, file_type))
    except (RecordError, GroupSizeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summary = arrangement.summary()
    if args.summary is not None:
        args.summary.write_text(json.dumps(summary, indent=1) + "\n")
    sizes = sorted({g["rows"] + g["padded"] for g in summary["groups"] if g["group_index"] is not None})
    unit = "groups" if layout == "verl-dataset" else "segments"
    print(f"{len(rows)} {unit} from {sessions} sessions written to {args.out} ({layout}, {file_type})")
    print(
        f"{summary['episodes']} episodes in {len(summary['groups']) - summary['dropped_groups']} groups of "
        f"{', '.join(map(str, sizes)) or '0'} rows"
        + (f"; {summary['dropped_groups']} groups of another size left out" if summary["dropped_groups"] else "")
    )
    if file_type == "pt":
        print(f"slime rollout files: {', '.join(path.name for path in written)}")
    if summary["shared_turns"]:
        how = (
            "trained in their first row only"
            if options.dedupe_shared_turns
            else ("trained once per row holding them; --dedupe-shared-turns trains each once")
        )
        print(f"{summary['shared_turns']} sampled turns lie in more than one row: {how}")
    return 0


def redrive_command(argv: list[str]) -> int:
    import asyncio

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from tito_addon.backends.upstream_client import UpstreamClient
    from tito_addon.tito_errors import TitoError, UpstreamPassthrough
    from tito_addon.tools.redrive import Scorer, redrive

    parser = argparse.ArgumentParser(
        prog="python -m tito_addon redrive",
        description="Score every recorded completion under a live backend; report the logprob gap per turn.",
    )
    parser.add_argument("record_dir", type=Path)
    parser.add_argument("--backend", required=True, help="backend base URL, e.g. http://127.0.0.1:30000")
    parser.add_argument("--backend-kind", choices=("sglang", "vllm"), default="sglang")
    parser.add_argument("--json", type=Path, help="also write the report as JSON here")
    args = parser.parse_args(argv)

    async def run() -> Any:
        client = UpstreamClient()
        try:
            turns = sum(len(f.turns) for f in iter_session_files(args.record_dir))
            with Progress(transient=True) as progress:
                task = progress.add_task("scoring recorded turns", total=turns)
                scorer = Scorer(client, args.backend, args.backend_kind)
                return await redrive(args.record_dir, scorer, lambda: progress.advance(task))
        finally:
            await client.close()

    try:
        report = asyncio.run(run())
    except (RecordError, TitoError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except UpstreamPassthrough as exc:
        print(f"error: the backend answered {exc.status}: {exc.body[:300]!r}", file=sys.stderr)
        return 2
    table = Table("session", "turn", "call", "tokens", "mean |Δ|", "max |Δ|", "KL est.")
    for turn in report.turns:
        table.add_row(
            turn.session_id[:16],
            str(turn.turn_id),
            turn.call,
            str(turn.tokens),
            f"{turn.mean_abs_diff:.4f}",
            f"{turn.max_abs_diff:.4f}",
            f"{turn.kl_estimate:+.4f}",
        )
    console = Console()
    console.print(table)
    totals = report.totals()
    console.print(
        "total: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in totals.items())
    )
    routed = report.routes_weights()
    if routed:  # replayed under the scored weights, routes recorded under others are another model's routing
        said = ", ".join(f"{version} ({count} turns)" for version, count in routed.items())
        console.print(f"MoE routes recorded under weight versions: {said}")
    if args.json:
        payload = {"turns": [t.as_dict() for t in report.turns], "totals": totals, "by_call": report.by_call()}
        args.json.write_text(json.dumps(payload, indent=1), "utf-8")
    return 0


def audit_command(argv: list[str]) -> int:
    from collections import Counter

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from tito_addon.engine.tokenizer_loading import load_tokenizer
    from tito_addon.tools.drift_audit import CLASSES, audit_session

    parser = argparse.ArgumentParser(
        prog="python -m tito_addon audit",
        description="Compare each recorded branch with a stock re-render of its messages; classify every drift.",
    )
    parser.add_argument("record_dir", type=Path)
    parser.add_argument("--tokenizer", help="default: the tokenizer named in the recording")
    parser.add_argument("--json", type=Path, help="write the full audit (every differing span) as JSON here")
    parser.add_argument("--html", type=Path, help="write one trajectory, token by token, as an HTML page here")
    parser.add_argument("--branch", help="SESSION:LEAF_TURN for --html (default: the first branch)")
    add_selection(parser, "audit only")
    args = parser.parse_args(argv)
    try:
        if not args.record_dir.is_dir():
            raise RecordError(f"{args.record_dir} is not a directory")
        from tito_addon.records.trainer_rows import read_files

        files = read_files(args.record_dir, selection(args))
        for session_file in files:
            session_file.full_ids()  # a partial recording fails here, before any tokenizer is loaded
        names = {args.tokenizer} if args.tokenizer else {t.tokenizer.name for f in files for t in f.turns[:1]}
        tokenizers = {name: load_tokenizer(name, trust_remote_code=False) for name in names}
        audits = []
        with Progress(transient=True) as progress:
            task = progress.add_task("auditing sessions", total=len(files))
            for session_file in files:
                if session_file.turns:
                    name = args.tokenizer or session_file.turns[0].tokenizer.name
                    audits += audit_session(session_file, tokenizers[name])
                progress.advance(task)
    except (RecordError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    table = Table("session", "branch leaf", "tokens", "drifted", *CLASSES)
    totals: Counter[str] = Counter()
    for audit in audits:
        kinds = audit.kinds()
        totals.update(kinds)
        drifted = sum(audit.per_turn.values())
        table.add_row(
            audit.session_id[:16],
            str(audit.leaf_turn_id),
            str(audit.tokens),
            str(drifted),
            *(str(kinds.get(c, "")) for c in CLASSES),
        )
    console = Console(width=200)
    console.print(table)
    console.print(f"{len(audits)} branches; drift spans by kind: " + ", ".join(f"{k} {v}" for k, v in totals.items()))
    for audit in audits:
        for turn_id, cuts in audit.resumed.items():  # its ids are the attempts' together, exactly as sampled
            console.print(f"{audit.session_id} turn {turn_id}: resumed after a weight update cut it at {cuts}")
        if audit.routes is not None:
            routes = audit.routes
            versions = ", ".join(routes["weight_versions"]) or "not reported"
            console.print(f"{audit.session_id} turn {audit.leaf_turn_id}: MoE routes of {routes['through']} of "
                          f"{routes['positions']} positions, under weights {versions}" + (
                              f"; missing: {'; '.join(routes['missing'])}" if routes["missing"] else ""))  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps([a.as_dict() for a in audits], ensure_ascii=False, indent=1), "utf-8")
    if args.html:
        from tito_addon.tools.audit_page import render_page

        wanted = [a for a in audits if not args.branch or f"{a.session_id}:{a.leaf_turn_id}" == args.branch]
        if not wanted:
            print(f"error: no branch {args.branch!r} in {args.record_dir}", file=sys.stderr)
            return 2
        chosen = wanted[0]
        session_file = next(f for f in files if f.turns and f.turns[0].session_id == chosen.session_id)
        name = args.tokenizer or session_file.turns[0].tokenizer.name
        args.html.write_text(render_page(session_file, chosen, tokenizers[name]), "utf-8")
        console.print(f"page: {args.html}")
    return 0


def verify_template_command(argv: list[str]) -> int:
    from tito_addon.engine.model_families import FAMILIES
    from tito_addon.engine.tokenizer_loading import load_tokenizer
    from tito_addon.tools.template_verifier import render_report, verify

    parser = argparse.ArgumentParser(
        prog="python -m tito_addon verify-template",
        description=(
            "Render multi-turn conversations (system, user, reasoning, parallel tool calls, tool results, later user "
            "and system turns) incrementally and from scratch; report whether the template is append-only for "
            "each appended role, where the first divergence is, and which family to use. Exit 0: the family "
            "(--family, else `default` or the family suggested for the template) passes; 1: it does not."
        ),
    )
    parser.add_argument("tokenizer_arg", nargs="?", metavar="TOKENIZER", help="same as --tokenizer")
    parser.add_argument("--tokenizer", help="HF tokenizer name or local directory")
    parser.add_argument("--family", choices=list(FAMILIES), help="default: `default`, then the suggested family")
    parser.add_argument("--chat-template-kwargs", default="{}", help="JSON object pinned on every render")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--json", action="store_true", help="the verdict as JSON")
    args = parser.parse_args(argv)
    name = args.tokenizer or args.tokenizer_arg
    if not name:
        parser.error("a tokenizer is required (TOKENIZER or --tokenizer)")
    try:
        kwargs = json.loads(args.chat_template_kwargs)
        if not isinstance(kwargs, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        parser.error(f"--chat-template-kwargs: {exc}")
    try:
        tokenizer = load_tokenizer(name, trust_remote_code=args.trust_remote_code)
    except Exception as exc:  # transformers raises OSError, ValueError, HF hub errors...
        print(f"error: cannot load tokenizer {name!r}: {exc}", file=sys.stderr)
        return 2
    verdict = verify(tokenizer, name, args.family or "default", kwargs, suggest=args.family is None)
    print(json.dumps(verdict.to_json(), ensure_ascii=False, indent=1) if args.json else render_report(verdict))
    usable = verdict.ok or (verdict.suggestion is not None and verdict.suggestion.ok)
    return 0 if usable else 1


def replay_command(argv: list[str]) -> int:
    usage = "usage: python -m tito_addon replay RECORD_DIR [mitmdump args]"
    if argv[:1] in (["-h"], ["--help"]):
        print(usage)
        return 0
    if not argv or argv[0].startswith("-"):
        print(usage, file=sys.stderr)
        return 2
    rest = argv[1:]
    mode = [] if any(a == "--mode" or a.startswith("--mode=") or a == "-m" for a in rest) else ["--mode", REPLAY_MODE]
    return run_mitmdump([*mode, "--set", f"tito_replay_dir={Path(argv[0]).resolve()}", *rest])


def reference_backend_command(argv: list[str]) -> int:
    """The sglang replica, or with `--kind vllm` the vLLM one: each server's replica has its own command line."""
    finder = argparse.ArgumentParser(add_help=False)
    finder.add_argument("--kind", default="sglang")
    if finder.parse_known_args(argv)[0].kind == "vllm":
        from tito_addon.replicas.vllm_cli import main as vllm_main

        return vllm_main(argv)
    from tito_addon.replicas.sglang_cli import main as reference_main

    return reference_main(argv)


def view_command(argv: list[str]) -> int:
    from tito_addon.tools.record_browser import main as view_main

    return view_main(argv)


def demo_command(argv: list[str]) -> int:
    from tito_addon.tools.demo_run import main as demo_main

    return demo_main(argv)


# name -> (one line for `--help`, the command)
SUBCOMMANDS: dict[str, tuple[str, Callable[[list[str]], int]]] = {
    "show": ("a session as a person reads it: its episodes, turns, tool calls and results", show),
    "export": (
        "one row per segment for trainers: generic, verl, slime or verl-dataset; parquet, jsonl or pt",
        export_command,
    ),
    "replay": ("serve a recording again with no backend: mitmdump answering from RECORD_DIR", replay_command),
    "redrive": ("score every recorded completion under a live backend: the logprob gap per turn", redrive_command),
    "audit": ("compare each branch with a stock re-render and classify every drift (JSON, HTML)", audit_command),
    "reference-backend": (
        "the built-in sglang-protocol backend: a real tokenizer and a scripted model",
        reference_backend_command,
    ),
    "view": ("browse a record dir in a web page (or one episode as a file): episodes, trees, tokens", view_command),
    "demo": ("a capture end to end against the reference backend, checked and printed", demo_command),
    "verify-template": ("is a chat template append-only, and which model family to use", verify_template_command),
}
MITMDUMP_HELP = "--mitmdump-help"


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [
        "usage: python -m tito_addon SUBCOMMAND [ARGS]   (SUBCOMMAND --help for its own)",
        "       python -m tito_addon [mitmdump options]  (the proxy: mitmdump with the addon loaded)",
        "",
        "subcommands:",
        *(f"  {name:{width}}  {summary}" for name, (summary, _) in SUBCOMMANDS.items()),
        "",
        "the proxy:",
        f"  {MITMDUMP_HELP:{width}}  mitmdump's own help: every mitmdump flag works here",
        f"  {'--options':{width}}  every option with its default, the addon's tito_* options included",
        f"  {'--set K=V':{width}}  set an option, e.g. --set tito_tokenizer=PATH --set tito_backend_kind=vllm",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv and argv[0] == MITMDUMP_HELP:
        try:
            run_mitmdump(["--help"])
        except SystemExit:  # mitmproxy exits 1 after printing its help; asked for, the help is a success
            pass
        return 0
    if argv and argv[0] in SUBCOMMANDS:
        return SUBCOMMANDS[argv[0]][1](argv[1:])
    return run_mitmdump(argv)
