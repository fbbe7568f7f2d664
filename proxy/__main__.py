"""python -m proxy, and the rpc-proxy console script (pyproject.toml): SIGHUP held before anything
heavy is imported (hangup.py), then the command line."""

from proxy import hangup


def main() -> int:
    """The entry point: a SIGHUP while the rest is imported and started is not an exit (hangup.py)."""
    hangup.hold()
    from proxy.cli import main as cli_main  # after hold(): its imports take a fifth of a second

    return cli_main()


if __name__ == "__main__":
    raise SystemExit(main())
