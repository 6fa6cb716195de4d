"""``python -m my_pkg ...`` entry point."""

import sys

from my_pkg.cli import main

if __name__ == "__main__":
    sys.exit(main())
