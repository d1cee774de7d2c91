"""``python -m dsattn.native [--below -- COMMAND ...]``: the CPU class line, or COMMAND run once under each CPU
class below this machine's own (:func:`dsattn.native.isa.run_below`)."""
import sys

from .isa import main

sys.exit(main())
