"""``python -m mixprec ...``: the same command as ``mixprec ...``."""

import sys

from mixprec.cli import main

if __name__ == "__main__":
    sys.exit(main())
