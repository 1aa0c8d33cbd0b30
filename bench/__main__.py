import signal
import sys

from bench.cli import interrupt, main

signal.signal(signal.SIGTERM, interrupt)
sys.exit(main())
