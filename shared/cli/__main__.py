"""`python -m shared.cli` is `kvrelay`."""

import sys

from shared.cli import main

sys.exit(main())
