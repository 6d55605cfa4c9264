"""`python -m mtp.bench ...`: the same as `mtp bench ...`."""

import sys

from mtp.bench import main

sys.exit(main())
