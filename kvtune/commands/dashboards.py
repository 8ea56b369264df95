"""`kvtune dashboards build|push`: write kvtune's Grafana dashboards as JSON files, or upload them (and
optionally a Prometheus data source) to a Grafana through its HTTP API."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from kvtune.commands.common import ExitCode
from kvtune.observability import grafana
from kvtune.observability.dashboards import all_dashboards, write_dashboards
from kvtune.server_url import ServerUrlError, server_url

DEFAULT_FOLDER = "kvtune"
DEFAULT_DATASOURCE = "kvtune-prometheus"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    build = actions.add_parser(
        "build", help="write the dashboard JSON files", description="write the dashboard JSON files"
    )
    build.add_argument(
        "--out", type=Path, default=Path("dashboards"), help="folder to write to (default %(default)s)"
    )
    push_help = "create or update the dashboards (and a Prometheus data source) in a Grafana"
    push = actions.add_parser(
        "push",
        allow_abbrev=False,  # `--token VALUE` must not pass for `--token-env`: values never go on argv
        help=push_help,
        description=push_help + ". Credentials are read from environment variables named by flags, "
        "never given on the command line.",
    )
    push.add_argument(
        "--url", required=True, metavar="URL", help="Grafana's address, e.g. http://127.0.0.1:3000"
    )
    credential = push.add_mutually_exclusive_group(required=True)
    credential.add_argument(
        "--token-env", metavar="NAME", help="environment variable holding a service account token (Editor)"
    )
    credential.add_argument(
        "--user", metavar="USER", help="a Grafana user (basic auth; needs --password-env)"
    )
    push.add_argument("--password-env", metavar="NAME", help="environment variable holding --user's password")
    push.add_argument(
        "--folder",
        default=DEFAULT_FOLDER,
        metavar="TITLE",
        help="folder for the dashboards (default %(default)s)",
    )
    push.add_argument(
        "--prometheus-url", metavar="URL", help="also create (or update) a Prometheus data source at this URL"
    )
    push.add_argument(
        "--datasource-name",
        default=DEFAULT_DATASOURCE,
        metavar="NAME",
        help="the data source's name, with --prometheus-url (default %(default)s)",
    )
    push.add_argument(
        "--timeout",
        type=float,
        default=grafana.DEFAULT_TIMEOUT_S,
        metavar="S",
        help="seconds each Grafana answer may take, whole answer included (default %(default)s)",
    )


def main(args: argparse.Namespace) -> int:
    return build(args) if args.action == "build" else push(args)


def build(args: argparse.Namespace) -> int:
    console = Console(stderr=True, soft_wrap=True)
    out: Path = args.out
    if out.exists() and not out.is_dir():
        return _refused(
            console,
            f"--out {out}: is a file, not a folder; give the folder to write the dashboards into (it is "
            "created when missing)",
        )
    try:
        written = write_dashboards(out)
    except OSError as exc:  # a file where a parent folder belongs, no permission, a full disk
        return _refused(console, f"--out {out}: cannot write the dashboards there ({exc.strerror or exc})")
    for path in written:
        sys.stdout.write(f"{path}\n")  # one written file a line
    return ExitCode.OK


def push(args: argparse.Namespace) -> int:
    console = Console(stderr=True, soft_wrap=True)  # one-line messages stay greppable
    if args.user is not None and args.password_env is None:
        return _refused(
            console, "--user needs --password-env NAME, the environment variable holding its password"
        )
    if args.password_env is not None and args.user is None:
        return _refused(
            console, "--password-env goes with --user USER; with a token, use --token-env NAME alone"
        )
    if args.prometheus_url is None and args.datasource_name != DEFAULT_DATASOURCE:
        return _refused(
            console, "--datasource-name names the data source --prometheus-url creates: give both"
        )
    if args.prometheus_url is not None:
        try:  # Grafana stores the URL as written and shows it to every viewer: no password in it
            args.prometheus_url = server_url(args.prometheus_url, "http://127.0.0.1:9090", userinfo=False)
        except ServerUrlError as exc:
            return _refused(console, f"--prometheus-url {exc}")
    try:
        with grafana.connect_with_env(
            args.url,
            token_env=args.token_env,
            user=args.user,
            password_env=args.password_env,
            timeout=args.timeout,
        ) as board:
            folder = board.ensure_folder(args.folder, grafana.folder_uid(args.folder))
            console.print(f"folder {escape(args.folder)} (uid {escape(folder)})")
            if args.prometheus_url is not None:
                change, uid = board.ensure_prometheus_datasource(args.datasource_name, args.prometheus_url)
                console.print(
                    f"data source {escape(args.datasource_name)} -> {escape(args.prometheus_url)}: {change}"
                    + (f" (uid {escape(uid)})" if uid else "")
                )
            for model in all_dashboards().values():
                pushed = board.push_dashboard(model, folder)
                version = f" (version {pushed.version})" if pushed.version is not None else ""
                console.print(f"{escape(pushed.title)}: {escape(pushed.url)}{version}")
    except grafana.GrafanaError as exc:
        console.print("[red]error:[/red]", escape(str(exc)), highlight=False)
        return ExitCode.FAILED if exc.kind == "failed" else ExitCode.CONFIG
    return ExitCode.OK


def _refused(console: Console, message: str) -> int:
    console.print("[red]error:[/red]", escape(message), highlight=False)
    return ExitCode.CONFIG
