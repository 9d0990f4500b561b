import sys

from gpushare.tools.cli import main

sys.exit(main())
