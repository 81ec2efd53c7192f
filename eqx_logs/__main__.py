"""`python -m eqx_logs plot RUN_DIR -o curves.png`."""

import sys

from ._plot import main

if __name__ == "__main__":
    sys.exit(main())
