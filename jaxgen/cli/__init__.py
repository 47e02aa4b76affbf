"""The `jaxgen` command line (argument parsing only): `jaxgen.cli.main.main`."""
