import sys

from hpdl.cli import main

sys.exit(main())
