"""One module per ``tracerl`` subcommand: ``HELP``, ``configure(parser)``, ``run(args) -> int``."""
