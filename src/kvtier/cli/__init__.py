"""The `kvtier` command line: `main` parses and hands over; `trace_commands` holds the trace commands
(generate, analyze, simulate). Bad input exits with code 2 and a message that names the field, file or value."""

from kvtier.cli.main import EXIT_BAD_INPUT, main

__all__ = ["EXIT_BAD_INPUT", "main"]
