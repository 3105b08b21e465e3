import sys

from crucible.cli import main

sys.exit(main())
