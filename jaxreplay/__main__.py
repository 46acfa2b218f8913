"""`python -m jaxreplay`: the `jaxreplay` command."""

import sys

from jaxreplay.cli import main

sys.exit(main())
