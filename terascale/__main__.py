"""``python -m terascale ...``: the same command line as the ``terascale`` script."""

from terascale.launcher.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
