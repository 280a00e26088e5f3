"""`python -m mineru_gateway`: the same CLI as the `mineru-gateway` command."""

import sys

from mineru_gateway.entry.cli import main

sys.exit(main())
