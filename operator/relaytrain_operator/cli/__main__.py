"""`python -m relaytrain_operator.cli` is the `relaytrain` command."""

import sys

from relaytrain_operator.cli import main

sys.exit(main())
