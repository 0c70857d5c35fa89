"""`python -m ember.tools.fuzz`."""

import sys

from ember.tools.fuzz.runner import main

sys.exit(main())
