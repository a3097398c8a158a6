"""Entry point for ``python -m distgrad.launch``."""
import sys

from distgrad.launch.launcher import main

if __name__ == "__main__":
    sys.exit(main())
