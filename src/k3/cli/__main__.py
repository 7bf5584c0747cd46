"""`python -m k3.cli`: the same as the `k3` command."""

import sys

from k3.cli.parser import main

sys.exit(main())
