"""``python -m training_driver.collector``: the collector's command line."""
from . import main

raise SystemExit(main())
