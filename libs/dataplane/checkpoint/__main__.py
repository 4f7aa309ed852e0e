"""``python -m libs.dataplane.checkpoint convert|verify PATH``: see :mod:`libs.dataplane.checkpoint.cli`."""

import sys

from libs.dataplane.checkpoint.cli import main

if __name__ == "__main__":
    sys.exit(main())
