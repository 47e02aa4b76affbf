import sys

from jaxgen.cli.main import main

sys.exit(main())
