"""The `edgellm` command's entry point (pyproject's [project.scripts]). It imports little, so a
Ctrl-C while the command's modules load (typer, rich, numpy: the first ~0.1 s) ends with exit 130
and no traceback; the launcher script imported edgellm.cli itself, outside any handler."""
import sys


def main() -> None:
    try:
        from .cli import main as cli_main
    except KeyboardInterrupt:
        if sys.stderr is not None:
            try:
                sys.stderr.write("\n")
            except OSError:
                pass
        sys.exit(130)
    cli_main()
