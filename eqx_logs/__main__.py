"""`python -m eqx_logs plot RUN_DIR` (draws `RUN_DIR/curves.png`; `-o IMAGE` for another)."""

import sys

from ._plot import main

if __name__ == "__main__":
    sys.exit(main())
