"""One module per `kvtune` subcommand, each with `add_cli_args(parser)` and `main(args) -> int`."""
