"""``python -m fxopt.cli``: the ``fxopt`` command."""

import sys

from fxopt.cli import main

if __name__ == "__main__":
    sys.exit(main())
