"""`python -m zddrl`: the command line (zddrl.cli), as the `zddrl` script runs it."""

from zddrl.cli import main

main()
