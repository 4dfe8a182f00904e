"""``python -m elockd.ctl``: elockctl."""

import sys

from elockd.ctl.main import main

sys.exit(main())
