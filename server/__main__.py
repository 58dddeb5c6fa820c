"""`python -m server` is the `emberserve` command."""
import sys

from server.launch.cli import main

sys.exit(main())
