import sys

from p2p_diloco.cli import main

sys.exit(main())
