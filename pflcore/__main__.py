import sys

from pflcore.cli import main

sys.exit(main())
