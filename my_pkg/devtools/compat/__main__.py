"""``python -m my_pkg.devtools.compat``: runs ``check.main`` and exits with its status (0, 1 or 2)."""

import sys

from my_pkg.devtools.compat.check import main

if __name__ == "__main__":
    sys.exit(main())
