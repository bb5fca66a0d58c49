"""`python -m kvrelay.cli` is `kvrelay`."""

import sys

from kvrelay.cli import main

sys.exit(main())
