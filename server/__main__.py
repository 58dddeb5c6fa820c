"""`python -m server` is the `emberserve` command."""
from server.launch.cli import entry

entry()
