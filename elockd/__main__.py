"""``python -m elockd``."""

import sys

from elockd.daemon.main import main

sys.exit(main())
