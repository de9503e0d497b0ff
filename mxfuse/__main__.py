"""`python -m mxfuse`: the mxfuse command line."""

import sys

from mxfuse.cli import main

sys.exit(main())
