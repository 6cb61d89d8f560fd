"""`python -m torch_pjrt`: the `torch-pjrt` command line."""

import sys

from torch_pjrt.cli.main import main

sys.exit(main())
