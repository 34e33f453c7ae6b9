"""Decide before you deploy: the four questions asked of a trace, and a verdict with its reasons.

`questions` answers them (`analyze(requests, Deployment(...))`), `verdict` judges, `present` reports; the
command line is `kvtier.cli.trace_commands`. Nothing is imported here, so that `kvtier --help` does not load
numpy.
"""
