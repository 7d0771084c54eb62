import sys

from qlightning.cli import main

sys.exit(main())
