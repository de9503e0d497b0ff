"""`python -m mxfuse`: the mxfuse command line."""

import sys

from mxfuse_cli import main

sys.exit(main())
