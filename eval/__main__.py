"""``python -m mtp.eval ...`` is ``mtp eval ...``."""

import sys

from mtp.eval.cli import main

sys.exit(main())
