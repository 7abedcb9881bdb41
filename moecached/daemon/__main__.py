import sys

from moecached.daemon.cli import main

sys.exit(main())
