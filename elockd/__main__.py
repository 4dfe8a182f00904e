"""``python -m elockd``."""

import sys

from elockd.cli import main

sys.exit(main())
