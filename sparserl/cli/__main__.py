"""`python -m sparserl.cli ...` runs the `sparserl` command."""

import sys

from sparserl.cli import main

sys.exit(main())
