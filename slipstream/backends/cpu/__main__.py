"""`python -m slipstream.backends.cpu [--isa ISA]`: compile the native kernels ahead of first use (make install)."""
import sys

from slipstream.backends.cpu.build import main

sys.exit(main())
