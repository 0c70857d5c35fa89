"""`python -m ember.tools.opinfo`; the worker process the sweep restarts after a crash runs this way too."""

import sys

from ember.tools.opinfo.cli import main

sys.exit(main())
