"""`python -m server` is the `emberserve` command."""
import sys

from .cli import main

sys.exit(main())
