import sys

from benchmarks.disagg.measure import main

sys.exit(main())
