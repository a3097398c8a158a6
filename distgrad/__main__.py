"""``python -m distgrad``: the ``distgrad`` command (see :mod:`distgrad.cli`)."""
import sys

from distgrad.cli import main

if __name__ == "__main__":
    sys.exit(main())
