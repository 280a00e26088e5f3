"""Composition roots: the command line, the supervised group, the server runner, log output."""
