"""``python -m kvpool_cli``: the ``kvpool`` command without its console script."""

import sys

from kvpool_cli import main

sys.exit(main())
