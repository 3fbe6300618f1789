"""`python -m specdec ...` is the `specdec` command (torchrun launches it this way: `-m specdec`)."""

import sys

from .cli import main

sys.exit(main())
