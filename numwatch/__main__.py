"""`python -m numwatch ...`: the `numwatch` command where its script is not on PATH."""

import sys

from numwatch.cli import main

sys.exit(main())
