"""The `pyedgemoe` command (and python -m pyedgemoe): pyedgemoe.cli's main, imported and run here so
that Ctrl-C while it is imported or builds its commands (a second or so) is exit status 130, as after,
not a traceback."""
import sys


def main() -> None:
    try:
        from pyedgemoe.cli import main as cli_main
        cli_main()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
