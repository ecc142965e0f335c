"""``python -m meshd``: the ``meshd`` command (same as the console script)."""

import sys

from meshd.daemon.commands.cli import main

if __name__ == "__main__":
    sys.exit(main())
