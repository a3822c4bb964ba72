"""``python -m sharedml.cli``: the ``sharedml`` command without its console script."""

import sys

from sharedml.cli import main

if __name__ == "__main__":
    sys.exit(main())
