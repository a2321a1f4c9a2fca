"""``python -m tformer.claims FILE``: the ``tformer verify-claims`` command without the rest of the CLI."""

import sys

from tformer.cli.claims import main

sys.exit(main())
