"""`python -m unirl` runs the CLI."""

from __future__ import annotations

import sys

from unirl.cli import main

sys.exit(main())
