import sys

from kvherd.cli import main

sys.exit(main())
