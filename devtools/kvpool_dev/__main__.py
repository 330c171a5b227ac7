"""``python -m kvpool_dev``: ``kvpool-dev`` without its console script."""

import sys

from kvpool_dev.cli import main

sys.exit(main())
